"""Train the bundled known-answer video model ``shapes-video`` on synthetic moving-shape clips (CPU, seeded).

Usage::

    python -m vitcam_nb.data.train_video

A tiny ``transformers.VideoMAEForVideoClassification`` (random init from the config below: 2 layers, hidden 48,
32x32 frames, 8x8 patches, tubelets of 2 frames, 4 frames, mean pooling) learns the class of the one moving shape
of :func:`vitcam_nb.data.shapes_video.shape_clips`, which is present in two of the four frames only. The training
clips are one set from ``train_seed``, reshuffled every epoch; the test accuracy is measured on clips from a seed
never used in training. The
script writes ``shapes-video.safetensors`` (the state dict) and ``shapes-video.json`` (the model card: config,
data, seeds, training settings, accuracy, hashes) to ``--out`` (default: the package's ``data/models`` folder).
Runs are deterministic for a given torch build; the script pins one thread.

Example:
    >>> normalise_clips(np.zeros((1, 4, 32, 32, 3), np.uint8)).shape
    torch.Size([1, 4, 3, 32, 32])
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitcam_nb.data.shapes import MEAN, STD
from vitcam_nb.data.shapes_video import CLASS_NAMES, shape_clips, video_generator_settings
from vitcam_nb.data.train import MODELS_DIR, learning_rate, library_versions, write_bundled

__all__ = ["CONFIG", "HF_CLASS", "NAME", "SETTINGS", "accuracy", "build_video_model", "normalise_clips", "train"]

NAME = "shapes-video"
HF_CLASS = "transformers.VideoMAEForVideoClassification"
#: The VideoMAEConfig of the bundled model (labels added from CLASS_NAMES).
CONFIG: dict = {"image_size": 32, "patch_size": 8, "num_channels": 3, "num_frames": 4, "tubelet_size": 2,
                "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 3, "intermediate_size": 96,
                "use_mean_pooling": True, "num_labels": len(CLASS_NAMES)}
SETTINGS: dict = {"epochs": 20, "n_train": 16384, "batch_size": 64, "lr": 3e-3, "min_lr": 1e-4,
                  "weight_decay": 0.01, "warmup_steps": 30, "grad_clip": 1.0, "n_test": 1000, "span": 2,
                  "train_seed": 60_000, "test_seed": 69_001}


def build_video_model(config: dict = CONFIG) -> torch.nn.Module:
    """A random-init ``VideoMAEForVideoClassification`` from ``config`` (labels named after the shapes).

    Example:
        >>> type(build_video_model()).__name__
        'VideoMAEForVideoClassification'
    """
    from transformers import VideoMAEConfig, VideoMAEForVideoClassification

    cfg = VideoMAEConfig(**config, id2label=dict(enumerate(CLASS_NAMES)),
                         label2id={n: i for i, n in enumerate(CLASS_NAMES)})
    return VideoMAEForVideoClassification(cfg)


def normalise_clips(clips: np.ndarray) -> torch.Tensor:
    """uint8 (n, T, H, W, 3) -> float32 (n, T, 3, H, W), ``(x / 255 - MEAN) / STD`` (the shapes models' rule).

    Example:
        >>> float(normalise_clips(np.full((1, 1, 2, 2, 3), 255, np.uint8)).max())
        2.0
    """
    x = torch.from_numpy(np.ascontiguousarray(clips)).permute(0, 1, 4, 2, 3).float().div_(255.0)
    mean = torch.tensor(MEAN, dtype=torch.float32).view(1, 1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float32).view(1, 1, 3, 1, 1)
    return (x - mean) / std


@torch.no_grad()
def accuracy(model: torch.nn.Module, clips: np.ndarray, labels: np.ndarray, batch_size: int = 250) -> float:
    """Top-1 accuracy of ``model`` on uint8 clips.

    Example:
        >>> 0.0 <= accuracy(build_video_model().eval(), *shape_clips(4, seed=0)[:2]) <= 1.0
        True
    """
    was = model.training
    model.eval()
    correct = 0
    for i in range(0, len(clips), batch_size):
        logits = model(pixel_values=normalise_clips(clips[i:i + batch_size])).logits
        correct += int((logits.argmax(1).numpy() == labels[i:i + batch_size]).sum())
    model.train(was)
    return correct / max(1, len(clips))


def train(out: str | Path = MODELS_DIR, log=print, **overrides) -> dict:
    """Train ``shapes-video`` and write its weights and card to ``out``; returns the card.

    Example:
        >>> card = train(out="/tmp/vitcam_models", epochs=1)  # doctest: +SKIP
    """
    import transformers

    cfg = dict(SETTINGS, **overrides)
    torch.set_num_threads(1)
    torch.manual_seed(cfg["train_seed"])
    torch.use_deterministic_algorithms(True)
    model = build_video_model()
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg["lr"])
    steps_per_epoch = cfg["n_train"] // cfg["batch_size"]
    total = cfg["epochs"] * steps_per_epoch
    frames, size = CONFIG["num_frames"], CONFIG["image_size"]
    test_clips, test_labels, _, _ = shape_clips(cfg["n_test"], cfg["test_seed"], frames, size, cfg["span"])
    t0, step, history = time.time(), 0, []
    # one fixed training set (generating clips costs more than a training step), reshuffled every epoch
    clips, labels, _, _ = shape_clips(cfg["n_train"], cfg["train_seed"], frames, size, cfg["span"])
    for epoch in range(cfg["epochs"]):
        order = torch.randperm(len(clips))  # seeded by torch.manual_seed above
        running = 0.0
        for i in range(steps_per_epoch):
            idx = order[i * cfg["batch_size"]:(i + 1) * cfg["batch_size"]].numpy()
            for group in opt.param_groups:
                group["lr"] = learning_rate(step, total, cfg)
            loss = F.cross_entropy(model(pixel_values=normalise_clips(clips[idx])).logits,
                                   torch.from_numpy(labels[idx]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            opt.step()
            running += loss.item()
            step += 1
        acc = accuracy(model, test_clips, test_labels)
        history.append({"epoch": epoch + 1, "train_loss": round(running / steps_per_epoch, 5), "test_accuracy": acc})
        log(f"[{NAME}] epoch {epoch + 1}/{cfg['epochs']} loss {running / steps_per_epoch:.4f} test acc {acc:.4f} "
            f"({time.time() - t0:.0f}s)")
    seconds = time.time() - t0
    model.eval()
    card = {
        "name": NAME,
        "task": "shapes-5 video classification: one moving shape in 2 of 4 frames, with moving distractors",
        "description": "VideoMAE (2 layers, hidden 48, 3 heads, 32x32 frames, 8x8 patches, tubelets of 2 frames, 4 "
                       "frames, mean pooling), random init, trained on moving-shape clips. The class object is "
                       "present in one tubelet's two frames only: its frames and masks are the known answer in "
                       "time and space.",
        "classes": list(CLASS_NAMES),
        "hf_class": HF_CLASS,
        "hf_config": CONFIG,
        "preprocessing": "uint8 RGB clip (4, 32, 32, 3) -> x / 255 -> (x - mean) / std per channel -> (T, C, H, W) "
                         f"float32, mean {list(MEAN)}, std {list(STD)} (vitcam_nb.data.train_video.normalise_clips)",
        "mean": list(MEAN),
        "std": list(STD),
        "data": {
            "generator": f"vitcam_nb.data.shapes_video.shape_clips(n, seed, frames=4, size=32, span={cfg['span']})",
            "generator_settings": video_generator_settings(),
            "train_seed": cfg["train_seed"],
            "n_train_clips": cfg["n_train"],
            "test_seed": cfg["test_seed"],
            "n_test": cfg["n_test"],
        },
        "test_accuracy": accuracy(model, test_clips, test_labels),
        "training": {
            "optimizer": "AdamW (betas 0.9, 0.999; no weight decay on biases and norms)",
            "schedule": "linear warmup then cosine decay to min_lr, per step",
            "loss": "cross-entropy",
            "augmentation": "none (one fixed set of synthetic clips, reshuffled every epoch)",
            **cfg, "steps": total, "seconds": round(seconds, 1), "threads": torch.get_num_threads(),
            "history": history,
        },
        "versions": library_versions(transformers),
    }
    weights_path = write_bundled(model, card, out, NAME)
    log(f"[{NAME}] test accuracy {card['test_accuracy']:.4f}; wrote {weights_path} ({seconds:.0f}s)")
    return card


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``python -m vitcam_nb.data.train_video [--out DIR] [--epochs N]``.

    Example:
        >>> main(["--out", "/tmp/m", "--epochs", "1"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(MODELS_DIR), help="output folder (default: the package's)")
    for key in ("epochs", "n_train", "batch_size", "n_test"):
        parser.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    parser.add_argument("--lr", type=float)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    train(out=out, log=lambda msg: print(msg, flush=True), **{k: v for k, v in args.items() if v is not None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
