"""Maps and atlases over a many-image Dataset, lazily and one task per image (dask; a dask.distributed
Client when one is active)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.errors import DegenerateMapWarning, RecipeError
from vitcam_nb.many.store import _as_trace
from vitcam_nb.taxonomy import Recipe


def _recipe(recipe: Recipe | None, fields: dict) -> Recipe:
    if recipe is None:
        return Recipe(**fields)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe: expected a vitcam_nb.Recipe, got {type(recipe).__name__}")
    return recipe.replace(**fields) if fields else recipe


def _subset(ds: xr.Dataset, recipes: Sequence[Recipe]) -> xr.Dataset:
    """Only the variables, sites and layers the recipes read, so that only their chunks are loaded."""
    names = ["logits"]
    token_sites = sorted({r.site for r in recipes if r.site != "F2"})
    if token_sites:
        names += ["act", "grad"]
    if any(r.site == "F2" for r in recipes):
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
    n_layers = int(ds.attrs.get("num_layers", 0))
    if n_layers and all(r.layer != "all" for r in recipes):
        wanted = set()
        for r in recipes:
            wanted |= {int(v) % n_layers for v in (r.layer if isinstance(r.layer, tuple) else (r.layer,))}
        traced = [int(v) for v in ds["layer"].values]
        if wanted <= set(traced):
            sub = sub.isel(layer=[traced.index(v) for v in sorted(wanted)])
    return sub


def _blocks(sub: xr.Dataset) -> xr.Dataset:
    """One image per dask block, every other dimension whole (layers merged inside the task)."""
    return sub.chunk({d: (1 if d == "image" else -1) for d in sub.dims})


def _is_lazy(ds: xr.Dataset) -> bool:
    return any(v.chunks is not None for v in ds.variables.values())


def _cam_block(block: xr.Dataset, recipe: Recipe) -> xr.Dataset:
    # vc.cam's own computation, without its DegenerateMapWarning: tasks run in threads, where silencing a
    # warning (warnings.catch_warnings) is not thread-safe; the reason goes to the `degenerate` coordinate.
    from vitcam_nb.cam import _compute, _dims, _TraceView

    maps, reasons = [], []
    for j in range(block.sizes["image"]):
        values, notes, _ = _compute(_TraceView.of(_as_trace(block.isel(image=j).load())), recipe)
        maps.append(values)
        reasons.append("; ".join(notes))
    return xr.Dataset({"cam": (("image", *_dims(recipe)), np.stack(maps).astype(np.float32)),
                       "degenerate": (("image",), np.array(reasons, dtype=object))},
                      coords={"image": block["image"].values})


def cam_many(ds: xr.Dataset, recipe: Recipe | None = None, *, grid: bool = False, **fields: Any) -> xr.DataArray:
    """The map of ``recipe`` for every image of a many-image Dataset: lazy (image, y, x), one task per image.

    Each image is computed by :func:`vitcam_nb.cam` on that image alone, reading only the chunks of the
    variables, sites and layers the recipe needs. ``.compute()`` it (on a dask.distributed Client if one is
    active) or write it to zarr. Degenerate maps are zeros with the reason in the ``degenerate`` coordinate
    (the tasks raise no warning). The recipe is checked eagerly on the first image: a bad recipe raises its
    RecipeError now, and a map degenerate there gives one DegenerateMapWarning.

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

    from vitcam_nb.cam import _dims, _report

    if not isinstance(ds, xr.Dataset) or "image" not in ds.dims:
        raise TypeError("ds: expected a many-image Dataset from vc.open_traces (with an 'image' dimension)")
    recipe = _recipe(recipe, fields)
    if not isinstance(grid, bool):
        raise TypeError(f"grid: expected True or False, got {grid!r}")
    if grid and recipe.upsample != "none":
        recipe = recipe.replace(upsample="none")
    sub = _subset(ds, [recipe])
    n = sub.sizes["image"]
    if n:  # a bad recipe raises its RecipeError now, not at compute time
        first = str(_cam_block(sub.isel(image=[0]), recipe)["degenerate"].values[0])
        if first:
            warnings.warn(f"recipe {recipe.id} is degenerate on the first image ({first}); such maps are zeros, "
                          "and the `degenerate` coordinate says which images are", DegenerateMapWarning, stacklevel=2)
    dims = _dims(recipe)
    shape = ((int(ds.attrs["grid_h"]), int(ds.attrs["grid_w"])) if recipe.upsample == "none"
             else (int(ds.attrs["img_height"]), int(ds.attrs["img_width"])))
    if _is_lazy(sub) and n:
        template = xr.Dataset(
            {"cam": (("image", *dims), da.zeros((n, *shape), chunks=(1, *shape), dtype=np.float32)),
             "degenerate": (("image",), da.zeros(n, chunks=1, dtype=object))},
            coords={"image": sub["image"].values})
        out = xr.map_blocks(_cam_block, _blocks(sub), kwargs={"recipe": recipe}, template=template)
    else:
        out = _cam_block(sub, recipe) if n else xr.Dataset(
            {"cam": (("image", *dims), np.zeros((0, *shape), np.float32)),
             "degenerate": (("image",), np.zeros(0, object))}, coords={"image": sub["image"].values})
    checklist, methods = _report(ds, recipe)
    result = out["cam"].assign_coords(degenerate=out["degenerate"])
    if "trace_id" in ds.coords:
        result = result.assign_coords(trace_id=ds["trace_id"].variable)
    result.attrs = {"recipe": recipe.to_json(), "recipe_id": recipe.id, "checklist": checklist, "methods": methods}
    return result.rename("cam")


def _atlas_image(one: xr.Dataset, recipes: Any, metric: Any, signed: bool | None, metric_kwargs: dict) -> xr.DataArray:
    from vitcam_nb.evaluate.atlas import atlas

    return atlas(_as_trace(one.load()), recipes, metric, signed=signed, **metric_kwargs)


def atlas_many(
    ds: xr.Dataset,
    recipes: Sequence[Recipe] | Mapping[str, Recipe],
    metric: str | Callable[..., float] = "spearman",
    *,
    signed: bool | None = None,
    scheduler: str | None = None,
    **metric_kwargs: Any,
) -> xr.Dataset:
    """Agreement atlas over every image of a many-image Dataset, computed one task per image.

    Each task reads one image's chunks and runs :func:`vitcam_nb.evaluate.atlas` on it; the per-image
    matrices are combined into ``mean``, ``std`` and ``count`` exactly as the atlas of a list of traces.
    Runs on the active dask.distributed Client if there is one (else dask's default scheduler, or
    ``scheduler``).

    Example:
        >>> import timm, numpy as np, tempfile, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> p = vc.trace_many(m, [np.zeros((224, 224, 3), np.uint8)] * 2, tempfile.mkdtemp() + "/t.zarr",
        ...                   targets="top1", sites=["F1", "F4"], progress=False)
        >>> at = atlas_many(vc.open_traces(p), [vc.Recipe(site="F1", layer=0), vc.Recipe(site="F4", layer=0)])
        >>> int(at.attrs["n_images"]), at["mean"].dims
        (2, ('recipe_a', 'recipe_b'))
    """
    import dask

    from vitcam_nb.evaluate.atlas import _metric, _normalise_recipes

    if not isinstance(ds, xr.Dataset) or "image" not in ds.dims:
        raise TypeError("ds: expected a many-image Dataset from vc.open_traces (with an 'image' dimension)")
    items, _ = _normalise_recipes(recipes)
    _metric(metric)
    n = ds.sizes["image"]
    if n == 0:
        raise ValueError("ds: the store holds no finished images")
    sub = _subset(ds, items)
    if _is_lazy(sub):
        blocks = _blocks(sub)
        tasks = [dask.delayed(_atlas_image)(blocks.isel(image=i), recipes, metric, signed, metric_kwargs)
                 for i in range(n)]
        per = dask.compute(*tasks, scheduler=scheduler)
    else:
        per = [_atlas_image(sub.isel(image=i), recipes, metric, signed, metric_kwargs) for i in range(n)]
    from vitcam_nb.evaluate.atlas import aggregate

    return aggregate(per)
