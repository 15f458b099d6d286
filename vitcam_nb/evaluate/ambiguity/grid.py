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
    ((3, 2), True)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from vitcam_nb.compute.spatial import interp_matrix, normalise, upsample
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import ROLLOUTS, Recipe
from vitcam_nb.evaluate.recipe_maps import recipe_maps

__all__ = ["MAX_PIXELS", "distance_coords", "image_maps", "image_sample", "patch_index"]

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


def patch_index(grid: tuple[int, int], size: tuple[int, int], pad: tuple[int, int], cut: tuple[slice, slice]
                ) -> tuple[np.ndarray, np.ndarray]:
    """The token row and column under each pixel ``cut`` keeps of an image of ``size`` on a token ``grid``: a
    token-grid map indexed with them is ``upsample(map, size, "nearest", pad)[cut]`` exactly.

    Example:
        >>> [v.tolist() for v in patch_index((2, 2), (4, 4), (0, 0), (slice(None), slice(1, None, 2)))]
        [[0, 0, 1, 1], [0, 1]]
    """
    # Read off the nearest-neighbour matrices (one 1 per row): no product per map.
    rows = interp_matrix(grid[0], size[0] + pad[0], "nearest")[:size[0]].argmax(axis=1)[cut[0]]
    cols = interp_matrix(grid[1], size[1] + pad[1], "nearest")[:size[1]].argmax(axis=1)[cut[1]]
    return rows, cols


def _derivable(trace: xr.Dataset, recipe: Recipe) -> bool:
    # One block (or a rollout) of a plain trace: vc.cam normalises the token map, upsamples it and normalises
    # again (compute.flat), so the map of any upsampling follows from the token-grid map of the same recipe.
    return (recipe.upsample != "none" and kind_for(trace, recipe).name == "flat"
            and (recipe.layer_fusion in ROLLOUTS or (recipe.layer_fusion == "none"
                                                     and not isinstance(recipe.layer, (tuple, str)))))


def image_maps(trace: xr.Dataset, recipes: Sequence[Recipe], cut: tuple[slice, slice] = (slice(None), slice(None))
               ) -> list[tuple[np.ndarray, list[str]] | None]:
    """The maps of ``recipes`` on the image grid, at the pixels ``cut`` keeps (:func:`image_sample`), each the
    map :func:`vitcam_nb.cam` gives, and None where the trace cannot compute it. A token-grid map
    (``upsample="none"``) is repeated over its patches (nearest-neighbour, read off the interpolation matrix, so
    the margin of a padding model is cropped as :func:`~vitcam_nb.compute.spatial.upsample` crops it). A
    one-block recipe of a plain trace is upsampled from its token-grid map (computed once for all its
    upsamplings, attention rows shared by :func:`~vitcam_nb.evaluate.recipe_maps.recipe_maps`); any other is
    computed as it is.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
        >>> recs = [vc.Recipe(site="F1", layer=0, upsample=u) for u in ("none", "bilinear")]
        >>> [v.shape for v, _ in image_maps(tr, recs)]
        [(32, 32), (32, 32)]
    """
    view = TraceView.of(trace)
    size = (view.height, view.width)
    base = {r: r.replace(upsample="none") if _derivable(trace, r) else r for r in recipes}
    unique = list(dict.fromkeys(base.values()))
    computed = dict(zip(unique, recipe_maps(trace, unique)))
    rows, cols = patch_index((view.gh, view.gw), size, view.pad, cut)
    out: list[tuple[np.ndarray, list[str]] | None] = []
    for recipe in recipes:
        result = computed[base[recipe]]
        if result is not None:
            values = np.asarray(result[0], np.float32)
            if recipe.upsample == "none":
                values = values[np.ix_(rows, cols)]
            elif base[recipe] is not recipe:
                values = normalise(upsample(values, size, recipe.upsample, view.pad), recipe.normalize)[cut]
            else:
                values = values[cut]
            result = (np.ascontiguousarray(values), result[1])
        out.append(result)
    return out


def distance_coords(stack: np.ndarray) -> np.ndarray:
    """Coordinates (n, k) of the n maps of ``stack`` (n, ...) with every pairwise distance and every distance to
    a weighted mean of them unchanged (a pivoted Cholesky factor of the Gram matrix of the centred maps, float64,
    to LAPACK's rounding tolerance; k is the rank of the maps), so a variance decomposition over cells that repeat
    the maps gives the same shares on n x k numbers as on n x pixels. The maps themselves (float64) when they have
    no more pixels than there are maps.

    Example:
        >>> stack = np.arange(12.0).reshape(2, 6)
        >>> w = distance_coords(stack)
        >>> round(float(np.linalg.norm(w[0] - w[1])) ** 2, 6), float(((stack[0] - stack[1]) ** 2).sum())
        (216.0, 216.0)
    """
    import scipy.linalg.lapack  # here, not at import: scipy takes half a second to import
    flat = np.asarray(stack).reshape(len(stack), -1)
    if flat.shape[1] <= flat.shape[0]:
        return flat.astype(np.float64)
    gram = np.zeros((len(flat), len(flat)))
    for start in range(0, flat.shape[1], _CHUNK):
        block = flat[:, start:start + _CHUNK].astype(np.float64)
        block -= block.mean(axis=0)  # distances do not move with the origin; centring keeps the Gram precise
        gram += block @ block.T
    # Pivoted Cholesky (LAPACK dpstrf, stopping at the default tolerance n * eps * max diagonal): as many columns
    # as the maps have dimensions (at most 2 x the token count with two upsamplings), so the variance shares and
    # their bootstrap cost that many numbers per cell, not one per map.
    factor, piv, rank, info = scipy.linalg.lapack.dpstrf(gram, lower=1)
    if info < 0:
        raise ArgumentError(f"stack: the Gram matrix of the maps could not be factored (LAPACK info {info})")
    coords = np.empty((len(gram), max(int(rank), 1)))
    coords[piv - 1] = np.tril(factor)[:, :coords.shape[1]]
    return coords
