"""Train the bundled segmentation model ``shapes-vit-seg`` on synthetic shapes (CPU, seeded, reproducible).

Usage::

    python -m vitcam_nb.data.train_seg

A :class:`~vitcam_nb.data.segmenter.LinearSegmenter` with shapes-vit's architecture, its backbone initialised from
the bundled ``shapes-vit`` weights, learns per-pixel labels (0 background, 1 + the class index on the class
object's pixels, from the masks :func:`vitcam_nb.data.shapes.shapes` returns). Every epoch draws fresh images with
its own seed; pixel accuracy and intersection-over-union are measured on images from a seed never used in
training and recorded in the card next to the weights (safetensors).

Example:
    >>> pixel_labels(np.array([2]), np.ones((1, 2, 2), bool))[0].tolist()
    [[3, 3], [3, 3]]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitcam_nb.data.segmenter import LinearSegmenter
from vitcam_nb.data.shapes import CLASS_NAMES, generator_settings, shapes
from vitcam_nb.data.train import MODELS_DIR, SPECS, library_versions, normalise, pretrained_cfg, write_bundled

__all__ = ["NAME", "SEG_CLASSES", "evaluate", "pixel_labels", "train"]

NAME = "shapes-vit-seg"
SEG_CLASSES = ["background", *CLASS_NAMES]
SETTINGS = {"init_from": "shapes-vit", "epochs": 5, "images_per_epoch": 3200, "batch_size": 64, "lr": 1e-3,
            "weight_decay": 0.01, "train_seed": 7_000, "test_seed": 7_999, "n_test": 500}


def pixel_labels(labels: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Per-pixel labels: 0 outside the class object, ``1 + label`` on it.

    Example:
        >>> pixel_labels(np.array([0]), np.zeros((1, 2, 2), bool)).max()
        np.int64(0)
    """
    return np.where(masks, labels[:, None, None] + 1, 0).astype(np.int64)


@torch.no_grad()
def evaluate(model: torch.nn.Module, images: np.ndarray, target: np.ndarray, batch_size: int = 100) -> dict:
    """Pixel accuracy, IoU per class and their mean (classes absent from both prediction and truth left out).

    Example:
        >>> m = LinearSegmenter(6, img_size=64, patch_size=8, embed_dim=16, depth=1, num_heads=2)
        >>> sorted(evaluate(m, *[a[:2] for a in (shapes(2, 0)[0], np.zeros((2, 64, 64), np.int64))]))
        ['iou', 'mean_iou', 'pixel_accuracy']
    """
    was = model.training
    model.eval()
    pred = np.concatenate([model(normalise(images[i:i + batch_size])).argmax(1).numpy()
                           for i in range(0, len(images), batch_size)])
    model.train(was)
    iou = {}
    for c, name in enumerate(SEG_CLASSES):
        union = np.logical_or(pred == c, target == c).sum()
        if union:
            iou[name] = float(np.logical_and(pred == c, target == c).sum() / union)
    return {"pixel_accuracy": float((pred == target).mean()), "iou": iou,
            "mean_iou": float(np.mean(list(iou.values())))}


def train(out: str | Path = MODELS_DIR, log=print, **overrides) -> dict:
    """Train ``shapes-vit-seg`` and write its weights and card to ``out``; returns the card.

    Example:
        >>> card = train(out="/tmp/vitcam_models", epochs=1)  # doctest: +SKIP
    """
    import timm
    from safetensors.torch import load_file

    cfg = dict(SETTINGS, **overrides)
    torch.set_num_threads(1)
    torch.manual_seed(cfg["train_seed"])
    torch.use_deterministic_algorithms(True)
    arch = {k: v for k, v in SPECS["shapes-vit"]["arch"].items() if k != "num_classes"}
    model = LinearSegmenter(len(SEG_CLASSES), **arch)
    backbone = {k: v for k, v in load_file(str(Path(out) / f"{cfg['init_from']}.safetensors")).items()
                if not k.startswith("head.")}
    missing = model.load_state_dict(backbone, strict=False).missing_keys
    assert sorted(missing) == ["seg_head.bias", "seg_head.weight"], missing
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    steps = cfg["images_per_epoch"] // cfg["batch_size"]
    t0, history = time.time(), []
    for epoch in range(cfg["epochs"]):
        images, labels, masks = shapes(cfg["images_per_epoch"], seed=cfg["train_seed"] + epoch)
        target = pixel_labels(labels, masks)
        order = torch.randperm(len(images)).numpy()
        running = 0.0
        for i in range(steps):
            idx = order[i * cfg["batch_size"]:(i + 1) * cfg["batch_size"]]
            loss = F.cross_entropy(model(normalise(images[idx])), torch.from_numpy(target[idx]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.item()
        history.append({"epoch": epoch, "loss": round(running / steps, 4)})
        log(f"[{NAME}] epoch {epoch} loss {running / steps:.4f} ({time.time() - t0:.0f}s)")
    seconds = time.time() - t0
    test_images, test_labels, test_masks = shapes(cfg["n_test"], seed=cfg["test_seed"])
    scores = evaluate(model, test_images, pixel_labels(test_labels, test_masks))
    pcfg = {**pretrained_cfg(NAME, SPECS["shapes-vit"]["arch"]), "architecture": "vit_shapes_linear_seg",
            "num_classes": len(SEG_CLASSES), "label_names": tuple(SEG_CLASSES), "classifier": "seg_head"}
    card = {
        "name": NAME, "task": "semantic segmentation (background + 5 shapes)",
        "description": "shapes-vit's backbone with a per-token linear head (Segmenter-linear / SETR-naive), "
                       "fine-tuned for per-pixel labels; the known answer of a region target is the object mask",
        "classes": SEG_CLASSES, "timm_class": "vitcam_nb.data.segmenter.LinearSegmenter",
        "timm_kwargs": {**arch, "num_seg_classes": len(SEG_CLASSES)}, "pretrained_cfg": pcfg,
        "data": {"generator": generator_settings(),
                 "train_seeds": [cfg["train_seed"] + e for e in range(cfg["epochs"])],
                 "test_seed": cfg["test_seed"], "n_test": cfg["n_test"]},
        "test_accuracy": scores["pixel_accuracy"], "test_mean_iou": scores["mean_iou"], "test_iou": scores["iou"],
        "training": {**cfg, "optimizer": "AdamW", "loss": "per-pixel cross-entropy", "steps": steps * cfg["epochs"],
                     "seconds": round(seconds, 1), "threads": torch.get_num_threads(), "history": history},
        "versions": library_versions(timm),
    }
    write_bundled(model, card, out, NAME)
    log(f"[{NAME}] pixel accuracy {scores['pixel_accuracy']:.4f}, mean IoU {scores['mean_iou']:.4f} ({seconds:.0f}s)")
    return card


if __name__ == "__main__":
    train(log=lambda s: print(s, file=sys.stderr, flush=True))
