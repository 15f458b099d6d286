"""The torch backend of :func:`vitcam_nb.map_many`: each batch's maps computed by
:func:`vitcam_nb.compute.torch_maps.cam_tensors` on the pass's device, straight from the pass's tensors (all images
of the batch at once, no per-image trace Dataset), and stored as the NumPy backend stores them (within float32
rounding: 1e-5 of each map's scale, the same degenerate flags).

Only the first image of each batch is assembled into a trace: its attributes and token layout are the batch's,
and its trace id checks the one the other images' ids are computed by (:func:`_facts`); should they ever differ,
every image of the batch is assembled for its facts instead.

Example:
    >>> torch_refusals([Recipe(), Recipe(weighting="agcam")])  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    RecipeError: recipes_or_space: backend='torch' cannot compute 1 of 2 recipes ...
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import xarray as xr

from vitcam_nb.capture.assemble import assemble
from vitcam_nb.capture.passes import PassResult, run_pass
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.compute.map_recipes import Entry, empty_image, store_entry
from vitcam_nb.compute.map_writer import batch_arrays
from vitcam_nb.compute.pipeline import CONSTANT_REASON, RELU_REASON, zero_gradient_reason
from vitcam_nb.compute.torch_maps import CONSTANT, NOTHING_LEFT, ZERO_GRADIENT, cam_tensors, torch_refusal
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.errors import RecipeError, TraceError
from vitcam_nb.core.provenance import array_sha256, settings_id
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.rules import DEFAULT_RULE
from vitcam_nb.core.schema import ATTENTION_SITE, PER_IMAGE_ATTRS, SCHEMA_VERSION
from vitcam_nb.preprocess import PreparedInput, preprocessing_json
from vitcam_nb.targets.classes import ClassTargets

__all__ = ["BACKENDS", "compute_batch_torch", "torch_refusals"]

BACKENDS = ("numpy", "torch")


def torch_refusals(recipes: list[Recipe]) -> None:
    """Refuse, naming each, the recipes the torch backend cannot compute (before any model call).

    Example:
        >>> torch_refusals([Recipe(), Recipe(site="F4")])
    """
    bad = [(r, why) for r in recipes if (why := torch_refusal(r))]
    if bad:
        shown = "; ".join(f"{r.to_string()} ({why})" for r, why in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise RecipeError(f"recipes_or_space: backend='torch' cannot compute {len(bad)} of {len(recipes)} recipes: "
                          f"{shown}; use backend='numpy' for them")


def _torch_dtype(dtype: Any) -> torch.dtype:
    return torch.float16 if np.dtype(dtype) == np.float16 else torch.float32


def _site_tensors(plan: TracePlan, run: PassResult, site: str, n_tokens: int) -> dict[str, torch.Tensor]:
    """One site's tensors of the whole batch in :func:`cam_tensors`'s layout, rounded to the storage dtype as a
    trace stores them (a float32 copy of the pass's tensor, then the storage dtype)."""
    store = _torch_dtype(plan.store_dtype)
    batch = int(run.logits.shape[0])

    def kept(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(torch.float32).to(store)

    classes = torch.tensor([c + [-1] for c in run.classes], dtype=torch.int64, device=run.logits.device)
    out = {"logits": run.logits.detach().to(torch.float32), "target_class": classes}
    layers = plan.layer_ids
    if site == ATTENTION_SITE:
        out["attn"] = torch.stack([kept(run.acts[(li, site)]) for li in layers], 1)
        out["attn_grad"] = torch.stack([kept(run.grads[(li, site)]) for li in layers], 2).transpose(0, 1)
        return out
    out["act"] = torch.stack([kept(run.acts[(li, site)]).reshape(batch, n_tokens, -1) for li in layers], 1)
    grads = [kept(run.grads[(li, site)]) for li in layers]
    out["grad"] = torch.stack([g.reshape(g.shape[0], batch, n_tokens, -1) for g in grads], 2).transpose(0, 1)
    return out


def _reason(code: int, recipe: Recipe, logits: np.ndarray) -> str:
    """A layer's verdict as the text ``pipeline.finish_layers`` gives it ("" when the map is fine)."""
    if code == ZERO_GRADIENT:
        return str(zero_gradient_reason(recipe, logits))
    return {CONSTANT: CONSTANT_REASON, NOTHING_LEFT: RELU_REASON}.get(code, "")


def _entry_parts(e: Entry, tensors: dict[str, torch.Tensor], layout: TraceView
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """An entry's per-layer maps for the batch (image, layer, gy, gx), their codes (image, layer), the largest
    scale per image, and the logits: the fused recipe's layers one call each, as the NumPy backend stores them."""
    r = e.recipe
    singles = [r] if e.part is None else [r.replace(layer=int(li)) for li in e.layers]
    got = [cam_tensors(one, tensors, layout) for one in singles]
    parts = torch.stack([g.values for g in got], 1).cpu().numpy()
    codes = torch.cat([g.codes[:, :1] for g in got], 1).cpu().numpy()
    scale = torch.stack([g.scale for g in got], 1).amax(dim=1).cpu().numpy()
    return parts, codes, scale, got[0].logits


def _facts(plan: TracePlan, first: xr.Dataset, prepared: PreparedInput, run: PassResult, b: int) -> dict:
    """Image ``b``'s per-image trace attributes as :func:`vitcam_nb.capture.assemble.assemble` writes them
    (``PER_IMAGE_ATTRS``), with the trace id of its settings (weights, input, classes, layers, sites, dtype)."""
    settings = {"weights": first.attrs["weights_sha256"], "input": array_sha256(prepared.tensor),
                "classes": list(run.classes[b]), "layers": plan.layer_ids, "sites": plan.site_ids,
                "dtype": plan.dtype, "schema": SCHEMA_VERSION}
    if not isinstance(plan.target, ClassTargets):
        settings["target"] = plan.target.settings()
    if run.single_head:
        settings["single_head"] = list(run.single_head)
    if plan.rule != DEFAULT_RULE:
        settings["backward_rule"] = plan.rule
    return {"trace_id": settings_id(settings), "input_sha256": settings["input"],
            "preprocessing": preprocessing_json(prepared.preprocessing), "device": str(plan.run_device),
            "deterministic": run.deterministic}


def _meta(facts: dict, classes: list[int], labels: np.ndarray, expected: str, logits: np.ndarray) -> dict:
    return {"trace_id": str(facts["trace_id"]), "input_sha256": str(facts["input_sha256"]),
            "provenance": json.dumps({k: facts[k] for k in PER_IMAGE_ATTRS if k in facts}, sort_keys=True,
                                     default=str),
            "target_class": np.array(classes + [-1], np.int64),
            "target_label": np.array([str(labels[c]) for c in classes] + [expected], object), "logits": logits}


def compute_batch_torch(plan: TracePlan, entries: list[Entry], n_parts: int, prepared: list[PreparedInput]
                        ) -> tuple[dict[str, np.ndarray], dict, np.ndarray]:
    """:func:`vitcam_nb.compute.map_recipes.compute_batch` with the maps computed by the torch kernels on the
    pass's device for the whole batch at once: the batch's arrays, the first image's trace attributes and its
    token kinds.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> from vitcam_nb.compute.map_many import store_plan
        >>> from vitcam_nb.preprocess import prepare_input
        >>> plan, entries, n_parts = store_plan(m, [Recipe(layer=0)], "top1", "float32", None, None)
        >>> one = [prepare_input(m, np.zeros((32, 32, 3)))]
        >>> arrays, attrs, kinds = compute_batch_torch(plan, entries, n_parts, one)
        >>> arrays["maps"].shape, kinds.tolist()[:2]
        ((1, 1, 4, 4), ['cls', 'patch'])
    """
    shapes = {tuple(p.tensor.shape) for p in prepared}
    if len(shapes) > 1:
        raise TraceError(f"images: a map store holds images of one input size; this batch has {sorted(shapes)}")
    run = run_pass(plan, torch.cat([p.tensor for p in prepared]))
    first = assemble(plan, prepared[0], run.image(0), run)
    layout = TraceView.of(first)
    labels, expected = first["class_label"].values, str(first["target_label"].values[-1])
    facts = [_facts(plan, first, p, run, b) for b, p in enumerate(prepared)]
    if any(facts[0][k] != first.attrs.get(k) for k in PER_IMAGE_ATTRS if k in first.attrs):
        # The ids are not those assemble gives (a pass this module does not know): every trace is assembled.
        facts = [first.attrs] + [assemble(plan, p, run.image(b), run).attrs for b, p in enumerate(prepared) if b]
    logits = run.logits.detach().to("cpu", torch.float32).numpy()
    per = [empty_image(entries, n_parts, (layout.gh, layout.gw)) for _ in prepared]
    for b, out in enumerate(per):
        out.update(_meta(facts[b], run.classes[b], labels, expected, logits[b].copy()))
    size, n_tokens = (layout.height, layout.width), int(layout.kinds.size)
    by_site: dict[str, list[int]] = {}
    for i, e in enumerate(entries):
        by_site.setdefault(ATTENTION_SITE if e.rollout else e.recipe.site, []).append(i)
    for site, members in by_site.items():  # one site's stacked copy of the batch at a time
        tensors = _site_tensors(plan, run, site, n_tokens)
        for i in members:
            e = entries[i]
            parts, codes, scale, lg = _entry_parts(e, tensors, layout)
            for b, out in enumerate(per):
                reasons = [_reason(int(c), e.recipe, lg[b]) for c in codes[b]]
                store_entry(out, i, e, parts[b], reasons, float(scale[b]), size, layout.pad)
        del tensors
    attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in first.attrs.items()
             if k not in PER_IMAGE_ATTRS}
    attrs["pad"] = json.dumps([int(v) for v in layout.pad])
    return batch_arrays(per), attrs, first["token_kind"].values
