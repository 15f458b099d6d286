"""Part of item ``scale``: ``vc.map_many`` images/s on one device against timm's forward-only images/s there.

On CUDA (``python -m benchmarks.items.scale --device cuda``): ViT-B/16 in float16 (``model.half()``, so the pass
computes in the dtype it stores), batch 64, the torch backend (maps computed on the device), against the same
half-precision model's plain forward (``torch.inference_mode``, same batch) on the same device. The target is a
ratio of at least 0.2. On CPU the same measurement runs in float32 at a small batch (``--device-batch``), which says
how the two compare there; it is not the GPU figure.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

TARGET = 0.2


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_rate(model: object, x: object, device: str, rounds: int) -> float:
    """timm's forward-only images/s of ``model`` on a batch ``x`` already on ``device`` (median of ``rounds``).

    Example:
        >>> forward_rate(model, x, "cpu", 3)  # doctest: +SKIP
        41.7
    """
    import torch

    times = []
    with torch.inference_mode():
        model(x)  # warm-up: kernels chosen, memory pools filled
        _sync(device)
        for _ in range(rounds):
            start = time.perf_counter()
            model(x)
            _sync(device)
            times.append(time.perf_counter() - start)
    return x.shape[0] / statistics.median(times)


def device_throughput(name: str, kw: dict, recipes: list, device: str, batch: int, rounds: int = 2) -> dict:
    """``map_many`` (torch backend) against timm's forward-only pass on ``device``, at ``batch`` images per pass.

    Float16 on CUDA (model and storage), float32 elsewhere. ``map_many`` is timed over two batches after a
    one-batch warm-up run, so each store holds ``2 * batch`` images.

    Example:
        >>> device_throughput("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8}, recipes, "cpu", 2)
        ... # doctest: +SKIP
    """
    import timm
    import torch

    import vitcam_nb as vc
    from vitcam_nb.preprocess import prepare_input

    half = device.startswith("cuda")
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kw).eval().to(device)
    if half:
        model = model.half()
    size = int(model.patch_embed.img_size[0])
    rng = np.random.default_rng(1)
    images = list(rng.integers(0, 256, (2 * batch, size, size, 3), np.uint8))
    x = torch.cat([prepare_input(model, img).tensor for img in images[:batch]]).to(device)
    fwd = forward_rate(model, x.half() if half else x, device, max(rounds, 3))
    root = Path(tempfile.mkdtemp(prefix="vitcam-scale-device-"))
    dtype = "float16" if half else "float32"
    walls = []
    try:
        for r in range(rounds + 1):  # the first run warms the device up and is not counted
            path = root / f"run{r}.zarr"
            _sync(device)
            start = time.perf_counter()
            vc.map_many(model, images if r else images[:batch], recipes, path, batch_size=batch, device=device,
                        dtype=dtype, backend="torch", progress=False)
            _sync(device)
            if r:
                walls.append(time.perf_counter() - start)
            shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ours = len(images) / statistics.median(walls)
    return {"device": device, "compute_dtype": "float16" if half else "float32", "storage_dtype": dtype,
            "batch_size": batch, "recipes": len(recipes), "rounds": rounds,
            "map_many_images_per_s": round(ours, 3), "timm_forward_images_per_s": round(fwd, 3),
            "ratio": round(ours / fwd, 4), "target": TARGET, "met": bool(ours / fwd >= TARGET),
            "note": "map_many: one forward and one batched backward per batch capturing what the recipes read, the "
                    "maps on the device (torch backend), the store written; timm: inference_mode forward only"}
