"""Train the bundled known-answer detector ``shapes-yolos`` on :func:`~vitcam_nb.data.shapes_detection`
(CPU, one thread, seeded).

Usage::

    python -m vitcam_nb.data.train_detection            # writes shapes-yolos.safetensors and shapes-yolos.json

The model is a transformers ``YolosForObjectDetection`` built from a tiny config (random init): a plain ViT whose
three detection tokens each predict one object. The loss uses a **fixed assignment** instead of DETR's Hungarian
matching: the generator puts object ``k`` in the ``k``-th vertical band from the left (or leaves the band empty),
and detection token ``k`` is trained on band ``k``: cross-entropy over the three classes and "no object", plus
L1 and generalized-IoU losses on the normalised ``(cx, cy, w, h)`` box where the object is present (DETR's box
losses). Every step draws a fresh batch with its own seed (``train_seed + step``); the test metrics use a seed never
used in training. The backbone starts from ``shapes-vit`` and learns at ``backbone_lr_mult`` times the rate of the
tokens, positions and heads (at the full rate the copied features collapse and every detection predicts the mean
box); detection token ``k`` starts at the mean position of the patches of band ``k``. Runs are deterministic for a
given torch build (one thread, deterministic algorithms).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitcam_nb.core.provenance import file_sha256
from vitcam_nb.data.shapes_detection import DET_CLASS_NAMES, MAX_OBJECTS, detection_generator_settings, shapes_detection
from vitcam_nb.data.train import learning_rate, library_versions, write_bundled

NAME = "shapes-yolos"
MODELS_DIR = Path(__file__).resolve().parent / "models"
#: ImageNet statistics: what vitcam_nb's hf_yolos adapter (YolosImageProcessor's defaults) normalises with.
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

CONFIG: dict = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 256,
                "image_size": [64, 64], "patch_size": 8, "num_channels": 3, "num_detection_tokens": MAX_OBJECTS,
                "use_mid_position_embeddings": True, "hidden_dropout_prob": 0.0,
                "attention_probs_dropout_prob": 0.0, "num_labels": len(DET_CLASS_NAMES),
                "id2label": {str(i): c for i, c in enumerate(DET_CLASS_NAMES)},
                "label2id": {c: i for i, c in enumerate(DET_CLASS_NAMES)}}
TRAIN: dict = {"steps": 6000, "batch_size": 32, "lr": 1e-3, "backbone_lr_mult": 0.2, "min_lr": 1e-5,
               "weight_decay": 0.01, "warmup_steps": 50, "grad_clip": 1.0, "box_weight": 5.0, "giou_weight": 2.0,
               "n_test": 500, "log_every": 250, "train_seed": 20_000, "test_seed": 90_020, "init_from": "shapes-vit"}


def build_detector(config: dict | None = None) -> torch.nn.Module:
    """A random-init ``YolosForObjectDetection`` from the tiny config (eager attention).

    Example:
        >>> build_detector().config.num_detection_tokens
        3
    """
    import transformers

    cfg = transformers.YolosConfig(**(config or CONFIG))
    model = transformers.YolosForObjectDetection(cfg)
    _init_tokens(model.vit.embeddings, cfg)
    # The heads are three-layer MLPs without residuals: at transformers' N(0, 0.02) a 64-wide layer scales its
    # input by ~0.16, so the boxes and logits start (and stay) nearly the same for every image. torch's own
    # Linear init (uniform, ~1 / sqrt(3 fan_in)) keeps the signal.
    torch.manual_seed(0)
    for head in (model.class_labels_classifier, model.bbox_predictor):
        for layer in head.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.reset_parameters()
    return model


def _init_tokens(emb: torch.nn.Module, cfg: object) -> None:
    """YOLOS starts its class token, detection tokens and position embeddings at zero: three identical detection
    tokens and no position. Here the patch positions start as the fixed 2-D sine-cosine table of MAE (so a token
    knows where it is from the first step) and the class and detection tokens and their positions as
    N(0, 0.02) (timm's ViT init), so the detection tokens differ from the first step."""
    g = int(cfg.image_size[0]) // int(cfg.patch_size)
    d = int(cfg.hidden_size)
    omega = 1.0 / 10000 ** (torch.arange(d // 4, dtype=torch.float64) / (d // 4))
    rows, cols = torch.meshgrid(torch.arange(g, dtype=torch.float64), torch.arange(g, dtype=torch.float64),
                                indexing="ij")
    parts = [f(a.reshape(-1, 1) * omega) for a in (cols, rows) for f in (torch.sin, torch.cos)]
    with torch.no_grad():
        emb.position_embeddings[0, 1:1 + g * g] = torch.cat(parts, 1).float()
        for t in (emb.cls_token, emb.detection_tokens, emb.position_embeddings[:, :1],
                  emb.position_embeddings[:, 1 + g * g:]):
            torch.nn.init.trunc_normal_(t, std=0.02)


def _from_shapes_vit(model: torch.nn.Module, weights: Path) -> dict:
    """Copy the backbone of the bundled classifier (a timm ViT of the same width, depth and patch size, trained on
    single shapes) into the YOLOS backbone, as YOLOS starts from a pretrained DeiT: patch embedding, class token,
    the class and patch position embeddings, every block (timm's fused qkv split into query, key, value) and the
    final norm. The detection tokens, their positions and the two heads keep their init."""
    from safetensors.torch import load_file

    src, vit = load_file(str(weights)), model.vit
    d = int(model.config.hidden_size)
    pairs = {"embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
             "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
             "embeddings.cls_token": "cls_token", "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias"}
    for i in range(int(model.config.num_hidden_layers)):
        yl, tb = f"encoder.layer.{i}.", f"blocks.{i}."
        for a, b in (("layernorm_before", "norm1"), ("layernorm_after", "norm2"),
                     ("attention.output.dense", "attn.proj"), ("intermediate.dense", "mlp.fc1"),
                     ("output.dense", "mlp.fc2")):
            for p in ("weight", "bias"):
                pairs[f"{yl}{a}.{p}"] = f"{tb}{b}.{p}"
    state = vit.state_dict()
    for dst, key in pairs.items():
        state[dst] = src[key]
    for i in range(int(model.config.num_hidden_layers)):
        for j, name in enumerate(("query", "key", "value")):
            for p in ("weight", "bias"):
                qkv = src[f"blocks.{i}.attn.qkv.{p}"]
                state[f"encoder.layer.{i}.attention.attention.{name}.{p}"] = qkv[j * d:(j + 1) * d]
    n_pos = src["pos_embed"].shape[1]  # class token + patches; the detection tokens' positions come after
    state["embeddings.position_embeddings"][:, :n_pos] = src["pos_embed"]
    vit.load_state_dict(state)
    return {"name": weights.stem, "weights_sha256": file_sha256(weights),
            "copied": "patch embedding, class token, class and patch positions, all blocks, final norm"}


def _band_positions(model: torch.nn.Module) -> None:
    """Detection token ``k`` reports the object of band ``k``: its position embedding starts at the mean position
    embedding of the patch columns of band ``k`` (a patch column belongs to the band holding its centre)."""
    emb, g = model.vit.embeddings, int(model.config.image_size[0]) // int(model.config.patch_size)
    centres = (np.arange(g) + 0.5) * MAX_OBJECTS / g  # column centres in band units
    with torch.no_grad():
        patches = emb.position_embeddings[0, 1:1 + g * g].reshape(g, g, -1)
        for k in range(MAX_OBJECTS):
            cols = torch.from_numpy(np.nonzero(np.floor(centres) == k)[0])
            emb.position_embeddings[0, 1 + g * g + k] = patches[:, cols].mean((0, 1))


def normalise(images: np.ndarray) -> torch.Tensor:
    """uint8 (n, H, W, 3) -> float32 (n, 3, H, W): ``(x / 255 - MEAN) / STD`` with ImageNet statistics.

    Example:
        >>> normalise(np.zeros((1, 64, 64, 3), np.uint8)).shape
        torch.Size([1, 3, 64, 64])
    """
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255.0)
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def to_cxcywh(boxes: np.ndarray, size: int) -> np.ndarray:
    """(..., 4) pixel (x0, y0, x1, y1) -> (cx, cy, w, h) in [0, 1] (YOLOS's ``pred_boxes`` format).

    Example:
        >>> to_cxcywh(np.array([0.0, 0.0, 32.0, 16.0]), 64).tolist()
        [0.25, 0.125, 0.5, 0.25]
    """
    b = np.asarray(boxes, np.float32) / size
    return np.stack([(b[..., 0] + b[..., 2]) / 2, (b[..., 1] + b[..., 3]) / 2, b[..., 2] - b[..., 0],
                     b[..., 3] - b[..., 1]], -1)


def to_corners(pred: np.ndarray, size: int) -> np.ndarray:
    """(..., 4) (cx, cy, w, h) in [0, 1] -> pixel (x0, y0, x1, y1).

    Example:
        >>> to_corners(np.array([0.25, 0.125, 0.5, 0.25]), 64).tolist()
        [0.0, 0.0, 32.0, 16.0]
    """
    p = np.asarray(pred, np.float64) * size
    return np.stack([p[..., 0] - p[..., 2] / 2, p[..., 1] - p[..., 3] / 2, p[..., 0] + p[..., 2] / 2,
                     p[..., 1] + p[..., 3] / 2], -1)


def fixed_assignment_loss(logits: torch.Tensor, pred_boxes: torch.Tensor, labels: torch.Tensor,
                          boxes: torch.Tensor, box_weight: float, giou_weight: float = 2.0) -> torch.Tensor:
    """Detection token k <-> object k: cross-entropy over classes + "no object" (the last logit) for every token,
    plus ``box_weight`` x L1 on (cx, cy, w, h) and ``giou_weight`` x (1 - generalized IoU) for tokens whose object
    is present (DETR's box losses, without its Hungarian matching).

    Example:
        >>> lg = torch.zeros(1, 3, 4); pb = torch.full((1, 3, 4), 0.5)
        >>> round(float(fixed_assignment_loss(lg, pb, torch.tensor([[0, 1, -1]]), pb.clone(), 5.0, 2.0)), 4)
        1.3863
    """
    n_cls = logits.shape[-1] - 1
    target = torch.where(labels >= 0, labels, torch.full_like(labels, n_cls))
    ce = F.cross_entropy(logits.reshape(-1, n_cls + 1), target.reshape(-1))
    present = labels >= 0
    if not bool(present.any()):
        return ce
    l1 = (pred_boxes - boxes).abs().sum(-1)[present].mean()
    return ce + box_weight * l1 + giou_weight * (1.0 - generalized_iou(pred_boxes[present], boxes[present])).mean()


def generalized_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Generalized IoU (Rezatofighi et al. 2019) of matching rows of two (N, 4) (cx, cy, w, h) box tensors.

    Example:
        >>> box = torch.tensor([[0.5, 0.5, 0.2, 0.2]])
        >>> float(generalized_iou(box, box))
        1.0
    """
    def corners(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, :2] - t[:, 2:] / 2, t[:, :2] + t[:, 2:] / 2], -1)

    a, b = corners(a), corners(b)
    area_a, area_b = (a[:, 2:] - a[:, :2]).prod(-1), (b[:, 2:] - b[:, :2]).prod(-1)
    inter = (torch.minimum(a[:, 2:], b[:, 2:]) - torch.maximum(a[:, :2], b[:, :2])).clamp(min=0).prod(-1)
    union = area_a + area_b - inter
    hull = (torch.maximum(a[:, 2:], b[:, 2:]) - torch.minimum(a[:, :2], b[:, :2])).prod(-1)
    return inter / union - (hull - union) / hull


@torch.no_grad()
def evaluate_detector(model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, boxes: np.ndarray,
                      batch_size: int = 250) -> dict:
    """Known-answer metrics of detection token k against object k: mean IoU of present objects, the share with
    IoU >= 0.5, class accuracy on present objects, and "no object" accuracy on absent ones.

    Example:
        >>> m = build_detector().eval()
        >>> sorted(evaluate_detector(m, *shapes_detection(4, seed=0)[:3]))
        ['class_accuracy', 'iou_at_0.5', 'mean_iou', 'no_object_accuracy']
    """
    from vitcam_nb.targets.detection import box_iou

    was = model.training
    model.eval()
    size = images.shape[1]
    logits, pred = [], []
    for i in range(0, len(images), batch_size):
        out = model(pixel_values=normalise(images[i: i + batch_size]))
        logits.append(out.logits.numpy())
        pred.append(out.pred_boxes.numpy())
    model.train(was)
    lg, corners = np.concatenate(logits), to_corners(np.concatenate(pred), size)
    present = labels >= 0
    ious = np.array([box_iou(boxes[i, k], corners[i, k: k + 1])[0] for i, k in zip(*np.nonzero(present))])
    top = lg.argmax(-1)
    return {"mean_iou": float(ious.mean()) if ious.size else float("nan"),
            "iou_at_0.5": float((ious >= 0.5).mean()) if ious.size else float("nan"),
            "class_accuracy": float((top[present] == labels[present]).mean()),
            "no_object_accuracy": float((top[~present] == lg.shape[-1] - 1).mean()) if (~present).any() else 1.0}


def train(out: str | Path = MODELS_DIR, log=print, **overrides) -> dict:
    """Train ``shapes-yolos`` and write its safetensors weights and JSON card to ``out``; returns the card.

    Example:
        >>> card = train(out="/tmp/vitcam_models", steps=2)  # doctest: +SKIP
    """
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _train(dict(TRAIN, **overrides), Path(out), log)
    finally:  # a process setting of the caller's: restored
        torch.use_deterministic_algorithms(deterministic)


def _train(cfg: dict, out: Path, log) -> dict:
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(cfg["train_seed"])
    model = build_detector()
    init_from = _from_shapes_vit(model, MODELS_DIR / f"{cfg['init_from']}.safetensors") if cfg["init_from"] else None
    _band_positions(model)
    model.train()
    groups = []
    for n, p in model.named_parameters():
        fresh = not n.startswith("vit.") or "token" in n or "position" in n  # not copied from the classifier
        decay = p.ndim > 1 and "token" not in n and "position" not in n
        groups.append({"params": [p], "weight_decay": cfg["weight_decay"] if decay else 0.0,
                       "lr_mult": 1.0 if fresh or not init_from else cfg["backbone_lr_mult"]})
    opt = torch.optim.AdamW(groups, lr=cfg["lr"])
    total = cfg["steps"]
    test = shapes_detection(cfg["n_test"], seed=cfg["test_seed"])[:3]
    t0, running, history = time.time(), 0.0, []
    for step in range(total):
        images, labels, boxes, _ = shapes_detection(cfg["batch_size"], seed=cfg["train_seed"] + step)
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, total, cfg) * group["lr_mult"]
        pred = model(pixel_values=normalise(images))
        loss = fixed_assignment_loss(pred.logits, pred.pred_boxes, torch.from_numpy(labels),
                                     torch.from_numpy(to_cxcywh(boxes, images.shape[1])), cfg["box_weight"],
                                     cfg["giou_weight"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        opt.step()
        running += loss.item()
        if (step + 1) % cfg["log_every"] == 0 or step + 1 == total:
            metrics = evaluate_detector(model, *test)
            n = (step % cfg["log_every"]) + 1
            history.append({"step": step + 1, "train_loss": round(running / n, 5),
                            **{k: round(v, 4) for k, v in metrics.items()}})
            running = 0.0
            log(f"[{NAME}] step {step + 1}/{total} {history[-1]} ({time.time() - t0:.0f}s)")
    seconds = time.time() - t0
    model.eval()
    metrics = evaluate_detector(model, *test)
    card = {
        "name": NAME,
        "task": f"detection of 2-3 shapes ({', '.join(DET_CLASS_NAMES)}) per image, boxes known",
        "description": "tiny YOLOS (transformers YolosForObjectDetection: 6 layers, dim 64, 4 heads, 8x8 patches, "
                       "64x64 input, 3 detection tokens), backbone initialised from shapes-vit, trained with a fixed "
                       "assignment: detection token k reports the object of the k-th vertical band from the left. The "
                       "mask of object k is the known answer of a map of detection k.",
        "classes": list(DET_CLASS_NAMES),
        "hf_class": "transformers.YolosForObjectDetection",
        "hf_config": CONFIG,
        "pretrained_cfg": {"architecture": "yolos_shapes", "tag": NAME, "hf_hub_id": None, "url": None,
                           "source": "vitcam_nb bundled", "input_size": [3, 64, 64], "mean": list(MEAN),
                           "std": list(STD), "label_names": list(DET_CLASS_NAMES), "license": "MIT"},
        "preprocessing": "uint8 RGB (64, 64, 3) -> x / 255 -> (x - mean) / std with ImageNet mean and std, the "
                         "defaults of YolosImageProcessor that vitcam_nb's hf_yolos adapter uses (no resize at 64x64)",
        "mean": list(MEAN), "std": list(STD),
        "data": {"generator": "vitcam_nb.data.shapes_detection.shapes_detection(n, seed, size=64)",
                 "generator_settings": detection_generator_settings(),
                 "train_seeds": f"{cfg['train_seed']} + step, one fresh batch of {cfg['batch_size']} per step",
                 "test_seed": cfg["test_seed"], "n_test": cfg["n_test"]},
        "test_accuracy": metrics["class_accuracy"],
        "test_metrics": metrics,
        "training": {"optimizer": "AdamW (betas 0.9, 0.999; no weight decay on biases, norms, tokens, positions)",
                     "schedule": "linear warmup then cosine decay to min_lr, per step",
                     "init": "transformers' YOLOS init, except: patch position embeddings = 2-D sine-cosine table "
                             "(MAE); class token, detection tokens and their position embeddings ~ N(0, 0.02) "
                             "truncated (YOLOS starts them at zero); the two heads' Linear layers torch's default "
                             "init (seed 0); then the backbone copied from init_from; then the position of "
                             "detection token k = the mean position embedding of the patches of band k",
                     "backbone": "the parameters copied from init_from learn at backbone_lr_mult x lr",
                     "loss": "fixed assignment (detection token k <-> the object of band k from the left; no Hungarian "
                             "matching): cross-entropy over classes + no-object, plus box_weight x L1 on (cx, cy, "
                             "w, h) and giou_weight x (1 - generalized IoU) of present objects",
                     **cfg, "init_from": init_from, "seconds": round(seconds, 1),
                     "threads": torch.get_num_threads(), "history": history},
        "versions": library_versions(transformers),
    }
    weights_path = write_bundled(model, card, out, NAME)
    log(f"[{NAME}] test {metrics}; wrote {weights_path} ({seconds:.0f}s)")
    return card


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Example:
        >>> main(["--out", "/tmp/vitcam_models", "--steps", "2"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(MODELS_DIR))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    args = parser.parse_args(argv)
    train(args.out, **{k: v for k, v in (("steps", args.steps), ("lr", args.lr)) if v is not None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
