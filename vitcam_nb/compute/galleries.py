"""Galleries: a recipe with some fields varied, as one labelled DataArray. What every trace kind shares: the
``vary`` argument made explicit, site changes that keep the F2 row rule valid, and the gallery computed one
recipe at a time (the flat kind also has a batched one).

Example:
    >>> normalise_vary(("layer", "site"))
    {'layer': 'all', 'site': 'all'}
    >>> vary_values("weighting", ["gradcam", "layercam"], {})
    ['gradcam', 'layercam']
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.maps import cause_counts, map_dims
from vitcam_nb.compute.spatial import upsample
from vitcam_nb.core.errors import DegenerateMapWarning, RecipeError, user_stacklevel
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.schema import ATTENTION_SITE

__all__ = ["gallery_array", "loop_gallery", "normalise_vary", "vary_values", "with_site"]

#: Fields whose values may mix types (ints and strings): their coordinates are object arrays.
_MIXED_FIELDS = ("class_", "heads", "layer", "text_tokens")


def normalise_vary(vary: Mapping[str, Any] | Sequence[str] | str) -> dict[str, Any]:
    """``vary`` as a dict field -> values (a field name or a sequence of them means "all" of each). A gallery
    stacks maps of one size, so upsample values that mix "none" (token grid) with input-size upsamplings are
    refused.

    Example:
        >>> normalise_vary("layer")
        {'layer': 'all'}
    """
    if isinstance(vary, str):
        vary = (vary,)
    if not isinstance(vary, (Mapping, Sequence)) or not vary:
        raise RecipeError(f"vary: expected a recipe field, a list of fields or a dict field -> values, got {vary!r}")
    if not isinstance(vary, Mapping):
        vary = {field: "all" for field in vary}
    ups = vary.get("upsample", ())
    if isinstance(ups, Sequence) and not isinstance(ups, str) and len({u == "none" for u in ups}) > 1:
        raise RecipeError("vary: upsample mixes 'none' (token grid) with an input-size upsampling, and a gallery "
                          "stacks maps of one size; make one gallery for 'none' and one for the others")
    return dict(vary)


def vary_values(field: str, values: Any, everything: Mapping[str, list]) -> list:
    """The values of one varied field; "all" means ``everything[field]`` (layer and site only).

    Example:
        >>> vary_values("layer", "all", {"layer": [0, 1]})
        [0, 1]
    """
    if field not in Recipe.__dataclass_fields__:
        raise RecipeError(f"vary: unknown recipe field {field!r}; fields are {list(Recipe.__dataclass_fields__)}")
    if isinstance(values, str) and values == "all":
        if field in ("layer", "site") and field in everything:
            return list(everything[field])
        raise RecipeError(f"vary: 'all' is supported for layer and site only, not {field!r}")
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()  # numpy scalars become the ints/strs a recipe takes
    if isinstance(values, (str, int)) or not isinstance(values, Sequence) or len(values) == 0:
        raise RecipeError(f"vary: {field} needs a non-empty list of values or 'all', got {values!r}")
    values = list(values)
    repeated = sorted({repr(v) for v in values if values.count(v) > 1})
    if repeated:
        raise RecipeError(f"vary: {field} repeats {', '.join(repeated)}; each value gives one gallery cell, so "
                          "give each once")
    return values


def with_site(recipe: Recipe, site: str, has_cls: bool = True, **changes: Any) -> Recipe:
    """``recipe.replace(site=site, ...)`` keeping the F2 query-row choice valid: other sites take the default
    row rule, and F2 on a model without a CLS token reads the mean over query rows.

    Example:
        >>> with_site(Recipe(site="F2", attn_rows="mean"), "F3").attn_rows
        'cls'
    """
    rows = recipe.attn_rows if has_cls or recipe.attn_rows != "cls" else "mean"
    return recipe.replace(site=site, attn_rows=rows if site == ATTENTION_SITE else "cls", **changes)


def gallery_array(maps: np.ndarray, values: Mapping[str, list], ids: np.ndarray, reasons: np.ndarray,
                  base: Recipe, trace_id: str, checklist: str, methods: str, *,
                  object_fields: Sequence[str] = _MIXED_FIELDS, **attrs: str) -> xr.DataArray:
    """The gallery DataArray: one dimension per varied field, then the map's two; each map's recipe id and
    degeneracy as coordinates; the base recipe's report in the attrs. Fields in ``object_fields`` may mix
    ints and strings, so their coordinates are object arrays.

    Example:
        >>> g = gallery_array(np.zeros((2, 1, 1)), {"site": ["F1", "F4"]}, np.array(["a", "b"]), np.array(["", ""]),
        ...                   Recipe(upsample="none"), "t", "{}", "m")
        >>> g.dims, g["recipe_id"].values.tolist()
        (('site', 'patch_row', 'patch_col'), ['a', 'b'])
    """
    fields = list(values)
    coords = {f: np.array(values[f], dtype=object if f in object_fields else None) for f in fields}
    coords["recipe_id"] = (fields, np.asarray(ids).astype(str))
    coords["degenerate"] = (fields, np.asarray(reasons).astype(str))
    return xr.DataArray(maps, dims=(*fields, *map_dims(base)), coords=coords, name="gallery",
                        attrs={"recipe": base.to_json(), "recipe_id": base.id, "vary": ",".join(fields),
                               "trace_id": trace_id, **attrs, "checklist": checklist, "methods": methods})


def loop_gallery(trace: Any, base: Recipe, values: Mapping[str, list], *, has_cls: bool, common: tuple[int, int],
                 checklist: str, methods: str, **attrs: str) -> xr.DataArray:
    """A gallery computed one recipe at a time, each by the trace kind that accepts it, every map brought to
    the ``common`` grid (bilinear where it differs). Degenerate maps are counted in one warning.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), np.zeros((224, 224, 3), np.uint8), targets="top1")
        >>> loop_gallery(tr, vc.Recipe(upsample="none"), {"layer": [0, 1]}, has_cls=True, common=(14, 14),
        ...              checklist="{}", methods="").shape
        (2, 14, 14)
    """
    fields = list(values)
    maps, ids, reasons = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DegenerateMapWarning)
        for combo in itertools.product(*values.values()):
            changes = dict(zip(fields, combo))
            site = changes.pop("site", None)
            rec = base.replace(**changes) if site is None else with_site(base, site, has_cls, **changes)
            m = kind_for(trace, rec).cam(trace, rec)
            maps.append(m.values if m.shape == common else upsample(m.values, common, "bilinear"))
            ids.append(m.attrs["recipe_id"])
            reasons.append(m.attrs["degenerate"])
    degenerate = [w for w in caught if issubclass(w.category, DegenerateMapWarning)]
    for w in caught:
        if w not in degenerate:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if degenerate:
        warnings.warn(f"{cause_counts(reasons)}: {len(degenerate)} of {len(maps)} gallery maps are degenerate and "
                      "were returned as zeros",
                      DegenerateMapWarning, stacklevel=user_stacklevel())
    shape = [len(values[f]) for f in fields]
    return gallery_array(np.stack(maps).reshape(*shape, *common), values, np.array(ids).reshape(shape),
                         np.array(reasons).reshape(shape), base, str(trace.attrs.get("trace_id", "")), checklist,
                         methods, common_grid=f"{common[0]}x{common[1]}", **attrs)
