"""The bytes the browser receives: float32 grids as little-endian buffers, and the image as RGBA once.

Example:
    >>> float(grid_from_bytes(grid_bytes(np.ones((2, 2))), [2, 2]).sum())
    4.0
"""

from __future__ import annotations

import numpy as np

__all__ = ["grid_bytes", "grid_from_bytes", "image_rgba"]


def grid_bytes(grid: np.ndarray) -> bytes:
    """float32 little-endian bytes of an array (the binary buffer the browser reads).

    Example:
        >>> len(grid_bytes(np.zeros((2, 3))))
        24
    """
    return np.ascontiguousarray(grid, dtype="<f4").tobytes()


def grid_from_bytes(data: bytes, shape: list[int] | tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`grid_bytes`.

    Example:
        >>> float(grid_from_bytes(grid_bytes(np.ones((2, 2))), [2, 2]).sum())
        4.0
    """
    return np.frombuffer(bytes(data), dtype="<f4").reshape(tuple(int(s) for s in shape))


def image_rgba(image: np.ndarray) -> bytes:
    """RGBA bytes (opaque) of an (H, W, 3) uint8 image, sent to the browser once.

    Example:
        >>> len(image_rgba(np.zeros((2, 2, 3), np.uint8)))
        16
    """
    h, w = image.shape[:2]
    out = np.empty((h, w, 4), np.uint8)
    out[..., :3] = image
    out[..., 3] = 255
    return out.tobytes()
