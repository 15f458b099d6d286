"""The ambiguity analysis on one image of a map store (:func:`vitcam_nb.open_maps`): the store's recipes are the
space. An open field ranges over the values the store's recipes consistent with the description take (any
upsampling of a stored recipe is read from its token-grid map, so ``upsample`` takes any value asked); each map
is read as ``vc.cam`` reads it, which is bitwise the map ``vc.cam`` computes on the trace of the store's pass,
so the analysis equals the one on that trace for the same recipes. A recipe of a requested ``space`` the store
lacks is refused by name; a combination of the store's own values that it lacks is skipped, as combinations no
recipe expresses are.

Example:
    >>> import timm, numpy as np, tempfile, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> imgs = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    >>> ds = vc.open_maps(vc.map_many(m, imgs, {"site": ["F1", "F4"], "layer": [0, 1]},
    ...                               tempfile.mkdtemp() + "/m.zarr", progress=False))
    >>> sorted(store_space(vc.image_maps(ds, 0), {}, ["site", "layer"]).items())
    [('layer', (0, 1)), ('site', ('F1', 'F4'))]
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.map_store import MAPS, is_map_store
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.evaluate.ambiguity.grid import patch_index
from vitcam_nb.evaluate.ambiguity.space import canonical
from vitcam_nb.evaluate.ambiguity.vlm_maps import canvas, is_special

__all__ = ["geometry", "store_maps", "store_recipes", "store_space", "trace_id"]

_FIELDS = [f.name for f in dataclasses.fields(Recipe)]


def _key(choice: Mapping[str, Any], n: int, keep: Sequence[str] = ()) -> tuple | None:
    """The analysis's key of a combination on the token grid, its block numbers made absolute (a stored -1 and
    a requested 1 of a 2-block model are one recipe)."""
    c = {**choice, "upsample": "none"}
    layer = c.get("layer")
    if isinstance(layer, (list, tuple)):
        c["layer"] = tuple(int(v) % n if isinstance(v, int) and -n <= v < n else v for v in layer)
    elif isinstance(layer, int) and not isinstance(layer, bool) and -n <= layer < n:
        c["layer"] = int(layer) % n
    return canonical(c, keep)


def store_recipes(one: xr.Dataset) -> dict[tuple, Recipe]:
    """The store's recipes by their key in the analysis's space (on the token grid). A fused recipe over some of
    the blocks is left out: in that space the blocks of a fused recipe are all of them.

    Example:
        >>> store_recipes(vc.image_maps(vc.open_maps("maps.zarr"), 0))  # doctest: +SKIP
    """
    n = int(one.attrs["num_layers"])
    out: dict[tuple, Recipe] = {}
    for row in json.loads(one.attrs["recipes"]):
        recipe = Recipe.from_json(row["json"])
        if recipe.layer_fusion != "none" and list(row["layers"]) != list(range(n)):
            continue
        key = _key(recipe.to_dict(), n)
        if key is not None:
            out.setdefault(key, recipe)
    return out


def store_space(one: xr.Dataset, fixed: Mapping[str, Any], fields: Sequence[str]) -> dict[str, tuple]:
    """The default values of each open field of ``fields`` on a map store: those the store's recipes consistent
    with ``fixed`` take, in the store's order (block numbers absolute; the layer of unfused recipes).

    Example:
        >>> store_space(vc.image_maps(vc.open_maps("maps.zarr"), 0), {"site": "F1"}, ["layer"])  # doctest: +SKIP
        {'layer': (0, 1)}
    """
    n = int(one.attrs["num_layers"])
    keep = [f for f in fixed if f != "upsample"]
    values: dict[str, dict] = {f: {} for f in fields}
    for key, recipe in store_recipes(one).items():
        d = dict(zip(_FIELDS, key))
        if _key({**d, **fixed}, n, keep) != key:
            continue  # the description contradicts this recipe
        d["upsample"] = recipe.upsample
        for f in fields:
            if f != "layer" or d["layer_fusion"] == "none":
                values[f].setdefault(d[f], None)
    if "layer" in values and not values["layer"]:  # only fused recipes: their layer is every block
        values["layer"] = {"all": None}
    return {f: tuple(v) for f, v in values.items() if v}


def store_maps(one: xr.Dataset, recipes: Sequence[Recipe], cut: tuple[slice, slice] | None, requested: bool
               ) -> list[tuple[np.ndarray, list[str]] | None]:
    """Each recipe's map read from the store (on the image grid at the pixels ``cut`` keeps, a token-grid map
    repeated over its patches as :func:`~vitcam_nb.evaluate.ambiguity.grid.image_maps` does; on the token grid
    when ``cut`` is None) and why it is degenerate. A recipe the store lacks is None, or, when the space was
    ``requested``, refused with every missing recipe named before any map is read.

    Example:
        >>> store_maps(vc.image_maps(vc.open_maps("maps.zarr"), 0), [vc.Recipe(upsample="none")], None, True)
        ... # doctest: +SKIP
    """
    n = int(one.attrs["num_layers"])
    index = store_recipes(one)
    keys = [_key(r.to_dict(), n) for r in recipes]
    missing = [r.replace(upsample="none").to_string() for r, k in zip(recipes, keys) if k not in index]
    if missing and requested:
        shown = "; ".join(missing[:5]) + (f"; ... ({len(missing)} in all)" if len(missing) > 5 else "")
        raise RecipeError(f"space: {len(missing)} recipe(s) of the requested space are not in this map store "
                          f"({shown}); the store's recipes are the space: compute them with vc.map_many, or "
                          "analyse traces")
    if cut is not None:
        height, width, grid, pad = geometry(one)
        rows, cols = patch_index(grid, (height, width), pad, cut)
    out: list[tuple[np.ndarray, list[str]] | None] = []
    for recipe, key in zip(recipes, keys):
        if key not in index:
            out.append(None)
            continue
        values, notes, _ = MAPS.compute(one, index[key].replace(upsample=recipe.upsample))
        if cut is not None:
            values = values[np.ix_(rows, cols)] if recipe.upsample == "none" else values[cut]
        out.append((np.ascontiguousarray(values), notes))
    return out


def geometry(trace: xr.Dataset) -> tuple[int, int, tuple[int, int], tuple[int, int]]:
    """The image size, token grid and padding of a trace or of one image of a map store.

    Example:
        >>> geometry(vc.image_maps(vc.open_maps("maps.zarr"), 0))  # doctest: +SKIP
        (32, 32, (4, 4), (0, 0))
    """
    if is_map_store(trace):
        a = trace.attrs
        pad = tuple(int(v) for v in json.loads(a["pad"]))
        return int(a["img_height"]), int(a["img_width"]), (int(a["grid_h"]), int(a["grid_w"])), pad
    if is_special(trace):  # compared on the image canvas per tile group (vlm_maps)
        height, width = canvas(trace)
        return height, width, (height, width), (0, 0)
    view = TraceView.of(trace)
    return view.height, view.width, (view.gh, view.gw), view.pad


def trace_id(trace: xr.Dataset) -> str:
    """The trace id of a trace, or of the pass that made one image of a map store.

    Example:
        >>> trace_id(xr.Dataset(attrs={"trace_id": "abc"}))
        'abc'
    """
    if is_map_store(trace):
        return str(trace["trace_id"].values)
    return str(trace.attrs.get("trace_id", ""))
