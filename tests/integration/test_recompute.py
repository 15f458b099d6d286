"""Recomputing each block inside the backward pass (``vitcam_nb.capture.recompute``): a trace whose Dataset is small
beside the model's graph keeps one block's graph at a time instead of every block's. What it stores equals what the
plain pass stores to float32 rounding (the array pass differentiates one target at a time, other batch shapes), for
every family that allows it, every site, both storage dtypes and a batch; the tensor pass (torch's checkpoint: the same
batched backward on the same shapes) returns bitwise the same tensors; the capture reads each site once; the pass
recomputes when the estimate says it lowers the peak by a quarter or more, or when only then the trace fits
``max_bytes``; and the model is returned exactly as it was."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
import xarray as xr
from timm.models.beit import Beit
from timm.models.deit import VisionTransformerDistilled
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer
from vitcam_testing import assert_datasets_equal_to_rounding, assert_equal_to_rounding, assert_unchanged, snapshot

import vitcam_nb as vc
from vitcam_nb.adapters import find_adapter
from vitcam_nb.capture.assemble import assemble
from vitcam_nb.capture.budget import GROUPS_BELOW, RECOMPUTE_BELOW, estimate_plan, fit_budget, recomputable
from vitcam_nb.capture.passes import run_pass
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.staged import assemble_tree
from vitcam_nb.core.errors import TraceError
from vitcam_nb.preprocess import prepare_input

IMG = 32


def _init(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    for p in model.parameters():  # O(1) logits and attention (timm's init is nearly uniform)
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def _family(name: str) -> torch.nn.Module:
    flat = dict(img_size=IMG, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5)
    if name == "vit":
        return _init(VisionTransformer(**flat))
    if name == "vit_reg":  # DINOv2's layout: registers, no class embedding in the positions
        return _init(VisionTransformer(**flat, reg_tokens=2, no_embed_class=True))
    if name == "deit_distilled":
        return _init(VisionTransformerDistilled(**flat))
    if name == "beit":
        return _init(Beit(**flat, use_rel_pos_bias=True, init_values=0.5))
    if name == "eva":
        return _init(Eva(**flat, use_rot_pos_emb=True, scale_attn_inner=True, init_values=0.5))
    return _init(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, embed_dim=16,
                                   depths=(2, 2), num_heads=(2, 4), num_classes=5))


def _image(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def _trace(plan: TracePlan, prepared, recompute: bool):
    plan.recompute = recompute
    run = run_pass(plan, prepared.tensor, arrays=True)
    if getattr(plan.adapter, "hierarchical", False):
        return assemble_tree(plan, prepared, run.image(0), run)
    return assemble(plan, prepared, run.image(0), run)


def _datasets(tr) -> list[xr.Dataset]:
    return [tr] if isinstance(tr, xr.Dataset) else [node.to_dataset() for node in tr.subtree if node.data_vars]


def _assert_same(got, want) -> None:
    # Not bitwise: the array pass recomputes block by block, one target at a time (capture.block_major), so its
    # matrix products have other batch shapes than the plain batched backward's; they round otherwise on some CPUs
    # (issue 51: an AVX-512 EPYC). Same dtypes, values to float32 rounding.
    assert_datasets_equal_to_rounding(_datasets(got), _datasets(want))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("family", ["vit", "vit_reg", "deit_distilled", "beit", "eva", "swin"])
def test_a_recomputed_trace_stores_what_the_plain_pass_stores_to_float32_rounding(family, dtype):
    model = _family(family)
    size = 56 if family == "swin" else IMG
    # every site the family has: the split qkv and the side-computed q_out, k_out and attn_scores included
    plan = TracePlan.for_trace(model, "top2", sites=list(find_adapter(model).site_table(model)), dtype=dtype)
    assert recomputable(plan)
    prepared = prepare_input(model, _image(size))
    want = _trace(plan, prepared, recompute=False)
    before = snapshot(model)
    got = _trace(plan, prepared, recompute=True)
    _assert_same(got, want)
    assert_unchanged(before, model)  # the blocks' own forward methods are back, nothing else changed
    assert all("forward" not in vars(b) for b in plan.adapter.blocks(model))


def test_a_recomputed_batch_stores_what_the_plain_batch_stores_to_float32_rounding():
    model = _family("vit")
    plan = TracePlan.for_trace(model, "top2", sites=["F1", "F2", "F5"], layers=[1, 2])
    x = torch.cat([prepare_input(model, _image(IMG, seed)).tensor for seed in (1, 2)])
    plain = run_pass(plan, x, arrays=True)
    plan.recompute = True
    lean = run_pass(plan, x, arrays=True)
    assert lean.classes == plain.classes
    for b in range(2):
        assert plain.image(b).filled.keys() == lean.image(b).filled.keys()
        for key, arr in plain.image(b).filled.items():
            assert_equal_to_rounding(lean.image(b).filled[key], arr, str(key))  # one target at a time: rounding


def test_the_tensor_pass_recomputes_too_and_returns_bitwise_the_same_tensors():
    """map_many runs the tensor pass (its maps are computed from the pass's tensors) under the same budget. Bitwise
    is structural here: torch's checkpoint reruns each block's forward on the same input and the backward is the
    same batched call over the same shapes, so the same kernels run on the same values."""
    model = _family("vit")
    plan = TracePlan.for_trace(model, "top2", sites=["F1", "F2", "F4"], layers=[1, 2])
    x = prepare_input(model, _image(IMG)).tensor
    plain = run_pass(plan, x)
    plan.recompute = True
    lean = run_pass(plan, x)
    assert plain.acts.keys() == lean.acts.keys() == plain.grads.keys() == lean.grads.keys()
    for key in plain.acts:
        assert torch.equal(lean.acts[key], plain.acts[key]), key
        assert torch.equal(lean.grads[key], plain.grads[key]), key


def test_the_capture_reads_each_site_once_while_the_blocks_run_again():
    model = _family("vit")
    plan = TracePlan.for_trace(model, "top1", sites=["F1", "F2", "F3"], layers=[0, 2])
    prepared = prepare_input(model, _image(IMG))
    calls = []
    handle = model.blocks[2].attn.register_forward_hook(lambda *_: calls.append(1))
    try:
        _trace(plan, prepared, recompute=True)
        recomputed = len(calls)
        calls.clear()
        _trace(plan, prepared, recompute=False)
    finally:
        handle.remove()
    assert (recomputed, len(calls)) == (2, 1)  # the block ran again in the backward pass; no site fired twice


def test_the_pass_recomputes_when_the_estimate_says_it_pays_and_the_trace_tells_the_estimate():
    model = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
    late = TracePlan.for_trace(model, "top5", sites=["F1"], layers=[-1])
    full = TracePlan.for_trace(model, "top5")
    peaks = {}
    for name, plan in (("late", late), ("full", full)):
        peaks[name] = [estimate_plan(TracePlan(**{**plan.__dict__, "recompute": r, "target_groups": g}),
                                     (224, 224))["peak_bytes"] for r, g in ((False, 1), (True, 1), (True, 3))]
        fit_budget(plan, (224, 224), None)
    plain, lean, grouped = peaks["late"]
    # One late layer: only its block has a graph (capture.graph_start), and recomputing it pays because the targets
    # then go through it one at a time; the head in groups holds fewer targets' gradients at its output still.
    assert lean <= RECOMPUTE_BELOW * plain and grouped <= GROUPS_BELOW * lean
    assert (late.recompute, late.target_groups) == (True, 3)
    plain, lean, grouped = peaks["full"]
    assert lean > RECOMPUTE_BELOW * plain and not full.recompute
    fit_budget(late, (224, 224), None, recompute=False)  # map_many's pass keeps its tensors: it never recomputes
    assert not late.recompute
    fit_budget(late, (224, 224), None)
    e = vc.estimate(model, targets="top5", sites=["F1"], layers=[-1])
    assert e["recompute"] is True
    assert e["peak_bytes"] == estimate_plan(late, (224, 224))["peak_bytes"]
    # a backward rule's hooks are not run twice: its pass keeps the graph
    assert not recomputable(TracePlan.for_trace(model, "top5", sites=["F1"], layers=[-1], rule="cp_lrp"))


def test_a_trace_over_its_budget_recomputes_when_only_then_it_fits_and_is_refused_otherwise():
    model = _family("vit")
    plan = TracePlan.for_trace(model, "top2", sites=["F1", "F2"], layers=[0, 2])
    plain = estimate_plan(plan, (IMG, IMG))["peak_bytes"]
    lean = estimate_plan(TracePlan(**{**plan.__dict__, "recompute": True}), (IMG, IMG))["peak_bytes"]
    assert lean < plain
    fit_budget(plan, (IMG, IMG), (lean + plain) // 2)
    assert plan.recompute
    fit_budget(plan, (IMG, IMG), plain)  # the plain pass fits: only the estimate's gain decides
    assert plan.recompute == (lean <= RECOMPUTE_BELOW * plain)
    with pytest.raises(TraceError, match=r"max_bytes: this trace needs about"):
        fit_budget(plan, (IMG, IMG), lean - 1)
    # vc.trace takes the same way: under that budget it runs, and stores what an unlimited trace stores
    image = _image(IMG)
    _assert_same(vc.trace(model, image, targets="top2", sites=["F1", "F2"], layers=[0, 2],
                          max_bytes=(lean + plain) // 2),
                 vc.trace(model, image, targets="top2", sites=["F1", "F2"], layers=[0, 2]))


def test_a_trace_records_the_memory_mode_its_pass_took_without_changing_its_id():
    model = _family("vit")
    kw = dict(targets="top2", sites=["F1", "F2"], layers=[0, 2])
    plan = TracePlan.for_trace(model, "top2", sites=["F1", "F2"], layers=[0, 2])
    plain = estimate_plan(plan, (IMG, IMG))["peak_bytes"]
    lean = estimate_plan(TracePlan(**{**plan.__dict__, "recompute": True}), (IMG, IMG))["peak_bytes"]
    fit_budget(plan, (IMG, IMG), None)
    assert not plan.recompute  # unlimited, this trace takes the plain pass
    image = _image(IMG)
    free = vc.trace(model, image, **kw)
    forced = vc.trace(model, image, max_bytes=(lean + plain) // 2, **kw)  # only recomputing fits
    assert free.attrs["memory_mode"] == "plain" == vc.estimate(model, image, **kw)["memory_mode"]
    assert forced.attrs["memory_mode"] == "blocks recomputed, one target at a time"
    # the same values (to float32 rounding): the id (what was asked) and every other attribute stay the plain trace's
    assert {k for k in free.attrs if free.attrs[k] != forced.attrs[k]} == {"memory_mode"}
