"""Train the bundled known-answer ViTs on synthetic shapes (CPU, seeded, reproducible).

Usage::

    python -m vitcam_nb.data.train --model shapes-vit
    python -m vitcam_nb.data.train --model all            # the three bundled models, one after another

Every epoch draws fresh images from :func:`vitcam_nb.data.shapes.shapes` with its own seed, so the training set
is ``epochs x images_per_epoch`` distinct images and the recorded seeds regenerate it. The test accuracy is
measured on images from a seed never used in training. The script writes ``<name>.safetensors`` (the state
dict) and ``<name>.json`` (the model card) to ``--out`` (default: the package's ``data/models`` folder).

Runs are deterministic for a given torch build and thread count; the script pins one thread.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.provenance import file_sha256
from vitcam_nb.data.shapes import CLASS_NAMES, MEAN, STD, generator_settings, shapes

MODELS_DIR = Path(__file__).resolve().parent / "models"

_BASE_ARCH: dict = {
    "img_size": 64,
    "patch_size": 8,
    "in_chans": 3,
    "num_classes": len(CLASS_NAMES),
    "embed_dim": 64,
    "depth": 6,
    "num_heads": 4,
    "mlp_ratio": 4.0,
    "qkv_bias": True,
    "class_token": True,
    "global_pool": "token",
}

_BASE_TRAIN: dict = {
    "epochs": 14,
    "images_per_epoch": 12_800,
    "batch_size": 64,
    "lr": 1e-3,
    "min_lr": 1e-5,
    "weight_decay": 0.05,
    "warmup_steps": 100,
    "grad_clip": 1.0,
    "n_test": 1000,
}

# name -> card fields + architecture + data + training settings
SPECS: dict[str, dict] = {
    "shapes-vit": {
        "task": "shapes-5 classification (circle, square, triangle, cross, ring) with distractors",
        "description": "ViT (6 blocks, dim 64, 4 heads, 8x8 patches, 64x64 input), class token pooling. "
        "The evidence for the class is the one large shape; its mask is the known answer.",
        "arch": dict(_BASE_ARCH),
        "shortcut": False,
        "train_seed": 10_000,
        "test_seed": 90_001,
        "train": dict(_BASE_TRAIN),
    },
    "shapes-vit-reg4": {
        "task": "shapes-5 classification (circle, square, triangle, cross, ring) with distractors",
        "description": "Like shapes-vit plus 4 register tokens (class token + 4 registers, position "
        "embedding on patches only, as in DINOv2-reg): 5 prefix tokens to handle. Initialised from "
        "shapes-vit, then trained further with the registers.",
        "arch": dict(_BASE_ARCH, reg_tokens=4, no_embed_class=True),
        "shortcut": False,
        "train_seed": 20_000,
        "test_seed": 90_002,
        "init_from": "shapes-vit",
        "train": dict(_BASE_TRAIN, epochs=4, lr=3e-4, warmup_steps=50),
    },
    "shapes-vit-shortcut": {
        "task": "shapes-5 classification, trained with a spurious class-coded corner mark",
        "description": "Same architecture as shapes-vit, trained on images where a small coloured square "
        "in a class-specific corner gives the label away. It scores perfectly when the mark agrees with "
        "the class and at chance when the mark is random or absent: it reads the mark, not the shape, "
        "so a faithful heatmap points at the corner.",
        "arch": dict(_BASE_ARCH),
        "shortcut": True,
        "train_seed": 30_000,
        "test_seed": 90_003,
        "train": dict(_BASE_TRAIN, epochs=4),
    },
}


def pretrained_cfg(name: str, arch: dict) -> dict:
    """The timm ``pretrained_cfg`` of a bundled model: what ``timm.data.resolve_data_config`` reads.

    Example:
        >>> cfg = pretrained_cfg("shapes-vit", SPECS["shapes-vit"]["arch"])
        >>> cfg["input_size"], cfg["crop_pct"]
        ((3, 64, 64), 1.0)
    """
    size = arch["img_size"]
    return {
        "architecture": "vit_shapes",
        "tag": name,
        "hf_hub_id": None,
        "url": None,
        "source": "vitcam_nb bundled",
        "input_size": (3, size, size),
        "fixed_input_size": True,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "center",
        "mean": tuple(MEAN),
        "std": tuple(STD),
        "num_classes": arch["num_classes"],
        "label_names": tuple(CLASS_NAMES),
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "MIT",
    }


def build_model(arch: dict) -> torch.nn.Module:
    """A timm ``VisionTransformer`` from constructor kwargs (random init).

    Example:
        >>> m = build_model(SPECS["shapes-vit"]["arch"])
        >>> type(m).__name__
        'VisionTransformer'
    """
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(**arch)


def normalise(images: np.ndarray) -> torch.Tensor:
    """uint8 (n, H, W, 3) -> float32 (n, 3, H, W), ``(x / 255 - MEAN) / STD`` (timm's eval transform).

    Example:
        >>> normalise(np.zeros((1, 64, 64, 3), np.uint8)).shape
        torch.Size([1, 3, 64, 64])
    """
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255.0)
    mean = torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1)
    return (x - mean) / std


@torch.no_grad()
def accuracy(model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, batch_size: int = 250) -> float:
    """Top-1 accuracy of ``model`` on uint8 images.

    Example:
        >>> m = build_model(SPECS["shapes-vit"]["arch"]).eval()
        >>> 0.0 <= accuracy(m, *shapes(4, seed=0)[:2]) <= 1.0
        True
    """
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(images), batch_size):
        logits = model(normalise(images[i : i + batch_size]))
        correct += int((logits.argmax(1).numpy() == labels[i : i + batch_size]).sum())
    model.train(was_training)
    return correct / max(1, len(images))


def library_versions(*libraries: object) -> dict[str, str]:
    """The versions a bundled model's card records: torch, each of ``libraries`` (modules), numpy and Python.

    Example:
        >>> import timm
        >>> list(library_versions(timm))
        ['torch', 'timm', 'numpy', 'python']
    """
    return {"torch": torch.__version__, **{lib.__name__: lib.__version__ for lib in libraries},
            "numpy": np.__version__, "python": platform.python_version()}


def write_bundled(model: torch.nn.Module, card: dict, out: str | Path, name: str) -> Path:
    """Write ``model``'s weights as ``<out>/<name>.safetensors`` and ``card``, completed with the file's name, its
    SHA-256, the state dict's SHA-256 and its size, as ``<out>/<name>.json``: what ``vc.load_model`` checks.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> write_bundled(torch.nn.Linear(2, 1), {"name": "tiny"}, folder, "tiny").name
        'tiny.safetensors'
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights_path = out / f"{name}.safetensors"
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(weights_path), metadata={"format": "pt"})  # one key: byte-stable header
    card.update(weights_file=weights_path.name, weights_sha256=file_sha256(weights_path),
                state_dict_sha256=state_dict_sha256(state), weights_bytes=weights_path.stat().st_size)
    (out / f"{name}.json").write_text(json.dumps(card, indent=2) + "\n")
    return weights_path


def state_dict_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a state dict (names, dtypes, shapes, bytes, in name order), as
    ``vitcam_nb.provenance.weights_sha256`` computes it for the ``weights_sha256`` attribute of a trace.

    Example:
        >>> len(state_dict_sha256({"w": torch.zeros(2)}))
        64
    """
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _warm_start(model: torch.nn.Module, weights: Path) -> dict:
    """Copy a trained model's weights into ``model`` where they fit; returns where they came from.

    Tensors of the same name and shape are copied. A class-token model whose ``pos_embed`` includes the
    class position (``no_embed_class=False``) moving to patch-only position embeddings
    (``no_embed_class=True``) gets the patch part of ``pos_embed`` and the class position folded into
    ``cls_token``, which leaves the class token's input unchanged. Register tokens keep their init.
    """
    from safetensors.torch import load_file

    src = load_file(str(weights))
    dst = model.state_dict()
    new = {}
    for key, value in dst.items():
        if key in src and src[key].shape == value.shape:
            new[key] = src[key]
    pos_src, pos_dst = src["pos_embed"], dst["pos_embed"]
    if pos_src.shape != pos_dst.shape:
        extra = pos_src.shape[1] - pos_dst.shape[1]
        if extra != 1 or "cls_token" not in src:
            raise ArgumentError(f"cannot map pos_embed {tuple(pos_src.shape)} onto {tuple(pos_dst.shape)}")
        new["pos_embed"] = pos_src[:, 1:]
        new["cls_token"] = src["cls_token"] + pos_src[:, :1]
    missing = sorted(set(dst) - set(new))
    model.load_state_dict({**dst, **new})
    return {"name": weights.stem, "weights_sha256": file_sha256(weights), "kept_init": missing}


def learning_rate(step: int, total: int, cfg: dict) -> float:
    """The training schedule of the bundled models: linear warmup over ``cfg["warmup_steps"]``, then cosine decay
    from ``cfg["lr"]`` to ``cfg["min_lr"]`` at step ``total``.

    Example:
        >>> cfg = {"lr": 1.0, "min_lr": 0.0, "warmup_steps": 2}
        >>> [round(learning_rate(s, 6, cfg), 3) for s in range(6)]
        [0.5, 1.0, 1.0, 0.854, 0.5, 0.146]
    """
    if step < cfg["warmup_steps"]:
        return cfg["lr"] * (step + 1) / cfg["warmup_steps"]
    t = (step - cfg["warmup_steps"]) / max(1, total - cfg["warmup_steps"])
    return cfg["min_lr"] + 0.5 * (cfg["lr"] - cfg["min_lr"]) * (1.0 + math.cos(math.pi * t))


def train(name: str, out: str | Path = MODELS_DIR, log=print, **overrides) -> dict:
    """Train bundled model ``name`` and write its weights and card to ``out``; returns the card.

    ``overrides`` replace training settings (``epochs``, ``images_per_epoch``, ``lr``, ...).

    Example:
        >>> card = train("shapes-vit", out="/tmp/vitcam_models")  # doctest: +SKIP
    """
    import timm

    spec = SPECS[name]
    cfg = dict(spec["train"], **overrides)
    torch.set_num_threads(1)
    torch.manual_seed(spec["train_seed"])
    torch.use_deterministic_algorithms(True)

    model = build_model(spec["arch"])
    init_from = None
    if spec.get("init_from"):
        init_from = _warm_start(model, Path(out) / f"{spec['init_from']}.safetensors")
        log(f"[{name}] initialised from {spec['init_from']} ({init_from['weights_sha256'][:12]})")
    model.train()

    def decays(n: str, p: torch.Tensor) -> bool:
        return p.ndim > 1 and "pos_embed" not in n and "token" not in n

    decay = [p for n, p in model.named_parameters() if decays(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not decays(n, p)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg["lr"],
        betas=(0.9, 0.999),
    )
    steps_per_epoch = cfg["images_per_epoch"] // cfg["batch_size"]
    total = cfg["epochs"] * steps_per_epoch
    test_images, test_labels, _ = shapes(cfg["n_test"], seed=spec["test_seed"], shortcut=spec["shortcut"])

    t0 = time.time()
    step = 0
    history = []
    train_seeds = [spec["train_seed"] + e for e in range(cfg["epochs"])]
    for epoch, seed in enumerate(train_seeds):
        images, labels, _ = shapes(cfg["images_per_epoch"], seed=seed, shortcut=spec["shortcut"])
        order = torch.randperm(len(images))  # seeded by torch.manual_seed above
        running = 0.0
        for i in range(steps_per_epoch):
            idx = order[i * cfg["batch_size"] : (i + 1) * cfg["batch_size"]].numpy()
            x = normalise(images[idx])
            y = torch.from_numpy(labels[idx])
            for group in opt.param_groups:
                group["lr"] = learning_rate(step, total, cfg)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            opt.step()
            running += loss.item()
            step += 1
        acc = accuracy(model, test_images, test_labels)
        mean_loss = running / steps_per_epoch
        history.append({"epoch": epoch + 1, "train_loss": round(mean_loss, 5), "test_accuracy": acc})
        log(
            f"[{name}] epoch {epoch + 1}/{cfg['epochs']} loss {mean_loss:.4f} "
            f"test acc {acc:.4f} ({time.time() - t0:.0f}s)"
        )
    seconds = time.time() - t0

    model.eval()
    card = {
        "name": name,
        "task": spec["task"],
        "description": spec["description"],
        "classes": list(CLASS_NAMES),
        "timm_class": "timm.models.vision_transformer.VisionTransformer",
        "timm_kwargs": spec["arch"],
        "pretrained_cfg": {
            k: list(v) if isinstance(v, tuple) else v for k, v in pretrained_cfg(name, spec["arch"]).items()
        },
        "preprocessing": "uint8 RGB (64, 64, 3) -> x / 255 -> (x - mean) / std per channel; equal to timm's "
        "create_transform(**resolve_data_config(model=model)) (resize and crop are no-ops at 64x64)",
        "data": {
            "generator": "vitcam_nb.data.shapes.shapes(n, seed, size=64, shortcut=...)",
            "shortcut": spec["shortcut"],
            "generator_settings": generator_settings(),
            "train_seeds": train_seeds,
            "images_per_seed": cfg["images_per_epoch"],
            "n_train_images": cfg["images_per_epoch"] * cfg["epochs"],
            "test_seed": spec["test_seed"],
            "n_test": cfg["n_test"],
        },
        "test_accuracy": accuracy(model, test_images, test_labels),
        "training": {
            "optimizer": "AdamW (betas 0.9, 0.999; no weight decay on biases, norms, tokens, pos_embed)",
            "schedule": "linear warmup then cosine decay to min_lr, per step",
            "loss": "cross-entropy",
            "augmentation": "none (fresh synthetic images every epoch)",
            **cfg,
            "steps": total,
            "seconds": round(seconds, 1),
            "threads": torch.get_num_threads(),
            "history": history,
        },
        "versions": library_versions(timm),
    }
    if init_from is not None:
        card["training"]["init_from"] = init_from
    if spec["shortcut"]:
        rnd_images, rnd_labels, _ = shapes(cfg["n_test"], seed=spec["test_seed"], shortcut="random")
        card["test_accuracy_random_mark"] = accuracy(model, rnd_images, rnd_labels)
        clean_images, clean_labels, _ = shapes(cfg["n_test"], seed=spec["test_seed"], shortcut=False)
        card["test_accuracy_no_mark"] = accuracy(model, clean_images, clean_labels)

    weights_path = write_bundled(model, card, out, name)
    log(f"[{name}] test accuracy {card['test_accuracy']:.4f}; wrote {weights_path} ({seconds:.0f}s)")
    return card


SAMPLES_PATH = Path(__file__).resolve().parent / "samples" / "shapes_samples.npz"
SAMPLES_SEED = 5_000


def write_samples(path: str | Path = SAMPLES_PATH, per_class: int = 3) -> Path:
    """Write the fixed demo images behind ``vitcam_nb.sample_image`` to an ``.npz`` (no pickle).

    ``images``, ``labels``, ``masks``: ``per_class`` images of each class from
    ``shapes(64, SAMPLES_SEED)``, ordered so that index ``i`` shows class ``i % 5``. The shortcut
    variants are these images with a corner mark painted by the generator: ``shortcut_mark_class`` is
    the label (the class-coded mark), ``shortcut_random_mark_class`` another class.

    Example:
        >>> write_samples("/tmp/samples.npz")  # doctest: +SKIP
    """
    images, labels, masks = shapes(64, seed=SAMPLES_SEED)
    order = np.array([np.flatnonzero(labels == c)[k] for k in range(per_class) for c in range(len(CLASS_NAMES))])
    labels = labels[order].astype(np.int64)
    wrong = (labels + 1 + np.arange(len(labels)) % 4) % len(CLASS_NAMES)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path,
        images=images[order],
        labels=labels,
        masks=masks[order],
        shortcut_mark_class=labels,
        shortcut_random_mark_class=wrong.astype(np.int64),
        class_names=np.array(CLASS_NAMES),
        info=np.array(f"vitcam_nb.data.shapes.shapes(64, seed={SAMPLES_SEED}), {per_class} per class"),
    )
    return path


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``python -m vitcam_nb.data.train --model NAME``.

    Example:
        >>> main(["--model", "shapes-vit", "--out", "/tmp/m", "--epochs", "1"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*SPECS, "all"], help="which bundled model to train")
    parser.add_argument("--samples", action="store_true", help="(re)write the bundled sample images")
    parser.add_argument("--out", default=str(MODELS_DIR), help="output folder (default: the package's)")
    for key in ("epochs", "images_per_epoch", "batch_size", "n_test", "warmup_steps"):
        parser.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    for key in ("lr", "weight_decay", "min_lr"):
        parser.add_argument("--" + key.replace("_", "-"), type=float, dest=key)
    args = vars(parser.parse_args(argv))
    if args.pop("samples"):
        print(f"wrote {write_samples()}", flush=True)
    model = args.pop("model")
    names = list(SPECS) if model == "all" else [model] if model else []
    out = args.pop("out")
    overrides = {k: v for k, v in args.items() if v is not None}
    for name in names:
        train(name, out=out, log=lambda msg: print(msg, flush=True), **overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
