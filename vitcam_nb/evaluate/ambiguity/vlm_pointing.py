"""The pointing game of ``vc.ambiguity(trace, mask=...)`` on an answer trace compared per tile group
(:mod:`~vitcam_nb.evaluate.ambiguity.vlm_maps`: a tower on crops, image tokens over several tiles, another grid).

The mask is the object's pixels on the ORIGINAL image: the ``crop_source_size`` a crops trace states (LLaVA-NeXT /
OneVision: the processor's ``image_sizes``); any (height, width) on a crops trace that states none (Idefics3 /
SmolVLM: the crop boxes are fractions of the image, which its processor only rescales); the trace's ``y``, ``x``
otherwise (one image the tower saw whole, e.g. Qwen2-VL). Each consistent map is placed on the mask's pixels,
one map per tile group, exactly as on the comparison canvas but at the mask's size: a tower map on crops by
:func:`~vitcam_nb.compute.vlm_crops.stitch_crops` (each crop's map in its box, nearest pixel), a multi-tile
LM-side map by :func:`~vitcam_nb.compute.vlm_tiles.place` from its per-token values (the recipe's upsampling within
each tile), a one-grid map as computed (on a crops trace resampled from the canvas by nearest pixel centre).

Per view (tile group), a map points at the object when its maximum lies within the pointing-game tolerance of the
mask (15 px at 224 px, scaled: :func:`~vitcam_nb.evaluate.localisation.metrics.default_tolerance`), as the
single-image path scores it: ties count fractionally, a constant map (a degenerate one) is a miss, and pixels the
view leaves uncovered (NaN) are never a peak. ``localises_views`` is each view's share of the recipes; ``localises``
is the share of recipes whose map points at the object in EVERY view the compared maps share (per recipe the
product of its views' tie shares). Views are never averaged: a base or global view and the crops overlap.

Example:
    >>> mask = np.zeros((4, 4), bool); mask[0, 0] = True
    >>> view_hits({"base": np.eye(4)[::-1], "tiles": np.eye(4)}, hit_region(mask, 0.0))
    {'base': 0.0, 'tiles': 0.25}
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.vlm_crops import stitch_crops
from vitcam_nb.compute.vlm_tiles import place, trace_layout
from vitcam_nb.core.errors import ArgumentError, DegenerateMapWarning
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.evaluate._common import as_mask
from vitcam_nb.evaluate.localisation.metrics import default_tolerance

__all__ = ["combine_views", "drawn_mask", "hit_region", "on_mask", "special_mask", "view_hits"]


def special_mask(trace: xr.Dataset, mask: Any) -> np.ndarray:
    """The object mask on the original image (module docstring), refused by name unless it is a non-empty 2-D
    mask of the shape the trace states.

    Example:
        >>> special_mask(xr.Dataset(coords={"y": range(2), "x": range(3)}), np.eye(2, 3, dtype=bool)).shape
        (2, 3)
    """
    stated = str(trace.attrs.get("crop_source_size", ""))
    if "x" in stated:
        shape, what = tuple(int(v) for v in stated.split("x")), "the original image's (crop_source_size)"
    elif "crop" in trace.dims:  # boxes are fractions of the image: any size places them
        shape, what = np.shape(mask), ""
    else:
        shape, what = (int(trace.sizes.get("y", 1)), int(trace.sizes.get("x", 1))), "the traced image's"
    got = np.shape(mask)
    if len(got) == 2 and what and got != shape:
        raise ArgumentError(f"mask: shape {got} is not {what} {shape}; give the object's pixels on the original "
                            "image (each view's map is placed on it by its tile boxes)")
    return as_mask(mask, shape if len(shape) == 2 else got)


def hit_region(mask: np.ndarray, tolerance: float | None = None) -> np.ndarray:
    """The pixels within ``tolerance`` (default: the pointing game's, scaled to the mask) of the object.

    Example:
        >>> int(hit_region(np.eye(3, dtype=bool), 0.0).sum())
        3
    """
    from scipy import ndimage
    tol = default_tolerance(mask.shape) if tolerance is None else float(tolerance)
    return ndimage.distance_transform_edt(~mask) <= tol


def on_mask(trace: xr.Dataset, recipe: Recipe, cam: xr.DataArray, size: tuple[int, int]) -> dict[str, np.ndarray]:
    """The map ``cam`` (vc.cam of ``recipe`` on ``trace``, as the comparison drew it: ``upsample`` never "none")
    placed on the original
    image of ``size``, one map per tile group (module docstring).

    Example:
        >>> on_mask(xr.Dataset(), Recipe(), xr.DataArray(np.ones((2, 2)), dims=("y", "x")), (2, 2))["image"].shape
        (2, 2)
    """
    if cam.dims[0] == "crop":
        return {g: np.asarray(a.values, np.float32) for g, a in stitch_crops(cam, size).items()}
    if cam.dims[0] == "view":  # per-token values (the untouched "none" map), placed again at the mask's size
        flat = recipe.replace(upsample="none")
        with warnings.catch_warnings():  # the comparison's map said it already
            warnings.simplefilter("ignore", DegenerateMapWarning)
            tiles = kind_for(trace, flat).cam(trace, flat)
        lay = trace_layout(trace, recipe.site)
        values = np.asarray(tiles.values)[lay.tile_of, lay.rows, lay.cols]
        return {g: np.asarray(m, np.float32) for g, m in place(lay, values, size, recipe.upsample)[1].items()}
    values = np.asarray(cam.values, np.float32)
    if values.shape == tuple(size):
        return {"image": values}
    ys = ((np.arange(size[0]) + 0.5) * values.shape[0] / size[0]).astype(np.int64)
    xs = ((np.arange(size[1]) + 0.5) * values.shape[1] / size[1]).astype(np.int64)
    return {"image": values[np.ix_(ys, xs)]}


def view_hits(placed: dict[str, np.ndarray], hit: np.ndarray) -> dict[str, float]:
    """Per view, the share of the map's peak pixels inside ``hit`` (0 for a constant or empty view).

    Example:
        >>> view_hits({"image": np.zeros((2, 2))}, np.ones((2, 2), bool))
        {'image': 0.0}
    """
    out = {}
    for group, values in placed.items():
        held = np.isfinite(values)
        if not held.any() or np.ptp(values[held]) <= 0:
            out[group] = 0.0
            continue
        peaks = held & (values == np.max(values[held]))
        out[group] = float((peaks & hit).sum() / peaks.sum())
    return out


def combine_views(hits: Sequence[dict[str, float]], groups: Sequence[str]) -> tuple[float, dict[str, float]]:
    """(share of recipes pointing at the object in every view of ``groups``, each view's share).

    Example:
        >>> combine_views([{"base": 1.0, "tiles": 0.0}, {"base": 1.0, "tiles": 1.0}], ["base", "tiles"])
        (0.5, {'base': 1.0, 'tiles': 0.5})
    """
    table = np.array([[h[g] for g in groups] for h in hits], np.float64).reshape(len(hits), len(groups))
    return float(table.prod(axis=1).mean()), {g: float(table[:, k].mean()) for k, g in enumerate(groups)}


def drawn_mask(mask: np.ndarray, size: tuple[int, int], cut: tuple[slice, slice], groups: int) -> np.ndarray:
    """The mask as :meth:`~vitcam_nb.evaluate.ambiguity.analysis.Ambiguity.plot` outlines it over the compared
    picture: read at the centres of the canvas's pixels (``size``) that ``cut`` keeps, once per group, top to
    bottom (the pointing game itself reads the mask at its own pixels).

    Example:
        >>> drawn_mask(np.eye(4, dtype=bool), (2, 2), (slice(None), slice(None)), 2).astype(int).tolist()
        [[1, 0], [0, 1], [1, 0], [0, 1]]
    """
    ys = ((np.arange(size[0]) + 0.5) * mask.shape[0] / size[0]).astype(np.int64)
    xs = ((np.arange(size[1]) + 0.5) * mask.shape[1] / size[1]).astype(np.int64)
    return np.concatenate([mask[np.ix_(ys, xs)][cut]] * max(groups, 1))
