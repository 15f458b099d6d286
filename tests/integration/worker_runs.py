"""What the distributed reliability tests (``test_reliability_cluster.py``, ``test_reliability_caller_killed.py``)
share: the model (rebuilt on the workers from SPEC), the images, the stores a single process writes, and how
stores are compared and calls recorded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import timm
import torch
import zarr

import vitcam_nb as vc
from vitcam_nb import Recipe

SPEC = {"timm": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 8, "depth": 2, "num_classes": 10}
# One map of one block (``maps``) and one fused over both blocks (its blocks' maps in ``parts``).
RECIPES = [Recipe(site="F1", layer=-1), Recipe(site="F4", layer=(0, 1), layer_fusion="mean")]
N, BATCH = 6, 2  # three batches: the first in the calling process (it shapes the store), two on the workers
TRACE_ARGS = dict(targets="top2", sites=["F1", "F4"], batch_size=BATCH, progress=False)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(SPEC["timm"], pretrained=False, **{k: v for k, v in SPEC.items() if k != "timm"}).eval()


def random_images() -> list[np.ndarray]:
    return list(np.random.default_rng(3).integers(0, 256, (N, 32, 32, 3), dtype=np.uint8))


def whole_stores(folder: Path, model, images) -> dict[str, Path]:
    """The stores a single process writes in ``folder``: map_many's maps and trace_many's traces of ``images``."""
    return {"maps": vc.map_many(model, images, RECIPES, folder / "maps.zarr", batch_size=BATCH, progress=False),
            "traces": vc.trace_many(model, images, folder / "traces.zarr", **TRACE_ARGS)}


def store_arrays(path) -> dict[str, np.ndarray]:
    return {name: np.asarray(arr[:]) for name, arr in zarr.open_group(str(path), mode="r").arrays()}


def store_files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def assert_same_store(got: Path, want: Path) -> None:
    """The same arrays, bitwise, the same attributes and the same files (no stray chunk, temporary or lock file)."""
    a, b = store_arrays(got), store_arrays(want)
    assert sorted(a) == sorted(b)
    for name in b:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert dict(zarr.open_group(str(got)).attrs) == dict(zarr.open_group(str(want)).attrs)
    assert store_files(got) == store_files(want)


def recording(monkeypatch, cls, name: str, key) -> list:
    """Record every call of ``cls.name`` in the calling process (``key(args)``), then make it."""
    real, calls = getattr(cls, name), []

    def record(self, *args, **kwargs):
        calls.append(key(args))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, record)
    return calls
