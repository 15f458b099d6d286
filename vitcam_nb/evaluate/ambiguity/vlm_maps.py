"""``vc.ambiguity`` on a generative VLM's answer trace whose maps do not share the tower's one patch grid: a tower
that ran on crops (LLaVA-NeXT/OneVision, Idefics3/SmolVLM), image tokens over several tiles, an LM layout of
another grid than the tower's (Qwen2-VL's 2x2 merge), or no tower site at all (an LM-only trace).

The open choices are those the trace holds: ``site`` over its tower sites, ``projector``, ``lm_resid``,
``lm_attn`` and ``lm_logit`` (TAM, :func:`vitcam_nb.presets.tam`: at ``lm_logit`` the weighting is ``tam``, the
target the logit and the layer the LM's last; the sequence score has no token and is skipped there), ``layer``
over the tower's blocks and the LM's layers, ``class_`` over the answer tokens and the sequence log-prob. A site
the trace lacks is never in the default space; named in ``space=`` its combinations are skipped, counted and said
(``maps.attrs["absent_sites"]``), not refused.

How the maps are compared (``maps.attrs["comparison"]``): every map is placed on the image canvas (the trace's
``y``, ``x``; box fractions of the original image) one map per tile group, as vc.cam and
:func:`~vitcam_nb.compute.vlm_crops.stitch_crops` place them: a tower map on crops is stitched per group (each crop
in its box, nearest cell), a multi-tile LM map is vc.cam's (view, y, x), a one-grid map is the group ``image``.
Then the groups every map has are stacked top to bottom into one (groups x height, width) picture, on which the
spread, Spearman and variance shares are computed as on any image grid; groups are never averaged (a base or
global view and the crops overlap). ``upsample="none"`` is drawn as nearest blocks. Pixels some map leaves
uncovered (NaN) are set to 0 in every map and counted, so they add no variance. With a ``mask`` (the object on
the original image) the pointing game is scored per view on the original image
(:mod:`~vitcam_nb.evaluate.ambiguity.vlm_pointing`).

Example:
    >>> import xarray as xr
    >>> is_special(xr.Dataset(attrs={"target_kind": "answer"}, coords={"crop": [0, 1]}))
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import xarray as xr

from vitcam_nb.compute.view import TraceView
from vitcam_nb.compute.vlm import VLM_SITES
from vitcam_nb.compute.vlm_crops import stitch_crops
from vitcam_nb.compute.vlm_tiles import is_tiled
from vitcam_nb.core.errors import DegenerateMapWarning, RecipeError, TraceError
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.evaluate.ambiguity.vlm_pointing import combine_views, hit_region, on_mask, view_hits

__all__ = ["LM_SITES", "absent_sites", "canvas", "is_special", "special_maps", "tower_axes"]

#: The LM-side sites of an answer trace, TAM's ``lm_logit`` last.
LM_SITES = (*VLM_SITES, "lm_logit")


def tower_axes(trace: xr.Dataset) -> tuple[list[str], list[int], tuple[int, int] | None]:
    """(tower sites, traced blocks, patch grid) of the trace (crop 0's on a crops trace), ([], [], None) if none.

    Example:
        >>> tower_axes(xr.Dataset())
        ([], [], None)
    """
    if "act" not in trace.variables and "attn" not in trace.variables:
        return [], [], None
    one = trace.isel(crop=0) if "crop" in trace.dims else trace
    try:
        view = TraceView.of(one)
    except (RecipeError, TraceError):
        return [], [], None
    return list(view.sites), [int(v) for v in view.layers], (int(view.gh), int(view.gw))


def is_special(trace: object) -> bool:
    """Whether ``trace`` is an answer trace compared on the image canvas per tile group (the module docstring).

    Example:
        >>> is_special(xr.Dataset(attrs={"target_kind": "answer"}))
        False
    """
    if not isinstance(trace, xr.Dataset) or trace.attrs.get("target_kind") != "answer" or "image" in trace.dims:
        return False
    if "crop" in trace.dims:
        return True
    lm = [s for s in LM_SITES if s in trace.variables]
    if not lm or "image_token_tile" not in trace.variables:
        return False
    sites, _, grid = tower_axes(trace)
    if not sites or is_tiled(trace):
        return True
    rows, cols = trace["image_token_row"].values, trace["image_token_col"].values
    return (int(rows.max()) + 1, int(cols.max()) + 1) != grid


def canvas(trace: xr.Dataset) -> tuple[int, int]:
    """The (height, width) every map is placed on: the trace's ``y``, ``x``.

    Example:
        >>> canvas(xr.Dataset(coords={"y": range(4), "x": range(6)}))
        (4, 6)
    """
    return int(trace.sizes.get("y", 1)), int(trace.sizes.get("x", 1))


def absent_sites(trace: xr.Dataset, sites: Sequence[str]) -> dict[str, str]:
    """The requested sites the trace does not hold, each with why.

    Example:
        >>> absent_sites(xr.Dataset(), ["lm_resid"])
        {'lm_resid': 'not traced (trace with sites=[..., lm_resid])'}
    """
    tower = tower_axes(trace)[0]
    out = {}
    for s in sites:
        if s in tower or (s in LM_SITES and s in trace.variables):
            continue
        why = "an LM-only trace (no tower site)" if not tower and s not in LM_SITES else "not traced"
        out[str(s)] = f"{why} (trace with sites=[..., {s}])"
    return out


def _groups(trace: xr.Dataset, recipe: Recipe, size: tuple[int, int], hit: np.ndarray | None
            ) -> tuple[dict[str, np.ndarray], list[str], dict[str, float] | None]:
    """One recipe's map per tile group on the canvas, why it is degenerate ([] if it is not), and, given the
    pointing game's ``hit`` region on the original image, each group's hit share there (vlm_pointing)."""
    drawn = recipe.replace(upsample="nearest") if recipe.upsample == "none" else recipe
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateMapWarning)
        m = kind_for(trace, drawn).cam(trace, drawn)
    reason = [str(m.attrs["degenerate"])] if m.attrs.get("degenerate") else []
    hits = None if hit is None else view_hits(on_mask(trace, drawn, m, hit.shape), hit)
    if m.dims[0] == "crop":
        return {g: np.asarray(a.values, np.float32) for g, a in stitch_crops(m, size).items()}, reason, hits
    if m.dims[0] == "view":
        return {str(v): np.asarray(m.values[k], np.float32) for k, v in enumerate(m["view"].values)}, reason, hits
    return {"image": np.asarray(m.values, np.float32)}, reason, hits


def special_maps(trace: xr.Dataset, recipes: Sequence[Recipe], cut: tuple[slice, slice],
                 mask: np.ndarray | None = None
                 ) -> tuple[list[tuple[np.ndarray, list[str]] | None], str, tuple[float, dict[str, float]] | None]:
    """Each recipe's (groups x height, width) picture at the pixels ``cut`` keeps, or None where the trace cannot
    compute it, the sentence saying how they were compared, and, given the object ``mask`` on the original image,
    the pointing game (share in every view, share per view) over the groups every map has
    (:mod:`~vitcam_nb.evaluate.ambiguity.vlm_pointing`).

    Example:
        >>> special_maps(xr.Dataset(), [], (slice(None), slice(None)))[0]
        []
    """
    size = canvas(trace)
    hit = None if mask is None else hit_region(mask)
    placed: list[tuple[dict[str, np.ndarray], list[str], dict[str, float] | None] | None] = []
    for recipe in recipes:
        try:
            placed.append(_groups(trace, recipe, size, hit))
        except RecipeError:
            placed.append(None)
    got = [p for p in placed if p is not None]
    if not got:
        return [None] * len(recipes), "", None
    common = [g for g in got[0][0] if all(g in p[0] for p in got)]
    if not common:
        raise RecipeError("space: the consistent maps share no tile group (" + "; ".join(
            sorted({"+".join(p[0]) for p in got})) + "); narrow site= to maps placed on the same groups")
    stack = np.stack([np.concatenate([p[0][g][cut] for g in common]) for p in got])
    holes = np.isnan(stack).any(axis=0)
    stack[:, holes] = 0.0
    words = (f"maps placed on the image canvas ({size[0]}x{size[1]}) per tile group and compared on the groups "
             f"every map has ({', '.join(common)}), stacked top to bottom, never averaged" + (
                 "; tower maps on crops stitched per group (each crop in its box)" if "crop" in trace.dims else ""))
    if holes.any():
        words += f"; {int(holes.sum())} pixel(s) some map leaves uncovered set to 0 in every map"
    pointing = None
    if hit is not None:
        pointing = combine_views([p[2] for p in got], common)
        words += (f"; the pointing game on the {mask.shape[0]}x{mask.shape[1]} original image, each view's map "
                  "placed on it by its tile boxes, scored per view (a recipe localises when it points at the "
                  "object in every view)")
    maps = iter(stack)
    return [None if p is None else (next(maps), p[1]) for p in placed], words, pointing
