"""Hierarchical traces (Swin): one ``xarray.DataTree`` child per stage in the single-trace schema, the
root holding ``logits``, ``image`` and the target coordinates (DESIGN.md section 4).

Recipes address a block by its global index (``layer=5``) or as ``"stage.block"`` (``layer="2.-1"``). A
recipe whose layers lie in one stage is computed on that stage exactly as on a flat trace; layers from
stages with different grids are each brought to a common grid first (the input size, or with
``upsample="none"`` the finest stage grid, bilinear) and then fused — the checklist says so.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1, 1, 1))
    >>> tr = vc.trace(m, np.zeros((224, 224, 3), np.uint8), targets="top1", sites=["F1"])
    >>> sorted(tr.children)
    ['stage_0', 'stage_1', 'stage_2', 'stage_3']
"""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.errors import DegenerateMapWarning, RecipeError, TraceError
from vitcam_nb.taxonomy import ROLLOUTS, STAGE_BLOCK, Recipe

ROOT_VARS = ("logits", "image")
ROOT_COORDS = ("class", "class_label", "target", "target_class", "target_label", "y", "x", "rgb")


def assemble_stages(assemble: Any, *, model: Any, adapter: Any, site_ids: list[str], layer_ids: list[int],
                    acts: dict, grads: dict, store_dtype: type, **common: Any) -> xr.DataTree:
    """Build the DataTree of a hierarchical model from the tracer's per-(layer, site) tensors, calling the
    flat assembler once per stage (so every stage follows the single-trace schema)."""
    nodes: dict[str, xr.Dataset] = {}
    root: xr.Dataset | None = None
    token_sites = [s for s in site_ids if s != "F2"]
    blocks = adapter.blocks(model)
    for s, stage_layers in enumerate(adapter.stages(model)):
        ids = [layer for layer in layer_ids if layer in stage_layers]
        if not ids:
            continue
        h, w = adapter.resolution[ids[0]]
        ds = assemble(model=model, adapter=adapter, layer_ids=ids, site_ids=token_sites or [],
                      acts=acts, grads=grads, grid=(h, w), store_dtype=store_dtype, **common)
        if "F2" in site_ids:
            ds = _add_window_attention(ds, adapter, model, ids, acts, grads, store_dtype)
        attn = blocks[ids[0]].attn
        heads = int(attn.num_heads)
        ds.attrs.update({
            "stage": s, "stage_first_layer": stage_layers[0], "stage_blocks": len(stage_layers),
            "num_heads": heads, "head_dim": int(attn.qkv.out_features // 3 // heads),
            "stage_dim": int(attn.qkv.in_features),
        })
        for site in site_ids:
            ds.attrs[f"hook_{site}"] = adapter.site_table(model)[site].hook(adapter.block_template)
        if root is None:
            root = xr.Dataset({v: ds[v] for v in ROOT_VARS},
                              coords={c: ds[c] for c in ROOT_COORDS if c in ds.coords}, attrs=dict(ds.attrs))
        nodes[f"stage_{s}"] = ds.drop_vars([*ROOT_VARS, *[c for c in ROOT_COORDS if c != "target"]])
    assert root is not None
    # One trace, one id: the root's settings cover every traced layer.
    from vitcam_nb.provenance import settings_id

    trace_id = settings_id({"stages": [nodes[k].attrs["trace_id"] for k in sorted(nodes)], "sites": site_ids})
    for ds in [root, *nodes.values()]:
        ds.attrs["trace_id"] = trace_id
    # Per-stage facts live on the stages; the root keeps what holds for the whole model.
    for key in [k for k in root.attrs if k.startswith("hook_")] + ["stage", "stage_first_layer", "stage_blocks",
                                                                   "stage_dim", "grid_h", "grid_w", "num_heads",
                                                                   "head_dim"]:
        root.attrs.pop(key, None)
    root.attrs.update({"num_stages": len(adapter.stages(model)), "hierarchical": 1,
                       "stage_layers": json.dumps(adapter.stages(model)),
                       "num_heads_per_stage": json.dumps([int(nodes[k].attrs["num_heads"]) for k in sorted(nodes)])})
    return xr.DataTree.from_dict({"/": root, **nodes})


def _add_window_attention(ds: xr.Dataset, adapter: Any, model: Any, ids: list[int], acts: dict, grads: dict,
                          store_dtype: type) -> xr.Dataset:
    from vitcam_nb.tracer import _to_numpy

    attn = np.stack([_to_numpy(acts.pop((i, "F2")), None, store_dtype)[0] for i in ids])
    attn_grad = np.stack([_to_numpy(grads.pop((i, "F2")), None, store_dtype) for i in ids], axis=1)
    keys = np.stack([adapter.window_keys(model, i) for i in ids])
    ds = ds.assign_coords(head=np.arange(attn.shape[1]), query=ds["token"].values,
                          wkey=np.arange(attn.shape[-1]))
    ds = ds.assign_coords(attn_window_key=(("layer", "query", "wkey"), keys))
    return ds.assign(attn_window=(("layer", "head", "query", "wkey"), attn),
                     attn_window_grad=(("target", "layer", "head", "query", "wkey"), attn_grad))


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


# -- recipes on a tree ---------------------------------------------------------------------------------
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
    """The recipe with every layer as a global block index (``"all"``: every traced block)."""
    if recipe.layer == "all":
        layers = tuple(_traced_layers(tree))
    elif isinstance(recipe.layer, tuple):
        layers = tuple(global_layer(tree, v) for v in recipe.layer)
    else:
        return recipe.replace(layer=global_layer(tree, recipe.layer))
    if len(set(layers)) != len(layers):
        raise RecipeError(f"layer: {recipe.layer!r} names a block twice; list each block once")
    return recipe.replace(layer=layers)


def cam_stages(tree: xr.DataTree, recipe: Recipe) -> xr.DataArray:
    """:func:`vitcam_nb.cam` on a hierarchical trace (see the module docstring).

    Example:
        >>> vc.cam(tr, vc.Recipe(site="F1", layer="3.-1")).dims  # doctest: +SKIP
        ('y', 'x')
    """
    from vitcam_nb.cam import cam

    if "stage_layers" not in tree.attrs:
        raise TraceError("trace: a DataTree that is not a vitcam_nb hierarchical trace (no stage_layers)")
    given = recipe
    recipe = resolve(tree, recipe)
    layers = recipe.layer if isinstance(recipe.layer, tuple) else (recipe.layer,)
    stages = {}
    for layer in layers:
        stages.setdefault(_stage_of(tree, layer), []).append(layer)
    if recipe.layer_fusion in ROLLOUTS:
        raise RecipeError(f"layer_fusion: {recipe.layer_fusion!r} multiplies token-to-token attention across "
                          "blocks; Swin attends within windows and merges patches between stages, so a rollout "
                          "is not applicable. Use layer_fusion 'mean', 'sum' or 'max'")
    if len(stages) == 1:
        name = next(iter(stages))
        out = cam(stage_dataset(tree, name), recipe)
        out.attrs["stage"] = name
    else:
        out = _cam_across(tree, recipe, stages)
    if given != recipe:
        out.attrs["recipe_as_given"] = given.to_json()
    return out


def _cam_across(tree: xr.DataTree, recipe: Recipe, stages: dict[str, list[int]]) -> xr.DataArray:
    import sys

    cm = sys.modules["vitcam_nb.cam"]  # the module; the package attribute "cam" is the function
    views = {name: cm._TraceView.of(stage_dataset(tree, name)) for name in stages}
    finest = max(views.values(), key=lambda v: v.gh * v.gw)
    common = (finest.gh, finest.gw) if recipe.upsample == "none" else (finest.height, finest.width)
    maps, reasons, ids = [], [], []
    for name, layers in stages.items():
        view = views[name]
        view.site_check(recipe.site)
        m, r = cm._layer_maps(view, recipe, view.layer_positions(tuple(layers)))
        if m.shape[-2:] != common:
            m = cm.upsample(m, common, "bilinear")
        maps.append(m)
        reasons.extend(r)
        ids.extend(layers)
    values, notes, partial = cm._fuse_layers(np.concatenate(maps), np.array(reasons, object), ids, recipe)
    reason = cm._warn(recipe, notes) if notes else ""
    first = stage_dataset(tree, next(iter(stages)))
    checklist, methods = cm._report(first, recipe)
    grids = ", ".join(f"{v.gh}x{v.gw}" for v in views.values())
    note = (f"layers come from stages with grids {grids}; each layer map was resampled (bilinear) to a common "
            f"{common[0]}x{common[1]} grid before fusion")
    data = json.loads(checklist)
    data["spatial reconstruction"]["stages"] = note
    return xr.DataArray(
        values.astype(np.float32, copy=False), dims=cm._dims(recipe), name="cam",
        attrs={"recipe": recipe.to_json(), "recipe_id": recipe.id, "trace_id": str(tree.attrs.get("trace_id", "")),
               "checklist": json.dumps(data), "methods": methods + " " + note[0].upper() + note[1:] + ".",
               "degenerate": reason, "degenerate_layers": "; ".join(partial), "stage": ",".join(stages)},
    )


def gallery_loop(trace: xr.DataTree | xr.Dataset, recipe: Recipe | None = None,
                 vary: Mapping[str, Any] | Sequence[str] = ("layer", "site")) -> xr.DataArray:
    """:func:`vitcam_nb.gallery` one recipe at a time, for what the batched gallery does not cover: a
    hierarchical trace (maps on the input size or, with ``upsample="none"``, resampled to the finest stage
    grid) and the cross-attention site ``xattn``.

    Example:
        >>> vc.gallery(tr, vc.Recipe(), vary={"layer": "all"}).dims  # doctest: +SKIP
        ('layer', 'y', 'x')
    """
    from vitcam_nb.cam import _report, _TraceView, cam, upsample, with_site

    base = recipe if recipe is not None else Recipe()
    if not isinstance(base, Recipe):
        raise TypeError(f"recipe: expected a vitcam_nb.Recipe, got {type(base).__name__}")
    tree = trace if isinstance(trace, xr.DataTree) else None
    first = stage_dataset(tree, sorted(tree.children)[0]) if tree is not None else trace
    if isinstance(vary, str):
        vary = (vary,)
    if not isinstance(vary, Mapping):
        vary = {field: "all" for field in vary}
    has_cls = "cls" in [str(k) for k in first["token_kind"].values]
    values = {}
    for field, vals in vary.items():
        if field not in Recipe.__dataclass_fields__:
            raise RecipeError(f"vary: unknown recipe field {field!r}")
        if isinstance(vals, str) and vals == "all" and field == "layer":
            vals = _traced_layers(tree) if tree is not None else \
                [int(v) for v in trace["xattn_layer" if base.site == "xattn" else "layer"].values]
        elif isinstance(vals, str) and vals == "all" and field == "site":
            vals = _TraceView.of(first).sites + (["xattn"] if "xattn" in first.variables else [])
        if isinstance(vals, (str, int)) or not isinstance(vals, Sequence) or len(vals) == 0:
            raise RecipeError(f"vary: {field} needs a non-empty list of values or 'all', got {vals!r}")
        values[field] = list(vals)
    fields = list(values)
    size = (first.sizes["y"], first.sizes["x"])
    nodes = [tree[c] for c in sorted(tree.children)] if tree is not None else [first]
    grids = [(int(n.attrs["grid_h"]), int(n.attrs["grid_w"])) for n in nodes]
    common = max(grids, key=lambda g: g[0] * g[1]) if base.upsample == "none" else size
    maps, ids, reasons = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DegenerateMapWarning)
        for combo in itertools.product(*values.values()):
            changes = dict(zip(fields, combo))
            site = changes.pop("site", None)
            rec = base.replace(**changes) if site is None else with_site(base, site, has_cls, **changes)
            m = cam_stages(tree, rec) if tree is not None else cam(trace, rec)
            v = m.values if m.shape == common else upsample(m.values, common, "bilinear")
            maps.append(v)
            ids.append(m.attrs["recipe_id"])
            reasons.append(m.attrs["degenerate"])
    degenerate = [w for w in caught if issubclass(w.category, DegenerateMapWarning)]
    for w in caught:
        if w not in degenerate:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if degenerate:
        warnings.warn(f"{len(degenerate)} of {len(maps)} gallery maps are degenerate and were returned as zeros",
                      DegenerateMapWarning, stacklevel=2)
    shape = [len(values[f]) for f in fields]
    coords = {f: np.array(values[f], dtype=object if f in ("class_", "heads", "layer", "text_tokens") else None)
              for f in fields}
    coords["recipe_id"] = (fields, np.array(ids).reshape(shape))
    coords["degenerate"] = (fields, np.array(reasons).reshape(shape))
    dims = ("patch_row", "patch_col") if base.upsample == "none" else ("y", "x")
    checklist, methods = _report(first, base) if base.site != "xattn" else (m.attrs["checklist"], m.attrs["methods"])
    if tree is not None:
        data = json.loads(checklist)
        data["spatial reconstruction"]["stages"] = (
            f"stages have grids {', '.join(f'{h}x{w}' for h, w in grids)}; every map is shown on a common "
            f"{common[0]}x{common[1]} grid (bilinear where resampled)")
        checklist = json.dumps(data)
    return xr.DataArray(np.stack(maps).reshape(*shape, *common), dims=(*fields, *dims), coords=coords,
                        name="gallery", attrs={"recipe": base.to_json(), "recipe_id": base.id, "vary": ",".join(fields),
                                               "trace_id": str(trace.attrs.get("trace_id", "")),
                                               "common_grid": f"{common[0]}x{common[1]}",
                                               "checklist": checklist, "methods": methods})
