"""Assembly of a hierarchical (Swin) trace: an ``xarray.DataTree`` with one child per stage in the
single-trace schema (its own grid, heads and hook templates), the root holding ``logits``, ``image`` and the
target coordinates. F2 is stored per window (``attn_window``) with the raster token of every key
(``attn_window_key``): a dense token x token matrix would be mostly zeros and too large at the first stage.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1, 1, 1))
    >>> tr = vc.trace(m, np.zeros((224, 224, 3), np.uint8), targets="top1", sites=["F1"])
    >>> sorted(tr.children)
    ['stage_0', 'stage_1', 'stage_2', 'stage_3']
"""

from __future__ import annotations

import json

import numpy as np
import xarray as xr

from vitcam_nb.capture.assemble import assemble, to_numpy
from vitcam_nb.capture.passes import ImagePass, PassResult
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.provenance import settings_id
from vitcam_nb.core.schema import ATTENTION_SITE, ROOT_COORDS, ROOT_VARS
from vitcam_nb.preprocess import PreparedInput

__all__ = ["assemble_tree"]

# Facts of one stage: they live on the stage nodes, not on the root.
_STAGE_ATTRS = ("stage", "stage_first_layer", "stage_blocks", "stage_dim", "grid_h", "grid_w", "num_heads",
                "head_dim")


def assemble_tree(plan: TracePlan, prepared: PreparedInput, image: ImagePass, run: PassResult) -> xr.DataTree:
    """The DataTree of one image of a hierarchical model, one flat assembly per traced stage.

    Example:
        >>> import timm
        >>> from vitcam_nb.capture.passes import run_pass
        >>> from vitcam_nb.capture.plan import TracePlan
        >>> from vitcam_nb.preprocess import prepare_input
        >>> m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1), num_heads=(2, 4),
        ...                       embed_dim=16, img_size=56, window_size=7)
        >>> plan = TracePlan.for_trace(m, "top1", sites=["F2"])
        >>> prepared = prepare_input(m, np.zeros((56, 56, 3), np.uint8))
        >>> run = run_pass(plan, prepared.tensor)
        >>> assemble_tree(plan, prepared, run.image(0), run)["stage_1"]["attn_window"].dims
        ('layer', 'head', 'query', 'wkey')
    """
    model, adapter = plan.model, plan.adapter
    nodes: dict[str, xr.Dataset] = {}
    root: xr.Dataset | None = None
    token_sites = [s for s in plan.site_ids if s != ATTENTION_SITE]
    stages = adapter.stages(model)
    for s, stage_layers in enumerate(stages):
        ids = [layer for layer in plan.layer_ids if layer in stage_layers]
        if not ids:
            continue
        ds = assemble(plan, prepared, image, run, layer_ids=ids, site_ids=token_sites,
                      grid=adapter.grid_of(run.ctx, ids[0]))
        if ATTENTION_SITE in plan.site_ids:
            ds = _add_window_attention(ds, plan, image, run, ids)
        ds.attrs.update({
            "stage": s, "stage_first_layer": stage_layers[0], "stage_blocks": len(stage_layers),
            **adapter.block_facts(model, ids[0]),
        })
        for site in plan.site_ids:
            ds.attrs[f"hook_{site}"] = adapter.site_table(model)[site].hook(adapter.block_template)
        if root is None:
            root = xr.Dataset({v: ds[v] for v in ROOT_VARS},
                              coords={c: ds[c] for c in ROOT_COORDS if c in ds.coords}, attrs=dict(ds.attrs))
        nodes[f"stage_{s}"] = ds.drop_vars([*ROOT_VARS, *[c for c in ROOT_COORDS if c != "target"]])
    if root is None:
        raise ArgumentError("layers: no traced layer lies in any stage of the model")
    # One trace, one id: the root's settings cover every traced layer.
    trace_id = settings_id({"stages": [nodes[k].attrs["trace_id"] for k in sorted(nodes)], "sites": plan.site_ids})
    for ds in [root, *nodes.values()]:
        ds.attrs["trace_id"] = trace_id
    for key in [k for k in root.attrs if k.startswith("hook_")] + list(_STAGE_ATTRS):
        root.attrs.pop(key, None)
    root.attrs.update({"num_stages": len(stages), "hierarchical": 1, "stage_layers": json.dumps(stages),
                       "num_heads_per_stage": json.dumps([int(nodes[k].attrs["num_heads"]) for k in sorted(nodes)])})
    return xr.DataTree.from_dict({"/": root, **nodes})


def _add_window_attention(ds: xr.Dataset, plan: TracePlan, image: ImagePass, run: PassResult,
                          ids: list[int]) -> xr.Dataset:
    dtype = plan.store_dtype
    group = (tuple(ids), (ATTENTION_SITE,))
    attn, attn_grad = image.filled.get((*group, "act")), image.filled.get((*group, "grad"))
    if attn is None:  # the pass kept tensors: stacked here
        attn = np.stack([to_numpy(image.acts.pop((i, ATTENTION_SITE)), None, dtype)[0] for i in ids])
        attn_grad = np.stack([to_numpy(image.grads.pop((i, ATTENTION_SITE)), None, dtype)[:, 0] for i in ids],
                             axis=1)
    keys = np.stack([plan.adapter.window_keys(run.ctx, i) for i in ids])
    ds = ds.assign_coords(head=np.arange(attn.shape[1]), query=ds["token"].values,
                          wkey=np.arange(attn.shape[-1]))
    ds = ds.assign_coords(attn_window_key=(("layer", "query", "wkey"), keys))
    return ds.assign(attn_window=(("layer", "head", "query", "wkey"), attn),
                     attn_window_grad=(("target", "layer", "head", "query", "wkey"), attn_grad))
