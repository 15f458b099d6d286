"""The many-image trace kind: maps over a store opened with :func:`vitcam_nb.open_traces`, lazily and one
task per image (dask; a dask.distributed Client when one is active), each image computed by the kind that
accepts its single trace.

Example:
    >>> import timm, numpy as np, tempfile, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224")
    >>> p = vc.trace_many(m, [np.zeros((224, 224, 3), np.uint8)] * 2, tempfile.mkdtemp() + "/t.zarr",
    ...                   targets="top1", sites=["F1"], progress=False)
    >>> subset(vc.open_traces(p), [vc.Recipe(site="F1", layer=-1)])["act"].sizes["layer"]
    1
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.capture.reader import is_store
from vitcam_nb.capture.store_layout import single_trace
from vitcam_nb.compute.maps import map_dims
from vitcam_nb.compute.report import build_checklist, describe
from vitcam_nb.compute.report_cache import cached_report
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import ArgumentTypeError, DegenerateMapWarning, RecipeError, TraceError, user_stacklevel
from vitcam_nb.core.kinds import TRACE_KINDS, MapValues, TraceKind, kind_for
from vitcam_nb.core.recipe import Recipe, recipe_arguments
from vitcam_nb.core.schema import ATTENTION_SITE, is_int

__all__ = ["MANY", "ManyKind", "cam_many", "image_blocks", "is_lazy", "subset"]


def subset(ds: xr.Dataset, recipes: Sequence[Recipe]) -> xr.Dataset:
    """Only the variables, sites and layers the recipes read, so that only their chunks are loaded.

    Example:
        >>> import timm, tempfile, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> ds = vc.open_traces(vc.trace_many(m, [np.zeros((32, 32, 3), np.uint8)] * 2,
        ...                                   tempfile.mkdtemp() + "/t.zarr", targets="top1", progress=False))
        >>> sub = subset(ds, [vc.Recipe(site="F4", layer=0)])
        >>> sorted(sub.data_vars), sub["site"].values.tolist(), sub["layer"].values.tolist()
        (['act', 'grad', 'logits'], ['F4'], [0])
    """
    if kind_for(ds).name != MANY.name:  # a map store (vc.map_many) holds maps, read whole: nothing to narrow
        return ds
    names = ["logits"]
    token_sites = sorted({r.site for r in recipes if r.site != ATTENTION_SITE})
    if token_sites:
        names += ["act", "grad"]
    if any(r.site == ATTENTION_SITE for r in recipes):
        names += ["attn", "attn_grad"]
    missing = [k for k in names if k not in ds]
    if missing:
        sites = [str(s) for s in ds["site"].values] if "site" in ds.coords else []
        raise RecipeError(f"site: the store has no {missing} (traced sites: {sites + (['F2'] if 'attn' in ds else [])})"
                          "; trace again with the site included")
    sub = ds[names]
    # Token coordinates are what a trace's token layout is read from, also when only F2 (query, key) is used.
    sub = sub.assign_coords({k: ds[k] for k in ("token_kind", "patch_row", "patch_col") if k in ds.coords})
    if token_sites and all(s in ds["site"].values for s in token_sites):
        sub = sub.sel(site=token_sites)
    n_layers = ds.attrs.get("num_layers", 0)
    asked = [v for r in recipes for v in (r.layer if isinstance(r.layer, tuple) else (r.layer,))]
    # Only block indices of this model narrow the layers; anything else is for the single trace to refuse.
    if is_int(n_layers) and n_layers > 0 and all(is_int(v) and -n_layers <= v < n_layers for v in asked):
        wanted = {int(v) % n_layers for v in asked}
        traced = [int(v) for v in ds["layer"].values]
        if wanted <= set(traced):
            sub = sub.isel(layer=[traced.index(v) for v in sorted(wanted)])
    return sub


def image_blocks(sub: xr.Dataset) -> xr.Dataset:
    """One image per dask block, every other dimension whole (layers merged inside the task).

    Example:
        >>> import timm, tempfile, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> ds = vc.open_traces(vc.trace_many(m, [np.zeros((32, 32, 3), np.uint8)] * 2,
        ...                                   tempfile.mkdtemp() + "/t.zarr", targets="top1", progress=False))
        >>> image_blocks(ds)["act"].chunks[:2]
        ((1, 1), (2,))
    """
    return sub.chunk({d: (1 if d == "image" else -1) for d in sub.dims})


def is_lazy(ds: xr.Dataset) -> bool:
    """Whether any variable of ``ds`` is a dask array.

    Example:
        >>> import xarray as xr
        >>> is_lazy(xr.Dataset({"a": ("x", np.zeros(2))})), is_lazy(xr.Dataset({"a": ("x", np.zeros(2))}).chunk())
        (False, True)
    """
    return any(v.chunks is not None for v in ds.variables.values())


def _cam_block(block: xr.Dataset, recipe: Recipe) -> xr.Dataset:
    # Each image's kind computes it without a DegenerateMapWarning: tasks run in threads, where silencing a
    # warning (warnings.catch_warnings) is not thread-safe; the reason goes to the `degenerate` coordinate.
    maps, reasons = [], []
    for j in range(block.sizes["image"]):
        one = single_trace(block.isel(image=j).load())
        values, notes, _ = kind_for(one, recipe).compute(one, recipe)
        maps.append(values)
        reasons.append("; ".join(notes))
    return xr.Dataset({"cam": (("image", *map_dims(recipe)), np.stack(maps).astype(np.float32)),
                       "degenerate": (("image",), np.array(reasons, dtype=object))},
                      coords={"image": block["image"].values})


def cam_many(ds: xr.Dataset, recipe: Recipe | None = None, *, grid: bool = False, **fields: Any) -> xr.DataArray:
    """The map of ``recipe`` for every image of a many-image Dataset: lazy (image, y, x), one task per image.

    Each image is computed by :func:`vitcam_nb.cam` on that image alone, reading only the chunks of the
    variables, sites and layers the recipe needs. ``.compute()`` it (on a dask.distributed Client if one is
    active) or write it to zarr. Degenerate maps are zeros with the reason in the ``degenerate`` coordinate
    (the tasks raise no warning). The recipe is checked eagerly on the first image: a bad recipe raises its
    RecipeError now, and a map degenerate there gives one DegenerateMapWarning. A map store
    (:func:`vitcam_nb.open_maps`) is read by its own kind: its stored maps, every image's.

    Example:
        >>> import timm, numpy as np, tempfile, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> imgs = np.random.default_rng(0).integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)
        >>> p = vc.trace_many(m, imgs, tempfile.mkdtemp() + "/t.zarr", targets="top1", sites=["F1"],
        ...                   progress=False)
        >>> maps = cam_many(vc.open_traces(p), vc.Recipe(site="F1", layer=0))
        >>> maps.dims, maps.chunks[0]
        (('image', 'y', 'x'), (1, 1))
    """
    import dask.array as da

    if not is_store(ds):
        raise ArgumentTypeError("ds: expected a many-image Dataset from vc.open_traces (with an 'image' dimension)")
    recipe = recipe_arguments(recipe, grid, fields)
    kind = kind_for(ds, recipe)
    if kind.name != MANY.name:  # a map store (vc.map_many) reads its stored maps
        return kind.cam(ds, recipe)
    n = ds.sizes["image"]
    try:
        sub = subset(ds, [recipe])
        first = str(_cam_block(sub.isel(image=[0]), recipe)["degenerate"].values[0]) if n else ""
    except Exception:
        if not n:
            raise
        # A refusal is the single trace's own: the first image whole, exactly as vc.image_trace(ds, 0) gives it,
        # raises what vc.cam raises on that trace (the subset leaves out what an error message names). Should
        # the whole image compute, the subset lacked something the recipe reads: every image is read whole.
        sub = ds
        first = str(_cam_block(ds.isel(image=[0]), recipe)["degenerate"].values[0])
    if first:  # a bad recipe raised its error above, on the first image, not at compute time
        warnings.warn(f"recipe {recipe.id} is degenerate on the first image ({first}); such maps are zeros, "
                      "and the `degenerate` coordinate says which images are", DegenerateMapWarning,
                      stacklevel=user_stacklevel())
    dims = map_dims(recipe)
    shape = ((int(ds.attrs["grid_h"]), int(ds.attrs["grid_w"])) if recipe.upsample == "none"
             else (int(ds.attrs["img_height"]), int(ds.attrs["img_width"])))
    if is_lazy(sub) and n:
        template = xr.Dataset(
            {"cam": (("image", *dims), da.zeros((n, *shape), chunks=(1, *shape), dtype=np.float32)),
             "degenerate": (("image",), da.zeros(n, chunks=1, dtype=object))},
            coords={"image": sub["image"].values})
        out = xr.map_blocks(_cam_block, image_blocks(sub), kwargs={"recipe": recipe}, template=template)
    else:
        out = _cam_block(sub, recipe) if n else xr.Dataset(
            {"cam": (("image", *dims), np.zeros((0, *shape), np.float32)),
             "degenerate": (("image",), np.zeros(0, object))}, coords={"image": sub["image"].values})
    checklist, methods = cached_report(recipe, ds)
    result = out["cam"].assign_coords(degenerate=out["degenerate"])
    if "trace_id" in ds.coords:
        result = result.assign_coords(trace_id=ds["trace_id"].variable)
    result.attrs = {"recipe": recipe.to_json(), "recipe_id": recipe.id, "checklist": checklist, "methods": methods}
    return result.rename("cam")


class ManyKind(TraceKind):
    """Many-image Datasets from :func:`vitcam_nb.open_traces` (a leading ``image`` dimension).

    Example:
        >>> import xarray as xr, vitcam_nb as vc
        >>> MANY.accepts(xr.Dataset(coords={"image": [0]}), vc.Recipe()), MANY.accepts(xr.Dataset(), vc.Recipe())
        (True, False)
    """

    name = "many"

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        return is_store(trace)

    def compute(self, trace: xr.Dataset, recipe: Recipe) -> MapValues:
        raise TraceError("trace: a many-image Dataset has one map per image; use vc.cam(ds, recipe) for all of "
                         "them, or vc.image_trace(ds, i) for one")

    def cam(self, trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
        return cam_many(trace, recipe)

    def gallery(self, trace: xr.Dataset, recipe: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
        raise TraceError("trace: gallery() takes one image's trace; pick one with vc.image_trace(ds, i)")

    def checklist(self, recipe: Recipe, trace: xr.Dataset) -> Checklist:
        return build_checklist(recipe, trace)

    def describe(self, recipe: Recipe, trace: xr.Dataset) -> str:
        return describe(recipe, trace)


MANY = ManyKind()
# Lookup priority: after flat.
TRACE_KINDS.register(MANY.name, MANY, replace=True, priority=110)
