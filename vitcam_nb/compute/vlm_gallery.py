"""Galleries on a generative VLM's answer trace: the recipe with some fields varied, one ``vc.cam`` map per cell,
kept with its leading dim: one map per crop at the tower sites of a trace whose tower ran on several crops
(LLaVA-NeXT/OneVision, Idefics3/SmolVLM), one map per view (tile group) at the LM-side sites of a multi-tile layout
(:func:`answer_gallery`).

Each cell is exactly ``vc.cam`` of that cell's recipe, so no choice is made across crops or views. On a crops trace
(:func:`crops_gallery`; :class:`~vitcam_nb.compute.vlm_crops.CropsKind`: every crop computed by the single-image
form on its own trace) the gallery has dims ``(*varied, crop, y, x)`` (``(*varied, crop, patch_row, patch_col)``
with ``upsample="none"``), the crops' coordinates (tile, group, box) and ``crop_degenerate`` per cell and crop;
only the tower's sites vary there (the language-model sites have no crop dim), ``"all"`` layers and sites being
crop 0's, which every crop shares. Draw either with :func:`vitcam_nb.plot.views` (one row per cell, one panel per
crop over that crop's pixels, or per view).

Example:
    >>> import xarray as xr, vitcam_nb as vc
    >>> crops_gallery(xr.Dataset(coords={"crop": [0]}), vc.Recipe(), {"site": ["lm_resid"]})
    ... # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    vitcam_nb.core.errors.RecipeError: vary: site 'lm_resid' is a language-model site ...
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.galleries import normalise_vary, vary_values, with_site
from vitcam_nb.compute.maps import cause_counts
from vitcam_nb.core.errors import DegenerateMapWarning, RecipeError, user_stacklevel
from vitcam_nb.core.kinds import form_for
from vitcam_nb.core.recipe import Recipe

__all__ = ["answer_gallery", "crops_gallery"]

_LM_SITES = ("projector", "lm_resid", "lm_attn", "lm_logit")
_GALLERY_LM = _LM_SITES[:3]  # TAM (lm_logit) is a fixed published method: no gallery
_OBJECT_FIELDS = ("class_", "heads", "layer", "text_tokens")


def _axes(trace: xr.Dataset) -> tuple[list[str], list[int], bool]:
    """(tower sites, traced blocks, has a class token) of crop 0's trace."""
    from vitcam_nb.compute.view import TraceView

    view = TraceView.of(trace.isel(crop=0))
    return list(view.sites), [int(v) for v in view.layers], bool(np.any(view.kinds == "cls"))


def _combos(base: Recipe, values: Mapping[str, list], has_cls: bool) -> Iterator[tuple[tuple, Recipe]]:
    """Each combination of the varied values and its recipe, an invalid one refused by name."""
    fields = list(values)
    for combo in itertools.product(*values.values()):
        changes = dict(zip(fields, combo))
        site = changes.pop("site", None)
        try:
            yield combo, (base.replace(**changes) if site is None else with_site(base, site, has_cls, **changes))
        except RecipeError as exc:
            raise RecipeError(f"vary: the combination {dict(zip(fields, combo))} is not a valid recipe: "
                              f"{exc}") from exc


def _stacked(trace: xr.Dataset, base: Recipe, values: Mapping[str, list], has_cls: bool) -> xr.DataArray:
    """Every cell's ``vc.cam`` stacked: dims (*varied, *the map's dims), the map's leading-dim coordinates (crop,
    view or tile) kept, each cell's recipe id and degeneracy (``crop_degenerate`` per crop); one warning counting
    the degenerate maps."""
    fields = list(values)
    maps, ids, reasons, per_crop, first = [], [], [], [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DegenerateMapWarning)
        for combo, rec in _combos(base, values, has_cls):
            try:
                m = form_for(trace, rec).cam(trace, rec)
            except RecipeError as exc:
                raise RecipeError(f"vary: the combination {dict(zip(fields, combo))} is not a valid recipe: "
                                  f"{exc}") from exc
            first = m if first is None else first
            if m.dims != first.dims or m.shape != first.shape:
                raise RecipeError(f"vary: {rec.id} gives a map of dims {dict(m.sizes)}, the first cell "
                                  f"{dict(first.sizes)}; a gallery stacks maps of one shape")
            maps.append(m.values)
            ids.append(m.attrs["recipe_id"])
            reasons.append(m.attrs["degenerate"])
            if "crop_degenerate" in m.coords:
                per_crop.append(m["crop_degenerate"].values)
    for w in caught:
        if not issubclass(w.category, DegenerateMapWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    each = [r for c in per_crop for r in c] if per_crop else reasons
    zero = sum(bool(r) for r in each)
    if zero:
        what = "crop maps" if per_crop else "maps"
        warnings.warn(f"{cause_counts(each)}: {zero} of {len(each)} {what} in the gallery are degenerate and were "
                      "returned as zeros", DegenerateMapWarning, stacklevel=user_stacklevel())
    shape = [len(values[f]) for f in fields]
    coords: dict[str, Any] = {f: np.array(values[f], dtype=object if f in _OBJECT_FIELDS else None) for f in fields}
    coords["recipe_id"] = (fields, np.array(ids).astype(str).reshape(shape))
    coords["degenerate"] = (fields, np.array(reasons).astype(str).reshape(shape))
    lead = first.dims[0] if first.ndim == 3 else None
    if per_crop:
        coords["crop_degenerate"] = ((*fields, "crop"), np.array(per_crop).astype(str).reshape(*shape, -1))
    if lead:
        coords.update({c: (lead, first[c].values) for c in first.coords if first[c].dims == (lead,)
                       and c != "crop_degenerate"})
    form = form_for(trace, base)  # the base recipe's report, as every gallery's attrs hold it
    attrs = {"recipe": base.to_json(), "recipe_id": base.id, "vary": ",".join(fields),
             "trace_id": str(trace.attrs.get("trace_id", "")), "checklist": form.checklist(base, trace).to_json(),
             "methods": form.describe(base, trace),
             **{k: str(first.attrs[k]) for k in ("crop_source_size",) if first.attrs.get(k)}}
    return xr.DataArray(np.stack(maps).reshape(*shape, *first.shape), dims=(*fields, *first.dims),
                        coords=coords, name="gallery", attrs=attrs)


def crops_gallery(trace: xr.Dataset, base: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
    """The gallery of ``base`` with ``vary`` at the tower sites of a crops trace (module docstring).

    Example:
        >>> g = crops_gallery(tr, vc.Recipe(site="F1"), {"layer": [0, 1]})  # doctest: +SKIP
        >>> g.dims  # doctest: +SKIP
        ('layer', 'crop', 'y', 'x')
    """
    vary = normalise_vary(vary)
    sites = vary.get("site", ())
    lm = [s for s in ([sites] if isinstance(sites, str) else sites) if s in _LM_SITES]
    if lm or base.site in _LM_SITES:
        raise RecipeError(f"vary: site {(lm or [base.site])[0]!r} is a language-model site with no crop dim; a "
                          "crops gallery varies the tower's sites (vary the LM sites in a gallery of their own)")
    tower, layers, has_cls = _axes(trace)
    values = {f: vary_values(f, v, {"layer": layers, "site": tower}) for f, v in vary.items()}
    return _stacked(trace, base, values, has_cls)


def answer_gallery(trace: xr.Dataset, base: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
    """The gallery of ``base`` with ``vary`` at the LM-side sites of an answer trace (``projector``, ``lm_resid``,
    ``lm_attn``; ``"all"`` layers are the LM's decoder layers, ``"all"`` sites those the trace holds): each cell
    ``vc.cam``'s map, so ``(*varied, y, x)`` on one grid, ``(*varied, view, y, x)`` over a multi-tile layout (one
    map per tile group, never averaged), ``(*varied, tile, patch_row, patch_col)`` with ``upsample="none"``.

    Example:
        >>> answer_gallery(xr.Dataset(), Recipe(site="lm_resid"), {"site": ["F1"]})
        ... # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        vitcam_nb.core.errors.RecipeError: vary: site 'F1' is a tower site ...
    """
    vary = normalise_vary(vary)
    sites = vary.get("site", ())
    tower = [s for s in ([sites] if isinstance(sites, str) else sites) if s not in _GALLERY_LM and s != "all"]
    if tower or base.site not in _GALLERY_LM:
        raise RecipeError(f"vary: site {(tower or [base.site])[0]!r} is a tower site (or TAM's lm_logit, a fixed "
                          "method); an LM-side gallery varies projector, lm_resid and lm_attn")
    held = [s for s in _GALLERY_LM if s in trace.variables]
    layers = list(range(int(trace.sizes.get("lm_layer", 1))))
    values = {f: vary_values(f, v, {"layer": layers, "site": held}) for f, v in vary.items()}
    return _stacked(trace, base, values, True)
