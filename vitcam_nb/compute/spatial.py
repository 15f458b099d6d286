"""Spatial reconstruction: token maps placed on the patch grid, normalised, and upsampled to the input size
with torch's interpolation rules (half-pixel centres) as separable matrix products.

Example:
    >>> upsample(np.eye(2, dtype=np.float32), (4, 4), "nearest")[0]
    array([1., 1., 0., 0.], dtype=float32)
"""

from __future__ import annotations

import functools

import numpy as np

from vitcam_nb.compute.view import TraceView

__all__ = ["interp_matrix", "normalise", "to_grid", "upsample", "upsample_into"]


def normalise(x: np.ndarray, how: str, inplace: bool = False) -> np.ndarray:
    """Normalise the trailing (h, w) maps: "minmax" to [0, 1], "max" divided by the maximum, "none" as is;
    a constant map becomes zeros. ``inplace`` reuses a float32 ``x`` the caller owns (same values, no
    temporaries: a 60-map gallery at 224 px is 12 MB per temporary).

    Example:
        >>> normalise(np.array([[1.0, 3.0]]), "minmax")
        array([[0., 1.]], dtype=float32)
    """
    if how == "none":
        return x
    axes = (-2, -1)
    hi = x.max(axis=axes, keepdims=True)
    if inplace and x.dtype == np.float32:
        return _normalise_inplace(x, hi, None if how == "max" else x.min(axis=axes, keepdims=True))
    if how == "max":
        return np.where(hi > 0, x / np.where(hi > 0, hi, 1), 0).astype(np.float32)
    lo = x.min(axis=axes, keepdims=True)
    span = hi - lo
    return np.where(span > 0, (x - lo) / np.where(span > 0, span, 1), 0).astype(np.float32)


def _normalise_inplace(x: np.ndarray, hi: np.ndarray, lo: np.ndarray | None) -> np.ndarray:
    # The same float32 operations as the out-of-place formulas, so the values are bitwise equal.
    span = hi
    if lo is not None:
        span = hi - lo
        np.subtract(x, lo, out=x)
    ok = span > 0
    np.divide(x, np.where(ok, span, 1), out=x)
    if not ok.all():
        # Index whole maps by their leading position: a full-size boolean mask costs as much as the division.
        x[~ok[..., 0, 0]] = 0
    return x


@functools.lru_cache(maxsize=64)
def interp_matrix(n_in: int, n_out: int, mode: str, transpose: bool = False) -> np.ndarray:
    """(n_out, n_in) matrix of torch's 1-D interpolation (or its contiguous transpose, which BLAS needs
    to be fast); the 2-D modes are separable products of it."""
    import torch
    import torch.nn.functional as F

    eye = torch.eye(n_in, dtype=torch.float64)
    # Interpolating each unit impulse along one axis gives that input's column of the weight matrix.
    kwargs = {} if mode == "nearest" else {"align_corners": False}
    cols = F.interpolate(eye[:, None, None, :], size=(1, n_out), mode=mode, **kwargs)[:, 0, 0, :]
    weights = cols if transpose else cols.T
    return np.ascontiguousarray(weights.numpy(), dtype=np.float32)


def upsample(grid: np.ndarray, size: tuple[int, int], mode: str, pad: tuple[int, int] = (0, 0)) -> np.ndarray:
    """Upsample (..., h, w) maps to ``size`` with torch's bilinear/bicubic/nearest rules (half-pixel centres).
    ``pad``: pixels the grid also covers below and right of the image (a model that pads its input); the map is
    upsampled over image and margin and the margin cropped.

    Example:
        >>> upsample(np.eye(2, dtype=np.float32), (4, 4), "nearest")[0]
        array([1., 1., 0., 0.], dtype=float32)
    """
    if mode == "none":
        return grid
    wy = interp_matrix(grid.shape[-2], size[0] + pad[0], mode)[:size[0]]
    wx_t = np.ascontiguousarray(interp_matrix(grid.shape[-1], size[1] + pad[1], mode, transpose=True)[:, :size[1]])
    return wy @ grid.astype(np.float32, copy=False) @ wx_t


def upsample_into(out: np.ndarray, grid: np.ndarray, mode: str, how: str, pad: tuple[int, int] = (0, 0)
                  ) -> np.ndarray:
    """``normalise(upsample(grid, out.shape[-2:], mode, pad), how)`` written into ``out`` (..., H, W) with no
    full-size temporaries. The values equal the two-step formula's bit for bit (numpy runs one BLAS product per
    map either way; min, max, subtraction and division are exact per element).

    Example:
        >>> g = np.array([[[0.0, 1.0], [2.0, 3.0]]], np.float32)
        >>> out = np.empty((1, 4, 4), np.float32)
        >>> two_step = normalise(upsample(g, (4, 4), "bilinear"), "minmax")
        >>> np.array_equal(upsample_into(out, g, "bilinear", "minmax"), two_step)
        True
    """
    if mode == "none":
        out[...] = normalise(grid, how)
        return out
    h, w = out.shape[-2:]
    wy = interp_matrix(grid.shape[-2], h + pad[0], mode)[:h]
    wx_t = np.ascontiguousarray(interp_matrix(grid.shape[-1], w + pad[1], mode, transpose=True)[:, :w])
    # Stacked products and one vectorised normalisation: a Python loop over maps cost more than the cache
    # misses it saved (measured 1.8 -> 1.0 ms for 12 maps at 224 px).
    np.matmul(np.matmul(wy, grid.astype(np.float32, copy=False)), wx_t, out=out)
    return normalise(out, how, inplace=True)


def to_grid(view: TraceView, raw: np.ndarray) -> np.ndarray:
    """(..., patch token) values placed on the (..., grid_h, grid_w) raster grid by each token's row and column.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
        >>> to_grid(TraceView.of(tr), np.arange(16.0))[1].tolist()
        [4.0, 5.0, 6.0, 7.0]
    """
    out = np.zeros((*raw.shape[:-1], view.gh * view.gw), np.float32)
    out[..., view.flat] = raw
    return out.reshape(*raw.shape[:-1], view.gh, view.gw)
