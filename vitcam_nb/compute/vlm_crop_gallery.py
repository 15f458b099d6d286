"""Galleries on a trace whose tower ran on several crops (LLaVA-NeXT/OneVision, Idefics3/SmolVLM): the recipe with
some fields varied, one map per crop in every cell.

Each cell is exactly ``vc.cam`` of that cell's recipe on the crops trace (:class:`~vitcam_nb.compute.vlm_crops.
CropsKind`: every crop computed by the single-image form on its own trace, no choice made across crops), so the
gallery has dims ``(*varied, crop, y, x)`` (``(*varied, crop, patch_row, patch_col)`` with ``upsample="none"``),
the crops' coordinates (tile, group, box) and ``crop_degenerate`` per cell and crop. Only the tower's sites vary
(the language-model sites have no crop dim); ``"all"`` layers and sites are crop 0's, which every crop shares.
Draw it with :func:`vitcam_nb.plot.views` (one row per cell, one panel per crop over that crop's pixels).

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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.galleries import normalise_vary, vary_values, with_site
from vitcam_nb.compute.maps import cause_counts, map_dims
from vitcam_nb.core.errors import DegenerateMapWarning, RecipeError, user_stacklevel
from vitcam_nb.core.kinds import form_for
from vitcam_nb.core.recipe import Recipe

__all__ = ["crops_gallery"]

_LM_SITES = ("projector", "lm_resid", "lm_attn", "lm_logit")
_OBJECT_FIELDS = ("class_", "heads", "layer", "text_tokens")


def _axes(trace: xr.Dataset) -> tuple[list[str], list[int], bool]:
    """(tower sites, traced blocks, has a class token) of crop 0's trace."""
    from vitcam_nb.compute.view import TraceView

    view = TraceView.of(trace.isel(crop=0))
    return list(view.sites), [int(v) for v in view.layers], bool(np.any(view.kinds == "cls"))


def crops_gallery(trace: xr.Dataset, base: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
    """The gallery of ``base`` with ``vary`` on a crops trace (module docstring); degenerate maps in one warning.

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
                          "crops gallery varies the tower's sites (call vitcam_nb.cam per recipe for the LM sites)")
    tower, layers, has_cls = _axes(trace)
    fields = list(vary)
    values = {f: vary_values(f, v, {"layer": layers, "site": tower}) for f, v in vary.items()}
    maps, ids, reasons, per_crop, first = [], [], [], [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DegenerateMapWarning)
        for combo in itertools.product(*values.values()):
            changes = dict(zip(fields, combo))
            site = changes.pop("site", None)
            try:
                rec = base.replace(**changes) if site is None else with_site(base, site, has_cls, **changes)
            except RecipeError as exc:
                raise RecipeError(f"vary: the combination {dict(zip(fields, combo))} is not a valid recipe: "
                                  f"{exc}") from exc
            m = form_for(trace, rec).cam(trace, rec)
            first = m if first is None else first
            if m.shape != first.shape:
                raise RecipeError(f"vary: {rec.id} gives maps of shape {m.shape[1:]}, the first cell "
                                  f"{first.shape[1:]}; a gallery stacks maps of one size")
            maps.append(m.values)
            ids.append(m.attrs["recipe_id"])
            reasons.append(m.attrs["degenerate"])
            per_crop.append(m["crop_degenerate"].values)
    for w in caught:
        if not issubclass(w.category, DegenerateMapWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    zero = int(sum(bool(r) for r in np.concatenate(per_crop)))
    if zero:
        warnings.warn(f"{cause_counts([r for c in per_crop for r in c])}: {zero} of {len(per_crop) * first.shape[0]} "
                      "crop maps in the gallery are degenerate and were returned as zeros",
                      DegenerateMapWarning, stacklevel=user_stacklevel())
    shape = [len(values[f]) for f in fields]
    coords: dict[str, Any] = {f: np.array(values[f], dtype=object if f in _OBJECT_FIELDS else None) for f in fields}
    coords["recipe_id"] = (fields, np.array(ids).astype(str).reshape(shape))
    coords["degenerate"] = (fields, np.array(reasons).astype(str).reshape(shape))
    coords["crop_degenerate"] = ((*fields, "crop"), np.array(per_crop).astype(str).reshape(*shape, -1))
    coords.update({c: ("crop", first[c].values) for c in first.coords if first[c].dims == ("crop",)
                   and c != "crop_degenerate"})
    form = form_for(trace, base)  # the base recipe's report, as every gallery's attrs hold it
    attrs = {"recipe": base.to_json(), "recipe_id": base.id, "vary": ",".join(fields),
             "trace_id": str(trace.attrs.get("trace_id", "")), "checklist": form.checklist(base, trace).to_json(),
             "methods": form.describe(base, trace), "crop_source_size": str(first.attrs.get("crop_source_size", ""))}
    return xr.DataArray(np.stack(maps).reshape(*shape, *first.shape), dims=(*fields, "crop", *map_dims(base)),
                        coords=coords, name="gallery", attrs=attrs)
