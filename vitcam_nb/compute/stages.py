"""The hierarchical trace kind (Swin): an ``xarray.DataTree`` with one child per stage in the single-trace
schema, the root holding ``logits``, ``image`` and the target coordinates.

Recipes address a block by its global index (``layer=5``) or as ``"stage.block"`` (``layer="2.-1"``). A
recipe whose layers lie in one stage is computed on that stage exactly as on a flat trace; layers from
stages with different grids are each brought to a common grid first (the input size, or with
``upsample="none"`` the finest stage grid, bilinear) and then fused — the checklist says so.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1, 1, 1))
    >>> tr = vc.trace(m, np.zeros((224, 224, 3), np.uint8), targets="top1", sites=["F1"])
    >>> global_layer(tr, "1.-1"), stage_dataset(tr, 1).attrs["grid_h"]
    (1, 28)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.fusion import fuse_layers
from vitcam_nb.compute.galleries import loop_gallery, normalise_vary, vary_values
from vitcam_nb.compute.maps import map_array, warn_degenerate
from vitcam_nb.compute.pipeline import layer_maps
from vitcam_nb.compute.report import build_checklist, describe
from vitcam_nb.compute.spatial import upsample
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import RecipeError, TraceError
from vitcam_nb.core.kinds import TRACE_KINDS, MapValues, TraceKind, kind_for
from vitcam_nb.core.recipe import ROLLOUTS, STAGE_BLOCK, Recipe

__all__ = ["STAGES", "StagesKind", "global_layer", "resolve", "stage_dataset", "window_to_dense"]


def window_to_dense(stage: xr.Dataset, layer: int, variable: str = "attn_window") -> np.ndarray:
    """The dense (head, query, key) matrix of one block's window attention (zeros across windows).

    Meant for inspection and tests on small models: at Swin's first stage it is large.

    Example:
        >>> a = window_to_dense(tr["stage_0"].to_dataset(), layer=0)  # doctest: +SKIP
    """
    pos = [int(v) for v in stage["layer"].values].index(layer)
    x = stage[variable].values[..., pos, :, :, :] if variable.endswith("grad") else stage[variable].values[pos]
    keys = stage["attn_window_key"].values[pos]
    n = keys.shape[0]
    out = np.zeros((*x.shape[:-1], n), x.dtype)
    q, j = np.nonzero(keys >= 0)
    out[..., q, keys[q, j]] = x[..., q, j]
    return out


def _stage_layers(tree: xr.DataTree) -> list[list[int]]:
    return json.loads(tree.attrs["stage_layers"])


def stage_dataset(tree: xr.DataTree, stage: int | str) -> xr.Dataset:
    """One stage as a flat single-trace Dataset (root variables and attributes included), usable with
    every function that takes a trace.

    Example:
        >>> ds = stage_dataset(tr, 0)  # doctest: +SKIP
    """
    name = stage if isinstance(stage, str) else f"stage_{stage}"
    if name not in tree.children:
        raise RecipeError(f"layer: stage {stage!r} was not traced (traced stages: {sorted(tree.children)})")
    child = tree[name].to_dataset()
    flat = xr.merge([tree.to_dataset(inherit=False), child], combine_attrs="drop")
    flat.attrs = {**tree.attrs, **child.attrs}
    return flat


def global_layer(tree: xr.DataTree, layer: int | str) -> int:
    """Global block index of ``layer`` (an int, negative from the end, or "stage.block").

    Example:
        >>> global_layer(tr, "1.-1")  # doctest: +SKIP
        3
    """
    stages = _stage_layers(tree)
    total = sum(len(s) for s in stages)
    if isinstance(layer, str):
        m = STAGE_BLOCK.fullmatch(layer)
        s, b = int(m.group(1)), int(m.group(2))
        if s >= len(stages) or not -len(stages[s]) <= b < len(stages[s]):
            raise RecipeError(f"layer: {layer!r} does not exist; stages have "
                              f"{[len(x) for x in stages]} blocks (stage.block, block negative from the end)")
        return stages[s][b]
    if not -total <= layer < total:
        raise RecipeError(f"layer: {layer} is out of range for a model with {total} blocks "
                          f"(allowed -{total}..{total - 1})")
    return layer % total


def _traced_layers(tree: xr.DataTree) -> list[int]:
    return [int(v) for name in sorted(tree.children) for v in tree[name]["layer"].values]


def _stage_of(tree: xr.DataTree, layer: int) -> str:
    for name in sorted(tree.children):
        if layer in [int(v) for v in tree[name]["layer"].values]:
            return name
    raise RecipeError(f"layer: block {layer} was not traced (traced: {_traced_layers(tree)}); trace again with "
                      "layers=None or include it")


def resolve(tree: xr.DataTree, recipe: Recipe) -> Recipe:
    """The recipe with every layer as a global block index (``"all"``: every traced block).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 2), num_heads=(2, 4),
        ...                       embed_dim=16, img_size=56, window_size=7)
        >>> tr = vc.trace(m, np.zeros((56, 56, 3), np.uint8), sites=["F1"])
        >>> resolve(tr, vc.Recipe(layer="1.-1")).layer, resolve(tr, vc.Recipe(layer="all", layer_fusion="mean")).layer
        (2, (0, 1, 2))
    """
    if recipe.layer == "all":
        layers = tuple(_traced_layers(tree))
    elif isinstance(recipe.layer, tuple):
        layers = tuple(global_layer(tree, v) for v in recipe.layer)
    else:
        return recipe.replace(layer=global_layer(tree, recipe.layer))
    if len(set(layers)) != len(layers):
        raise RecipeError(f"layer: {recipe.layer!r} names a block twice; list each block once")
    return recipe.replace(layer=layers)


def _split(tree: xr.DataTree, recipe: Recipe) -> tuple[Recipe, dict[str, list[int]]]:
    """The recipe with global block indices, and its blocks grouped by the stage that holds them."""
    if "stage_layers" not in tree.attrs:
        raise TraceError("trace: a DataTree that is not a vitcam_nb hierarchical trace (no stage_layers)")
    recipe = resolve(tree, recipe)
    layers = recipe.layer if isinstance(recipe.layer, tuple) else (recipe.layer,)
    stages: dict[str, list[int]] = {}
    for layer in layers:
        stages.setdefault(_stage_of(tree, layer), []).append(layer)
    if recipe.layer_fusion in ROLLOUTS:
        raise RecipeError(f"layer_fusion: {recipe.layer_fusion!r} multiplies token-to-token attention across "
                          "blocks; Swin attends within windows and merges patches between stages, so a rollout "
                          "is not applicable. Use layer_fusion 'mean', 'sum' or 'max'")
    return recipe, stages


def _across_note(views: list[TraceView], common: tuple[int, int]) -> str:
    grids = ", ".join(f"{v.gh}x{v.gw}" for v in views)
    return (f"layers come from stages with grids {grids}; each layer map was resampled (bilinear) to a common "
            f"{common[0]}x{common[1]} grid before fusion")


def _across(tree: xr.DataTree, recipe: Recipe, stages: dict[str, list[int]]) -> MapValues:
    """Layers of several stages: each stage's layer maps on a common grid, then fused."""
    views = {name: TraceView.of(stage_dataset(tree, name)) for name in stages}
    finest = max(views.values(), key=lambda v: v.gh * v.gw)
    common = (finest.gh, finest.gw) if recipe.upsample == "none" else (finest.height, finest.width)
    maps, reasons, ids = [], [], []
    for name, layers in stages.items():
        view = views[name]
        view.site_check(recipe.site)
        m, r = layer_maps(view, recipe, view.layer_positions(tuple(layers)))
        if m.shape[-2:] != common:
            m = upsample(m, common, "bilinear")
        maps.append(m)
        reasons.extend(r)
        ids.extend(layers)
    return fuse_layers(np.concatenate(maps), np.array(reasons, object), ids, recipe)


def _report(tree: xr.DataTree, recipe: Recipe, stages: dict[str, list[int]]) -> tuple[Checklist, str]:
    """The checklist and methods of a resolved recipe: its stage's, plus the common-grid note across stages."""
    first = stage_dataset(tree, next(iter(stages)))
    checklist, methods = build_checklist(recipe, first), describe(recipe, first)
    if len(stages) > 1:
        views = [TraceView.of(stage_dataset(tree, name)) for name in stages]
        finest = max(views, key=lambda v: v.gh * v.gw)
        common = (finest.gh, finest.gw) if recipe.upsample == "none" else (finest.height, finest.width)
        note = _across_note(views, common)
        checklist["spatial reconstruction"]["stages"] = note
        methods = methods + " " + note[0].upper() + note[1:] + "."
    return checklist, methods


class StagesKind(TraceKind):
    """Hierarchical (Swin) traces: DataTrees with one child per stage.

    Example:
        >>> import vitcam_nb as vc
        >>> STAGES.accepts(xr.DataTree(), vc.Recipe()), STAGES.accepts(xr.Dataset(), vc.Recipe())
        (True, False)
    """

    name = "stages"

    def resolve(self, trace: Any, recipe: Recipe) -> Recipe:
        """Every layer as a global block index: ``"1.-1"`` and the block it names give one recipe."""
        return resolve(trace, recipe)

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        return isinstance(trace, xr.DataTree)

    def compute(self, tree: xr.DataTree, recipe: Recipe) -> MapValues:
        recipe, stages = _split(tree, recipe)
        if len(stages) == 1:
            ds = stage_dataset(tree, next(iter(stages)))
            return kind_for(ds, recipe).compute(ds, recipe)
        return _across(tree, recipe, stages)

    def cam(self, tree: xr.DataTree, recipe: Recipe) -> xr.DataArray:
        given = recipe
        recipe, stages = _split(tree, recipe)
        if len(stages) == 1:
            name = next(iter(stages))
            ds = stage_dataset(tree, name)
            out = kind_for(ds, recipe).cam(ds, recipe)
            out.attrs["stage"] = name
        else:
            values, notes, partial = _across(tree, recipe, stages)
            reason = warn_degenerate(recipe, notes) if notes else ""
            checklist, methods = _report(tree, recipe, stages)
            out = map_array(values, recipe, str(tree.attrs.get("trace_id", "")), checklist.to_json(), methods, reason,
                            partial, stage=",".join(stages))
        if given != recipe:
            out.attrs["recipe_as_given"] = given.to_json()
        return out

    def gallery(self, tree: xr.DataTree, recipe: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
        vary = normalise_vary(vary)
        first = stage_dataset(tree, sorted(tree.children)[0])
        values = {f: vary_values(f, v, {"layer": _traced_layers(tree), "site": TraceView.of(first).sites})
                  for f, v in vary.items()}
        nodes = [tree[c] for c in sorted(tree.children)]
        grids = [(int(n.attrs["grid_h"]), int(n.attrs["grid_w"])) for n in nodes]
        common = max(grids, key=lambda g: g[0] * g[1]) if recipe.upsample == "none" else \
            (first.sizes["y"], first.sizes["x"])
        checklist = build_checklist(recipe, first)
        checklist["spatial reconstruction"]["stages"] = (
            f"stages have grids {', '.join(f'{h}x{w}' for h, w in grids)}; every map is shown on a common "
            f"{common[0]}x{common[1]} grid (bilinear where resampled)")
        has_cls = "cls" in [str(k) for k in first["token_kind"].values]
        return loop_gallery(tree, recipe, values, has_cls=has_cls, common=common, checklist=checklist.to_json(),
                            methods=describe(recipe, first))

    def checklist(self, recipe: Recipe, tree: xr.DataTree) -> Checklist:
        try:
            resolved, stages = _split(tree, recipe)
        except (RecipeError, TraceError):  # a recipe this tree cannot compute is still described, generically
            return build_checklist(recipe, tree)
        return _report(tree, resolved, stages)[0]

    def describe(self, recipe: Recipe, tree: xr.DataTree) -> str:
        try:
            resolved, stages = _split(tree, recipe)
        except (RecipeError, TraceError):
            return describe(recipe, tree)
        return _report(tree, resolved, stages)[1]


STAGES = StagesKind()
# Lookup priority: after flat.
TRACE_KINDS.register(STAGES.name, STAGES, replace=True, priority=120)
