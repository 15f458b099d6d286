"""A pass whose targets' backward pass runs in groups (``TracePlan.target_groups``, with each block recomputed in the
backward pass): one group's transients are alive at a time, so the peak comes nearer the Dataset. What it stores equals
what one batched backward stores to float32 rounding (``vitcam_testing.ROUNDING_REL``: the groups' matrix products have
other batch shapes, which round otherwise on some CPUs; groups of one target, which take the head's matrix-vector
kernel, differ in the last bits here too, and stay within the same bound); targets no group reached are zeros, never
what the buffer held before; the budget takes the grouped mode when the estimate says the pass is far above its Dataset
and grouping lowers it, or when only then the trace fits; ``vc.estimate`` reports the mode."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import timm
import torch
import xarray as xr
from timm.models.beit import Beit
from timm.models.deit import VisionTransformerDistilled
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer
from vitcam_testing import ROUNDING_REL, assert_datasets_equal_to_rounding, assert_equal_to_rounding

import vitcam_nb as vc
import vitcam_nb.capture.passes as passes
import vitcam_nb.capture.prealloc as prealloc
from vitcam_nb.capture.assemble import assemble
from vitcam_nb.capture.budget import GROUPS_ABOVE, GROUPS_BELOW, RECOMPUTE_BELOW, estimate_plan, fit_budget
from vitcam_nb.capture.plan import TracePlan, group_bounds, paired_groups
from vitcam_nb.capture.staged import assemble_tree
from vitcam_nb.preprocess import prepare_input


def _init(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    for p in model.parameters():  # O(1) logits and attention, so that every target's gradient differs
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def _vit() -> torch.nn.Module:
    return _init(VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=8))


def _flat(family: str) -> torch.nn.Module:
    """A flat family other than the plain ViT: registers, distillation token, BEiT's relative position bias, EVA's
    rotary embedding (each adds inputs to its blocks the grouped backward must leave as they are)."""
    flat = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=8)
    if family == "vit_reg":
        return _init(VisionTransformer(**flat, reg_tokens=2, no_embed_class=True))
    if family == "deit_distilled":
        return _init(VisionTransformerDistilled(**flat))
    if family == "beit":
        return _init(Beit(**flat, use_rel_pos_bias=True, init_values=0.5))
    return _init(Eva(**flat, use_rot_pos_emb=True, scale_attn_inner=True, init_values=0.5))


def _swin() -> torch.nn.Module:
    return _init(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, embed_dim=16,
                                   depths=(2, 2), num_heads=(2, 4), num_classes=8))


def _image(size: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)


def _traced(plan: TracePlan, prepared, recompute: bool, groups: int) -> list[xr.Dataset]:
    plan = replace(plan, recompute=recompute, target_groups=groups)
    run = passes.run_pass(plan, prepared.tensor, arrays=True)
    if getattr(plan.adapter, "hierarchical", False):
        tree = assemble_tree(plan, prepared, run.image(0), run)
        return [node.to_dataset() for node in tree.subtree if node.data_vars]
    return [assemble(plan, prepared, run.image(0), run)]


def _assert_same(got: list[xr.Dataset], want: list[xr.Dataset]) -> None:
    # Not bitwise: the groups' backward calls multiply matrices of other batch shapes than the batched backward's,
    # and which kernel (summing in which order) a shape takes differs between CPUs (issue 51: an AVX-512 EPYC).
    assert_datasets_equal_to_rounding(got, want)


def test_the_groups_hold_two_or_three_targets_each_and_are_as_few_as_their_largest_allows():
    for n in range(2, 60):
        groups = paired_groups(n)
        sizes = np.diff(group_bounds(n, groups))
        assert sizes.sum() == n and len(sizes) == groups
        assert set(sizes.tolist()) <= {2, 3} or (n < 4 and groups == 1)
        largest = 2 if n % 2 == 0 else 3  # an odd count holds a group of three however it is split into pairs
        assert sizes.max() == min(largest, n)
        if groups > 1:
            assert np.diff(group_bounds(n, groups - 1)).max() > largest  # one group fewer: a larger group
    assert group_bounds(6, 3).tolist() == [0, 2, 4, 6]
    assert np.diff(group_bounds(9, paired_groups(9))).tolist() == [3, 3, 3]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("family, targets", [("vit", "top3"), ("vit", "top5"), ("swin", "top5"), ("vit", "top8"),
                                             ("vit_reg", "top3"), ("deit_distilled", "top3"), ("beit", "top3"),
                                             ("eva", "top3")])
def test_a_grouped_trace_stores_what_one_batched_backward_stores_to_float32_rounding(family, targets, dtype):
    model = {"vit": _vit, "swin": _swin}.get(family, lambda: _flat(family))()
    size = 56 if family == "swin" else 32
    sites = ["F1", "F2", "F3", "F4", "F5", "F6"]
    plan = TracePlan.for_trace(model, targets, sites=sites, dtype=dtype)
    prepared = prepare_input(model, _image(size))
    want = _traced(plan, prepared, recompute=False, groups=1)
    k = int(targets[3:]) + 1
    got = _traced(plan, prepared, recompute=True, groups=paired_groups(k))
    assert paired_groups(k) > 1  # grouped for real
    _assert_same(got, want)
    grad = next(ds for ds in want if "grad" in ds)["grad"].values
    assert all(np.abs(grad[i] - grad[0]).max() > 0 for i in range(1, k))  # every group's rows are its own


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_backward_split_into_single_targets_in_reverse_order_equals_the_batched_backward_to_rounding(dtype):
    """The check that would have caught issue 51 on this machine: the same targets in reverse order, each in its own
    group (the head multiplies matrix by vector, not matrix by matrix), against one batched backward in the given
    order. Here this split differs in the last bits (float32, width 32: 2,373 of 29,376 gradient elements, by at
    most 6e-8 of the largest), so a bitwise assertion fails on it; the documented bound holds, at three widths."""
    for width, heads, classes in ((32, 2, 8), (64, 4, 16), (192, 3, 40)):
        model = _init(VisionTransformer(img_size=32, patch_size=8, embed_dim=width, depth=3, num_heads=heads,
                                        num_classes=classes))
        prepared = prepare_input(model, _image(32))
        sites = ["F1", "F2", "F6"]
        (want,) = _traced(TracePlan.for_trace(model, list(range(classes)), sites=sites, dtype=dtype), prepared,
                          recompute=False, groups=1)
        plan = TracePlan.for_trace(model, list(range(classes))[::-1], sites=sites, dtype=dtype)
        (got,) = _traced(plan, prepared, recompute=True, groups=classes + 1)  # every target (and the expected one)
        assert np.diff(group_bounds(classes + 1, classes + 1)).max() == 1  # alone in its group
        assert got["target"].values.tolist() != want["target"].values.tolist()  # another order for real
        for name in ("grad", "attn_grad"):
            assert_equal_to_rounding(got[name].sel(target=want["target"]).values, want[name].values,
                                     f"width {width} {name}")
        np.testing.assert_array_equal(got["act"].values, want["act"].values)  # the same forward pass: bitwise


def test_the_rounding_bound_is_not_vacuous():
    """The bound of the tests above refuses what is more than rounding: one element off by twice what it allows."""
    grad = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)
    allowed = ROUNDING_REL * (np.abs(grad) + np.abs(grad).max())
    assert_equal_to_rounding(grad + (0.9 * allowed).astype(np.float32), grad, "within")
    off = grad.copy()
    off[2, 7] += 2 * allowed[2, 7]
    with pytest.raises(AssertionError, match="1 of 200 elements differ by more than float32 rounding"):
        assert_equal_to_rounding(off, grad, "off")
    half = grad.astype(np.float16)
    assert_equal_to_rounding(np.nextafter(half, np.float16(np.inf)), half, "one float16 step")
    with pytest.raises(AssertionError):
        assert_equal_to_rounding(half + np.float16(0.01), half, "ten float16 steps")


def test_groups_without_readable_batched_hooks_store_the_same(monkeypatch):
    model = _vit()
    plan = TracePlan.for_trace(model, "top5", sites=["F1", "F2", "F6"])
    prepared = prepare_input(model, _image(32))
    want = _traced(plan, prepared, recompute=False, groups=1)
    monkeypatch.setattr(passes, "batched_hooks_work", lambda: False)  # autograd returns every gradient per group
    _assert_same(_traced(plan, prepared, recompute=True, groups=3), want)


def test_targets_no_group_reached_are_zeros_not_what_the_buffer_held(monkeypatch):
    # A fresh buffer may hold anything (the pool of capture.buffers hands back old traces' arrays): NaN here.
    monkeypatch.setattr(prealloc, "reusable_empty", lambda shape, dtype: np.full(shape, np.nan, dtype))
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
    plan = TracePlan.for_trace(model, "top3", sites=["F1"])
    arrays = prealloc.Arrays(plan, 1, lambda k, t: t, hooks=False)
    arrays.keep((0, "F1"), torch.ones(1, 17, 192))
    arrays.begin_backward(4)
    arrays.backward_targets(1, 3)  # only the middle group's gradients ever arrive
    arrays.put_grad((0, "F1"), torch.full((2, 1, 17, 192), 7.0))
    arrays.finish_backward()
    (grad,) = [a for key, a in arrays.filled[0].items() if key[-1] == "grad"]
    assert grad.shape[0] == 4
    np.testing.assert_array_equal(grad[1:3], 7.0)
    np.testing.assert_array_equal(grad[[0, 3]], 0.0)


def _peaks(plan: TracePlan, hw: tuple[int, int]) -> dict[tuple[bool, int], int]:
    return {(r, g): estimate_plan(replace(plan, recompute=r, target_groups=g), hw)["peak_bytes"]
            for r, g in ((False, 1), (True, 1), (True, paired_groups(6)))}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_budget_groups_the_targets_when_the_estimate_is_far_above_the_dataset(dtype):
    model = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
    plan = TracePlan.for_trace(model, "top5", dtype=dtype)
    peaks, dataset = _peaks(plan, (224, 224)), estimate_plan(plan, (224, 224))["dataset_bytes"]
    fit_budget(plan, (224, 224), None)
    # the rule, from the estimate's own numbers: recompute only if it pays; then group if still far above the
    # Dataset and the Dataset is most of the peak (or grouping pays by the estimate alone)
    mode = (True, 1) if peaks[(True, 1)] <= RECOMPUTE_BELOW * peaks[(False, 1)] else (False, 1)
    if peaks[mode] > GROUPS_ABOVE * dataset and (2 * dataset >= peaks[mode]
                                                 or peaks[(True, 3)] <= GROUPS_BELOW * peaks[mode]):
        mode = (True, 3)
    assert (plan.recompute, plan.target_groups) == mode
    # float32 keeps the plain pass (the fastest, 1.2x its Dataset); float16 storage halves the Dataset, not the
    # pass's transients, and groups its six targets in three
    assert mode == ((False, 1) if dtype == "float32" else (True, 3))
    e = vc.estimate(model, targets="top5", dtype=dtype)
    assert (e["recompute"], e["target_groups"]) == mode
    assert e["peak_bytes"] == peaks[mode]


def test_a_small_model_keeps_one_group():
    # its peak is mostly the pass's fixed allocations, far above its Dataset: grouping would cost time for nothing
    plan = TracePlan.for_trace(_vit(), "top5", sites=["F1", "F2", "F5"])
    peaks, dataset = _peaks(plan, (32, 32)), estimate_plan(plan, (32, 32))["dataset_bytes"]
    assert peaks[(False, 1)] > 2 * dataset and peaks[(True, 3)] > GROUPS_BELOW * peaks[(False, 1)]
    fit_budget(plan, (32, 32), None)
    assert plan.target_groups == 1


def test_a_trace_over_its_budget_groups_its_targets_when_only_then_it_fits():
    # 65 tokens: grouping lowers the estimate below both other passes', by less than the budget's policy asks for
    model = _init(VisionTransformer(img_size=32, patch_size=4, embed_dim=16, depth=3, num_heads=2, num_classes=8))
    args = dict(targets="top5", sites=["F1", "F5"])
    plan = TracePlan.for_trace(model, "top5", sites=args["sites"])
    peaks = _peaks(plan, (32, 32))
    assert peaks[(True, 3)] < min(peaks[(False, 1)], peaks[(True, 1)])
    budget = (peaks[(True, 3)] + min(peaks[(False, 1)], peaks[(True, 1)])) // 2
    fit_budget(plan, (32, 32), budget)
    assert (plan.recompute, plan.target_groups) == (True, 3)
    fit_budget(plan, (32, 32), 10**12)  # everything fits: grouping lowers the estimate too little to be chosen
    assert peaks[(True, 3)] > GROUPS_BELOW * peaks[(False, 1)]
    assert (plan.recompute, plan.target_groups) == (False, 1)
    image = _image(32)
    _assert_same([vc.trace(model, image, max_bytes=budget, **args)], [vc.trace(model, image, **args)])
