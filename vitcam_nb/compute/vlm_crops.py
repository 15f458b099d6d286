"""Tower-site maps of a trace whose tower ran on several crops of one image (the ``crop`` dim of
:mod:`vitcam_nb.capture.crops`: LLaVA-NeXT/OneVision tiles, Idefics3/SmolVLM splits), and their stitching onto the
original image.

A recipe at a tower site (F1..F6, the extended and q/k/v sites, F2) gives one map per crop, dims ``(crop, y, x)``
(``(crop, patch_row, patch_col)`` with ``upsample="none"``): map ``k`` is exactly what the single-image trace form
computes on ``trace.isel(crop=k)`` (every weighting, head and layer aggregation, degenerate verdict), so no choice
is made across crops. :func:`stitch_crops` then places the per-crop maps on the original image by each crop's box
(padding undone), one map per tile group (``base``: the base view, ``tiles``: the crop grid): groups overlap and
are never averaged. The language-model sites (``projector``, ``lm_resid``, ``lm_attn``) have no crop dim and are
the ``vlm`` form's. ``vc.gallery`` varies the tower recipe with one map per crop in every cell
(:mod:`~vitcam_nb.compute.vlm_gallery`).

Example:
    >>> import vitcam_nb as vc
    >>> CROPS.accepts(xr.Dataset(coords={"crop": [0, 1]}), vc.Recipe(site="F1"))
    True
    >>> CROPS.accepts(xr.Dataset(coords={"crop": [0, 1]}), vc.Recipe(site="lm_resid"))
    False
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, Tile
from vitcam_nb.compute.maps import degenerate_cause, warn_degenerate
from vitcam_nb.compute.vlm_gallery import crops_gallery
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, DegenerateMapWarning, RecipeError
from vitcam_nb.core.kinds import TRACE_FORMS, MapValues, TraceKind, form_for
from vitcam_nb.core.recipe import Recipe

__all__ = ["CROPS", "CropsKind", "stitch_crops"]

_LM_SITES = ("projector", "lm_resid", "lm_attn", "lm_logit")  # no crop dim (lm_logit: TAM, compute.tam)
_SIDES = ("top", "left", "bottom", "right")
_CROP_COORDS = ("crop_tile", "crop_group", *(f"crop_box_{s}" for s in _SIDES))


def _crops(trace: xr.Dataset) -> list[tuple[int, xr.Dataset]]:
    """Each crop's single-image trace (no crop dim: the forms of one image's trace compute it)."""
    return [(k, trace.isel(crop=k)) for k in range(int(trace.sizes["crop"]))]


def _form(one: xr.Dataset, recipe: Recipe | None) -> TraceKind:
    form = form_for(one, recipe)
    if form is CROPS:  # cannot happen: a crop's trace has no crop dim
        raise RecipeError("trace: a crop's trace still has a crop dim")
    return form


def _crop_words(trace: xr.Dataset) -> str:
    """The checklist's sentence on the crops."""
    return (f"{trace.attrs.get('crop_layout', 'the tower ran on several crops')}. One map per crop (dim crop), "
            "each computed exactly as the single-image trace form computes that crop's trace; "
            "vitcam_nb.compute.vlm_crops.stitch_crops places them on the original image by each crop's box "
            "(padding undone), one map per tile group")


def _report(trace: xr.Dataset, recipe: Recipe, checklist: Checklist | str) -> Checklist:
    """A crop's checklist with the crops and the image-token layout stated."""
    c = Checklist(json.loads(checklist) if isinstance(checklist, str) else dict(checklist))
    c.setdefault("spatial reconstruction", {})["crops"] = _crop_words(trace)
    layout = str(trace.attrs.get("image_token_layout", ""))
    if layout:
        c.setdefault("token handling", {})["image-token layout"] = layout
    return c


class CropsKind(TraceKind):
    """Tower-site recipes on a trace with a ``crop`` dim: one map per crop, each the single-image form's.

    Example:
        >>> CROPS.name
        'vlm_crops'
    """

    name = "vlm_crops"

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        return isinstance(trace, xr.Dataset) and "crop" in trace.dims and \
            (recipe is None or recipe.site not in _LM_SITES)

    def layer_count(self, trace: Any) -> int:
        return _form(trace.isel(crop=0), None).layer_count(trace.isel(crop=0))

    def traced_layers(self, trace: Any) -> list[int]:
        return _form(trace.isel(crop=0), None).traced_layers(trace.isel(crop=0))

    def resolve(self, trace: Any, recipe: Any) -> Any:
        one = trace.isel(crop=0)
        return _form(one, recipe).resolve(one, recipe)

    def compute(self, trace: xr.Dataset, recipe: Recipe) -> MapValues:
        maps, notes, partial = [], [], []
        for k, one in _crops(trace):
            values, why, part = _form(one, recipe).compute(one, recipe)
            maps.append(values)
            notes += [f"crop {k} ({_tile(trace, k)}): {w}" for w in why]
            partial += [f"crop {k}: {p}" for p in part]
        return np.stack(maps), notes, partial

    def cam(self, trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
        """A DataArray (crop, y, x) (or (crop, patch_row, patch_col)) with the crops' coordinates; its attrs are
        a crop's map's, the checklist stating the crops, ``degenerate`` naming each degenerate crop."""
        maps, notes, partial, reasons = [], [], [], []
        first = None
        for k, one in _crops(trace):
            with warnings.catch_warnings():  # one warning for the whole map below, not one per crop
                warnings.simplefilter("ignore", DegenerateMapWarning)
                m = _form(one, recipe).cam(one, recipe)
            first = m if first is None else first
            maps.append(m.values)
            reason = str(m.attrs.get("degenerate", ""))
            reasons.append(reason)
            if reason:
                notes.append(f"crop {k} ({_tile(trace, k)}): {reason}")
            if m.attrs.get("degenerate_layers"):
                partial.append(f"crop {k}: {m.attrs['degenerate_layers']}")
        reason = warn_degenerate(recipe, notes) if notes else ""
        attrs = dict(first.attrs)
        attrs.update(checklist=_report(trace, recipe, attrs.get("checklist", "{}")).to_json(),
                     methods=f"{attrs.get('methods', '')} {_crop_words(trace)}.".strip(), degenerate=reason,
                     degenerate_layers="; ".join(partial),
                     crop_source_size=str(trace.attrs.get("crop_source_size", "")))
        attrs["degenerate_cause"] = degenerate_cause(reason)
        coords = {c: ("crop", trace[c].values) for c in _CROP_COORDS if c in trace.coords}
        coords["crop"] = ("crop", np.arange(len(maps), dtype=np.int64))
        coords["crop_degenerate"] = ("crop", np.array(reasons, dtype=str))
        return xr.DataArray(np.stack(maps).astype(np.float32, copy=False), dims=("crop", *first.dims),
                            coords=coords, name="cam", attrs=attrs)

    def gallery(self, trace: xr.Dataset, recipe: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
        return crops_gallery(trace, recipe, vary)  # one map per crop in every cell

    def checklist(self, recipe: Recipe, trace: xr.Dataset) -> Checklist:
        one = trace.isel(crop=0)
        return _report(trace, recipe, _form(one, recipe).checklist(recipe, one))

    def describe(self, recipe: Recipe, trace: xr.Dataset) -> str:
        one = trace.isel(crop=0)
        return f"{_form(one, recipe).describe(recipe, one)} {_crop_words(trace)}."


def _tile(trace: xr.Dataset, k: int) -> str:
    return str(trace["crop_tile"].values[k]) if "crop_tile" in trace.coords else str(k)


def stitch_crops(cam: xr.DataArray, size: tuple[int, int] | None = None) -> dict[str, xr.DataArray]:
    """Per-crop maps ``cam`` (crop, rows, cols) placed on the original image of ``size`` (height, width; default
    the trace's ``crop_source_size``), one (y, x) map per tile group, keyed by group.

    Each crop's map covers its box (``crop_box_*``, fractions of the original image, padding undone) and is
    sampled by nearest cell (a pixel takes the value of the map cell whose box-relative extent holds its centre,
    :meth:`~vitcam_nb.adapters.vlm_layout.ImageTokenLayout.on_image`): the crops of one group do not overlap, so
    its map is their exact stitching; the groups overlap (the base view and the crop grid both cover the image) and
    are returned apart, never averaged. A crop the LM never reads is left out; pixels no crop of a group covers are
    NaN.

    Example:
        >>> m = xr.DataArray(np.array([[[1.0]], [[2.0]], [[3.0]]]), dims=("crop", "y", "x"), coords={
        ...     "crop_group": ("crop", ["base", "tiles", "tiles"]), "crop_box_top": ("crop", [0.0, 0.0, 0.0]),
        ...     "crop_box_left": ("crop", [0.0, 0.0, 0.5]), "crop_box_bottom": ("crop", [1.0, 1.0, 1.0]),
        ...     "crop_box_right": ("crop", [1.0, 0.5, 1.0])})
        >>> {g: a.values.tolist() for g, a in stitch_crops(m, (1, 4)).items()}
        {'base': [[1.0, 1.0, 1.0, 1.0]], 'tiles': [[2.0, 2.0, 3.0, 3.0]]}
    """
    if not isinstance(cam, xr.DataArray) or cam.ndim != 3 or cam.dims[0] != "crop":
        raise ArgumentTypeError("cam: expected the per-crop map of vitcam_nb.cam on a trace with crops (dims crop, "
                                f"y, x), got {type(cam).__name__}{getattr(cam, 'dims', '')}")
    missing = [c for c in ("crop_group", *(f"crop_box_{s}" for s in _SIDES)) if c not in cam.coords]
    if missing:
        raise ArgumentError(f"cam: has no coordinates {missing}; pass the map vitcam_nb.cam returns on a crops trace")
    if size is None:
        text = str(cam.attrs.get("crop_source_size", ""))
        if "x" not in text:
            raise ArgumentError("size: the map does not state the original image size (crop_source_size); pass "
                                "size=(height, width)")
        size = tuple(int(v) for v in text.split("x"))
    if len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in size):
        raise ArgumentError(f"size: expected (height, width) as two positive ints, got {size!r}")
    h, w = int(cam.shape[1]), int(cam.shape[2])
    groups = [str(g) for g in cam["crop_group"].values]
    boxes = np.stack([cam[f"crop_box_{s}"].values.astype(np.float64) for s in _SIDES], axis=1)
    keep = [k for k, g in enumerate(groups) if g and np.all(np.isfinite(boxes[k]))]
    if not keep:
        raise ArgumentError("cam: no crop has a tile group and a box (every crop is one the LM never reads)")
    tiles = tuple(Tile(f"crop_{k}", (h, w), tuple(float(v) for v in boxes[k]), groups[k]) for k in keep)
    cells = np.arange(h * w)
    layout = ImageTokenLayout(np.arange(len(keep) * h * w), np.repeat(np.arange(len(keep)), h * w),
                              np.tile(cells // w, len(keep)), np.tile(cells % w, len(keep)), tiles,
                              "crops placed by their boxes")
    values = np.asarray(cam.values, dtype=np.float64)[keep].reshape(-1)
    placed = layout.on_image(values, size)
    attrs = {k: v for k, v in cam.attrs.items() if isinstance(v, str)}
    return {g: xr.DataArray(v.astype(np.float32), dims=("y", "x"), name="cam", attrs={
        **attrs, "tile_group": g, "stitched_crops": ",".join(str(k) for k in keep if groups[k] == g),
        "stitch": f"crops of group {g!r} placed on the {size[0]}x{size[1]} original image by their boxes (padding "
                  "undone), nearest cell; other groups apart, never averaged"}) for g, v in placed.items()}


CROPS = CropsKind()
# Lookup priority: before every form that reads one image's grid (video 20, vitcx 30, ..., flat 100), after the map
# store (10): a crops trace is computed one crop at a time by whichever of them takes that crop.
TRACE_FORMS.register(CROPS.name, CROPS, replace=True, priority=15)
