"""What the many-image tests (``test_many_*.py``) share: N random images, traced BATCH at a time for their top 3
classes into the store most of their tests read."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vitcam_nb import trace_many

N = 7
BATCH = 2


def random_images(n: int, seed: int = 0, size: int = 32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]


def traced_store(folder: Path, model, images) -> Path:
    """``images`` traced by ``model`` into ``folder``/traces.zarr for their top 3 classes, BATCH at a time."""
    return trace_many(model, images, folder / "traces.zarr", targets="top3", batch_size=BATCH, progress=False)
