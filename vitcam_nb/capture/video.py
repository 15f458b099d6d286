"""The time axis of a video trace: which frame or tubelet each token belongs to.

A video model's patch tokens follow its prefix tokens in ``(t, y, x)`` raster order (the adapters reorder a
model that orders them otherwise); the trace stores the slice of every token as ``patch_frame`` beside
``patch_row`` and ``patch_col`` (-1 for prefix tokens), the grid's length in time as ``grid_t``, and the clip's
frames as the variable ``clip (frame, y, x, rgb)`` (the schema's ``image`` is one image's).

Example:
    >>> frame_coords(1, (2, 1, 2)).tolist()
    [-1, 0, 0, 1, 1]
"""

from __future__ import annotations

import numpy as np

__all__ = ["frame_coords"]


def frame_coords(n_prefix: int, grid: tuple[int, int, int]) -> np.ndarray:
    """The frame (or tubelet) index of every token: -1 for the ``n_prefix`` prefix tokens, then the patches of
    a (t, h, w) grid in (t, y, x) raster order.

    Example:
        >>> frame_coords(0, (3, 1, 1)).tolist()
        [0, 1, 2]
    """
    gt, gh, gw = grid
    return np.concatenate([np.full(n_prefix, -1), np.repeat(np.arange(gt), gh * gw)]).astype(np.int64)
