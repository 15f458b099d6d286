"""Assembly of one image's trace Dataset from a pass: the site tensors laid out in the schema of
:mod:`vitcam_nb.core.schema`, the coordinates of the token layout, and every attribute the checklist and
the trace id are made of.

Example:
    >>> import timm, numpy as np
    >>> from vitcam_nb.capture.passes import run_pass
    >>> from vitcam_nb.capture.plan import TracePlan
    >>> from vitcam_nb.preprocess import prepare_input
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    >>> plan = TracePlan.for_trace(m, "top1", sites=["F1"], layers=[0])
    >>> prepared = prepare_input(m, np.zeros((224, 224, 3), np.uint8))
    >>> run = run_pass(plan, prepared.tensor)
    >>> assemble(plan, prepared, run.image(0), run)["act"].dims
    ('layer', 'site', 'token', 'channel')
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from vitcam_nb.capture.dataset_build import dataset
from vitcam_nb.capture.passes import ImagePass, PassResult
from vitcam_nb.capture.plan import TracePlan, memory_mode, model_name
from vitcam_nb.capture.runtime import release_freed_memory
from vitcam_nb.capture.video import frame_coords
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.provenance import array_sha256, settings_id, weights_facts
from vitcam_nb.core.rules import DEFAULT_RULE
from vitcam_nb.core.schema import (
    ATTENTION_SITE,
    EXPECTED_LABEL,
    EXPECTED_TARGET,
    OPTIONAL_SITES,
    SCHEMA_VERSION,
    SCORES_SITE,
    target_name,
)
from vitcam_nb.core.version import __version__
from vitcam_nb.preprocess import PreparedInput, preprocessing_json
from vitcam_nb.targets.classes import ClassTargets

__all__ = ["assemble", "to_numpy", "token_coords"]


def to_numpy(t: torch.Tensor | np.ndarray | None, shape: tuple | None, dtype: type) -> np.ndarray:
    """A captured tensor on the CPU as ``dtype`` (reshaped to ``shape``); None (the targets do not depend on
    the tensor at all) becomes zeros; an array the pass wrote in the storage dtype is used as it is.

    Example:
        >>> to_numpy(None, (2,), np.float16)
        array([0., 0.], dtype=float16)
    """
    if t is None:
        return np.zeros(shape, dtype)
    if isinstance(t, np.ndarray):
        out = t.astype(dtype, copy=False)
        return out if shape is None else out.reshape(shape)
    out = t.detach().to("cpu", torch.float32).numpy().astype(dtype, copy=False)
    return out if shape is None else out.reshape(shape)


def token_coords(prefix: list[str], grid: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kind, patch row and patch column of every token: the prefix tokens first, then the patches in raster
    order (row -1 and column -1 for prefix tokens).

    Example:
        >>> kinds, rows, cols = token_coords(["cls"], (2, 2))
        >>> kinds.tolist(), rows.tolist(), cols.tolist()
        (['cls', 'patch', 'patch', 'patch', 'patch'], [-1, 0, 0, 1, 1], [-1, 0, 1, 0, 1])
    """
    gh, gw = grid
    n_prefix = len(prefix)
    kinds = np.array(prefix + ["patch"] * (gh * gw))
    rows = np.concatenate([np.full(n_prefix, -1), np.repeat(np.arange(gh), gw)]).astype(np.int64)
    cols = np.concatenate([np.full(n_prefix, -1), np.tile(np.arange(gw), gh)]).astype(np.int64)
    return kinds, rows, cols


def assemble(plan: TracePlan, prepared: PreparedInput, image: ImagePass, run: PassResult, *,
             layer_ids: list[int] | None = None, site_ids: list[str] | None = None,
             grid: tuple[int, int] | None = None) -> xr.Dataset:
    """The single-image trace Dataset of ``image`` (by default every layer and site of the plan on the pass's
    grid; a hierarchical trace assembles one stage at a time with its own layers, sites and grid).

    Tensors are popped from ``image`` as they are copied into the stored arrays.

    Example:
        >>> import timm, numpy as np
        >>> from vitcam_nb.capture.passes import run_pass
        >>> from vitcam_nb.preprocess import prepare_input
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> plan = TracePlan.for_trace(m, "top1", sites=["F2"])
        >>> prepared = prepare_input(m, np.zeros((32, 32, 3), np.uint8))
        >>> run = run_pass(plan, prepared.tensor)
        >>> assemble(plan, prepared, run.image(0), run)["attn"].shape
        (2, 3, 17, 17)
    """
    model, adapter, target = plan.model, plan.adapter, plan.target
    layer_ids = plan.layer_ids if layer_ids is None else layer_ids
    site_ids = plan.site_ids if site_ids is None else site_ids
    full_grid = run.grid if grid is None else grid
    gt = int(full_grid[0]) if len(full_grid) == 3 else 0  # a video trace's frames or tubelets (0: one image)
    gh, gw = full_grid[-2:]
    store_dtype = plan.store_dtype
    acts, grads, classes = image.acts, image.grads, image.classes
    prefix = adapter.prefix_kinds(model)
    n_prefix = len(prefix)
    n_tokens = n_prefix + max(gt, 1) * gh * gw
    kinds, rows, cols = token_coords(prefix, (gh, gw)) if not gt else token_coords(prefix, (gt * gh, gw))
    frames = frame_coords(n_prefix, (gt, gh, gw)) if gt else None
    if gt:  # the patches are in (t, y, x) raster order: rows restart in every frame
        rows[n_prefix:] %= gh
    n_targets = len(classes) + 1
    extra = plan.extra_layers
    token_sites = [s for s in site_ids if s not in (ATTENTION_SITE, SCORES_SITE) and s not in extra]
    labels = plan.class_labels or target.class_labels(model, int(image.logits.shape[0]))

    data_vars = {}
    coords = {
        "layer": ("layer", np.array(layer_ids, np.int64)),
        "token": ("token", np.arange(n_tokens, dtype=np.int64)),
        "token_kind": ("token", kinds),
        "patch_row": ("token", rows),
        "patch_col": ("token", cols),
        **({"patch_frame": ("token", frames)} if gt else {}),
        "target": ("target", np.array([target_name(c) for c in classes] + [EXPECTED_TARGET])),
        "target_class": ("target", np.array(classes + [-1], np.int64)),
        "target_label": ("target", np.array([labels[c] for c in classes] + [EXPECTED_LABEL])),
        "class": ("class", np.arange(len(labels), dtype=np.int64)),
        "class_label": ("class", np.array(labels)),
    }
    if token_sites:
        filled = (tuple(layer_ids), tuple(token_sites))
        act, grad = image.filled.get((*filled, "act")), image.filled.get((*filled, "grad"))
        sample = act[0, 0] if act is not None else acts[(layer_ids[0], token_sites[0])]
        if sample.shape[-2] != n_tokens:
            raise TraceError(f"model: {sample.shape[-2]} tokens at the blocks but the patch grid {gh}x{gw} "
                             f"with {n_prefix} prefix tokens gives {n_tokens}")
        n_channels = int(sample.shape[-1])
        if act is None:  # the pass kept tensors: copied here, each freed as it is copied
            act = np.empty((len(layer_ids), len(token_sites), n_tokens, n_channels), store_dtype)
            grad = np.empty((n_targets, len(layer_ids), len(token_sites), n_tokens, n_channels), store_dtype)
            for li, layer in enumerate(layer_ids):
                for si, site in enumerate(token_sites):
                    act[li, si] = to_numpy(acts.pop((layer, site)), (n_tokens, n_channels), store_dtype)
                    grad[:, li, si] = to_numpy(grads.pop((layer, site)), (n_targets, n_tokens, n_channels),
                                               store_dtype)
                release_freed_memory()  # the popped tensors' pages leave as the Dataset's fill: one copy at a time
        coords["site"] = ("site", np.array(token_sites))
        coords["channel"] = ("channel", np.arange(n_channels, dtype=np.int64))
        data_vars["act"] = (("layer", "site", "token", "channel"), act)
        data_vars["grad"] = (("target", "layer", "site", "token", "channel"), grad)
    # F2 and the pre-softmax scores are both (head, query, key) matrices per layer, stored the same way.
    for site, name in ((ATTENTION_SITE, "attn"), (SCORES_SITE, "attn_scores")):
        if site not in site_ids:
            continue
        attn = image.filled.get((tuple(layer_ids), (site,), "act"))
        attn_grad = image.filled.get((tuple(layer_ids), (site,), "grad"))
        if attn is not None:
            n_heads = int(attn.shape[1])
            shape = (n_heads, n_tokens, n_tokens)
        else:
            heads = {layer: int(acts[(layer, site)].shape[1]) for layer in layer_ids}
            if len(set(heads.values())) > 1:  # single_head_attention on some of the traced blocks only
                raise TraceError(f"sites: {site} has {heads} heads per block; one trace stores one head count, so "
                                 f"trace {site} at the blocks run as one head "
                                 "(vitcam_nb.adapters.single_head_attention) separately from the others (layers=[...])")
            n_heads = heads[layer_ids[0]]
            shape = (n_heads, n_tokens, n_tokens)
            attn = np.empty((len(layer_ids), *shape), store_dtype)
            attn_grad = np.empty((n_targets, len(layer_ids), *shape), store_dtype)
            for li, layer in enumerate(layer_ids):
                attn[li] = to_numpy(acts.pop((layer, site)), shape, store_dtype)
                attn_grad[:, li] = to_numpy(grads.pop((layer, site)), (n_targets, *shape), store_dtype)
                release_freed_memory()
        coords["head"] = ("head", np.arange(n_heads, dtype=np.int64))
        for axis in ("query", "key"):
            coords[axis] = (axis, np.arange(n_tokens, dtype=np.int64))
            coords[f"{axis}_kind"] = (axis, kinds)
            coords[f"{axis}_patch_row"] = (axis, rows)
            coords[f"{axis}_patch_col"] = (axis, cols)
            if gt:
                coords[f"{axis}_patch_frame"] = (axis, frames)
        data_vars[name] = (("layer", "head", "query", "key"), attn)
        data_vars[f"{name}_grad"] = (("target", "layer", "head", "query", "key"), attn_grad)
        for extra_name, got in image.extra_grads.items():  # a rule's extra gradients of this site (attn_plain_grad)
            if all((layer, site) in got for layer in layer_ids):
                data_vars[extra_name] = (("target", "layer", "head", "query", "key"), np.stack(
                    [to_numpy(got.pop((layer, site)), (n_targets, *shape), store_dtype) for layer in layer_ids], 1))
    for site in [s for s in site_ids if s in extra]:
        n = extra[site]
        site_acts = [to_numpy(acts.pop((i, site)), None, store_dtype) for i in range(n)]
        site_grads = [to_numpy(grads.pop((i, site)), None, store_dtype) for i in range(n)]
        more_vars, more_coords = adapter.assemble_extra(model, site, site_acts, site_grads, target)
        data_vars.update(more_vars)
        coords.update(more_coords)
    data_vars["logits"] = (("class",), image.logits.to("cpu", torch.float32).numpy().copy())
    h, w = prepared.display.shape[-3:-1]
    # A clip keeps the schema's ``image`` free: its frames are the variable ``clip``.
    data_vars["clip" if gt else "image"] = (("frame", "y", "x", "rgb") if gt else ("y", "x", "rgb"), prepared.display)
    if gt:
        coords["frame"] = ("frame", np.arange(prepared.display.shape[0], dtype=np.int64))
    coords["y"] = ("y", np.arange(h, dtype=np.int64))
    coords["x"] = ("x", np.arange(w, dtype=np.int64))
    coords["rgb"] = ("rgb", np.array(["r", "g", "b"]))
    attrs = _attrs(plan, prepared, classes, layer_ids, site_ids, (gh, gw), run, (h, w))
    if gt:
        attrs.update(grid_t=gt, clip_frames=int(prepared.display.shape[0]))
    return dataset(data_vars, coords, attrs)


def _attrs(plan: TracePlan, prepared: PreparedInput, classes: list[int], layer_ids: list[int], site_ids: list[str],
           grid: tuple[int, int], run: PassResult, size: tuple[int, int]) -> dict:
    import timm  # imported when a trace is assembled, not at ``import vitcam_nb`` (timm is slow to import)

    model, adapter, target = plan.model, plan.adapter, plan.target
    name, tag = model_name(model)
    w_hash, origin = weights_facts(model)
    in_hash = array_sha256(prepared.tensor)
    settings = {"weights": w_hash, "input": in_hash, "classes": classes, "layers": layer_ids,
                "sites": site_ids, "dtype": plan.dtype, "schema": SCHEMA_VERSION}
    if not isinstance(target, ClassTargets):  # class-target trace ids stay what they were before other targets
        settings["target"] = target.settings()
    if run.single_head:  # only then: every other trace id stays what it was
        settings["single_head"] = list(run.single_head)
    if plan.rule != DEFAULT_RULE:  # likewise: a plain gradient trace keeps its id and attributes
        settings["backward_rule"] = plan.rule
    h, w = size
    attrs = {
        "schema_version": SCHEMA_VERSION,
        "trace_id": settings_id(settings),
        "model_name": name,
        "model_family": adapter.family,
        # A config's tag names the weights the architecture was published with; untrained weights are not those.
        "pretrained_tag": "" if origin == "random-init" else tag,
        "weights_origin": origin,
        "weights_sha256": w_hash,
        "input_sha256": in_hash,
        "img_size": f"{h}x{w}",
        "img_height": int(h),
        "img_width": int(w),
        "grid_h": int(grid[0]),
        "grid_w": int(grid[1]),
        "num_prefix_tokens": len(adapter.prefix_kinds(model)),
        "num_layers": len(adapter.blocks(model)),
        "fused_attn": 0,
        "preprocessing": preprocessing_json(prepared.preprocessing),
        "vitcam_nb_version": __version__,
        "torch_version": str(torch.__version__),
        "timm_version": timm.__version__,
        "numpy_version": np.__version__,
        "xarray_version": xr.__version__,
        "device": str(plan.run_device),
        "torch_threads": int(torch.get_num_threads()),
        "dtype": plan.dtype,
        "compute_dtype": str(plan.compute_dtype).replace("torch.", ""),
        # the mode fit_budget chose: not part of the trace id (every mode stores the same values, to float32 rounding)
        "memory_mode": memory_mode(plan.recompute, plan.target_groups),
        "deterministic": run.deterministic,
        "deterministic_settings": run.deterministic_settings,
        **target.attrs(),
        **adapter.describe(model),
    }
    if run.single_head:
        attrs["single_head_attention"] = ",".join(str(b) for b in run.single_head)
    if plan.rule != DEFAULT_RULE:
        attrs["backward_rule"] = plan.rule
    if plan.wrappers:
        attrs["model_wrapper"] = (f"looked through {' then '.join(plan.wrappers)}; the model inside was traced "
                                  "(the wrapper was not called)")
    table = adapter.site_table(model)
    optional = [s for s in table if s in OPTIONAL_SITES]
    # 0.1 wrote this list before the optional sites existed; they are listed on their own, so it reads the same.
    attrs["model_sites"] = ",".join([*(s for s in table if s not in optional), *plan.extra_layers])
    if optional:
        attrs["model_optional_sites"] = ",".join(optional)
    for site in site_ids:
        if site in table:
            attrs[f"hook_{site}"] = table[site].hook(adapter.block_template)
    return attrs
