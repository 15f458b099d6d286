"""The image grid on which :func:`vitcam_nb.ambiguity` compares maps while ``upsample`` is open: every map at the
image resolution exactly as :func:`vitcam_nb.cam` gives it, a map of ``upsample="none"`` shown as blocks (each
token repeated over its patch, nearest-neighbour; on an integer patch grid the same picture as ``"nearest"``),
compared on at most :data:`MAX_PIXELS` of the image's own pixels (a larger image at a stride), and coordinates of
the maps that keep every distance between them, so that the variance shares over thousands of cells do not copy
a map per cell.

Example:
    >>> stack = np.random.default_rng(0).standard_normal((3, 2, 50)).astype(np.float32)
    >>> w = distance_coords(stack)
    >>> w.shape, bool(np.isclose(np.linalg.norm(w[0] - w[1]), np.linalg.norm(stack[0] - stack[1])))
    ((3, 3), True)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.linalg
import xarray as xr

from vitcam_nb.compute.spatial import interp_matrix
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.recipe import Recipe

__all__ = ["MAX_PIXELS", "distance_coords", "image_sample", "on_image_grid"]

#: Pixels per block when the Gram matrix of the maps is accumulated (bounds the float64 copy).
_CHUNK = 1 << 16
#: The most pixels the maps are compared on: a larger image is sampled at a stride (see image_sample).
MAX_PIXELS = 64 * 64


def image_sample(height: int, width: int) -> tuple[int, tuple[slice, slice]]:
    """The stride ``s`` (the smallest with at most :data:`MAX_PIXELS` samples) and the pixels compared: every
    ``s``-th pixel of each row and column from ``s // 2`` (the centre of each s x s cell). Each sampled value is
    the map's own pixel, not a resampling: the spread, Spearman and variance shares of thousands of maps of a
    224 px image are then computed on 56 x 56 of its pixels (4 per side of a 16 px patch) instead of 224 x 224.

    Example:
        >>> image_sample(64, 64)[0], image_sample(224, 224)[0]
        (1, 4)
    """
    stride = 1
    while -(-height // stride) * -(-width // stride) > MAX_PIXELS:
        stride += 1
    cut = slice(stride // 2, None, stride)
    return stride, (cut, cut)


def on_image_grid(trace: xr.Dataset, recipes: Sequence[Recipe], computed: Sequence[tuple | None],
                  cut: tuple[slice, slice] = (slice(None), slice(None))) -> list[tuple[np.ndarray, list[str]] | None]:
    """The maps of ``recipes`` (as :func:`~vitcam_nb.evaluate.recipe_maps.recipe_maps` computed them) on the image
    grid: a token-grid map (``upsample="none"``) repeated over its patches (nearest-neighbour, the margin of a
    padding model cropped as :func:`~vitcam_nb.compute.spatial.upsample` crops it); the others are already there.
    ``cut``: the pixels kept (:func:`image_sample`).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> from vitcam_nb.evaluate.recipe_maps import recipe_maps
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
        >>> recs = [vc.Recipe(site="F1", layer=0, upsample=u) for u in ("none", "bilinear")]
        >>> [v.shape for v, _ in on_image_grid(tr, recs, recipe_maps(tr, recs))]
        [(32, 32), (32, 32)]
    """
    view = TraceView.of(trace)
    # The token under each kept pixel, read off the nearest-neighbour matrices (one 1 per row): indexing gives the
    # values of upsample(map, size, "nearest", pad)[cut] exactly, without a product per map.
    rows = interp_matrix(view.gh, view.height + view.pad[0], "nearest")[:view.height].argmax(axis=1)[cut[0]]
    cols = interp_matrix(view.gw, view.width + view.pad[1], "nearest")[:view.width].argmax(axis=1)[cut[1]]
    out: list[tuple[np.ndarray, list[str]] | None] = []
    for recipe, result in zip(recipes, computed):
        if result is not None:
            values = np.asarray(result[0], np.float32)
            values = values[np.ix_(rows, cols)] if recipe.upsample == "none" else values[cut]
            result = (np.ascontiguousarray(values), result[1])
        out.append(result)
    return out


def distance_coords(stack: np.ndarray) -> np.ndarray:
    """Coordinates (n, k) of the n maps of ``stack`` (n, ...) with every pairwise distance and every distance to
    a weighted mean of them unchanged (a factor of the Gram matrix of the centred maps, float64; exact to a
    relative 1e-10), so a variance decomposition over cells that repeat the maps gives the same shares on n x k
    numbers as on n x pixels. The maps themselves (float64) when they have no more pixels than there are maps.

    Example:
        >>> stack = np.arange(12.0).reshape(2, 6)
        >>> w = distance_coords(stack)
        >>> round(float(np.linalg.norm(w[0] - w[1])) ** 2, 6), float(((stack[0] - stack[1]) ** 2).sum())
        (216.0, 216.0)
    """
    flat = np.asarray(stack).reshape(len(stack), -1)
    if flat.shape[1] <= flat.shape[0]:
        return flat.astype(np.float64)
    gram = np.zeros((len(flat), len(flat)))
    for start in range(0, flat.shape[1], _CHUNK):
        block = flat[:, start:start + _CHUNK].astype(np.float64)
        block -= block.mean(axis=0)  # distances do not move with the origin; centring keeps the Gram precise
        gram += block @ block.T
    # Cholesky of the Gram plus a jitter of 1e-10 of its mean diagonal: every squared distance gains the same
    # 2 * jitter (a relative 1e-10 of the variance, far below the shares' rounding), at a tenth of the cost of an
    # eigendecomposition; the eigendecomposition only where rounding left the Gram indefinite beyond the jitter.
    jitter = 1e-10 * max(float(np.trace(gram)) / len(gram), np.finfo(float).tiny)
    try:
        return scipy.linalg.cholesky(gram + jitter * np.eye(len(gram)), lower=True, check_finite=False)
    except np.linalg.LinAlgError:
        values, vectors = np.linalg.eigh(gram)
        return vectors * np.sqrt(np.clip(values, 0.0, None))
