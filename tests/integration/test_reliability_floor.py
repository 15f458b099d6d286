"""Issue #35 item 1, the trace at its autograd floor: the pass writes each captured variable into the Dataset's
own array (activations and gradients as the backward pass reaches them) instead of holding every tensor and
copying it at the end; trace() and trace_many() take it on the CPU and for storage narrower than the computation
(float16). What it stores is bitwise what the tensor pass (``run_pass(..., arrays=False)``) stores, for every
backward rule, both storage dtypes, a hierarchical model and a batch; and it hands freed memory back only after a
gradient write that finds the pass above its resident-memory cap, never during the forward pass or the assembly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb.capture import runtime
from vitcam_nb.capture.assemble import assemble
from vitcam_nb.capture.passes import run_pass
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.staged import assemble_tree
from vitcam_nb.core.rules import RULES
from vitcam_nb.preprocess import prepare_input

IMG = 32
ALL_SITES = ["F1", "F2", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid"]


def _model(seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    model = VisionTransformer(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    for p in model.parameters():  # O(1) logits and attention (timm's init is nearly uniform)
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def _image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (IMG, IMG, 3), dtype=np.uint8)


def _pass(plan: TracePlan, prepared, arrays: bool) -> xr.Dataset:
    run = run_pass(plan, prepared.tensor, arrays=arrays)
    return assemble(plan, prepared, run.image(0), run)


def _assert_same(got: xr.Dataset, want: xr.Dataset) -> None:
    assert sorted(got.data_vars) == sorted(want.data_vars)
    for name in want.data_vars:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name].values, want[name].values, err_msg=name)
    assert got.attrs["trace_id"] == want.attrs["trace_id"]


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_rule_stores_bitwise_what_the_tensor_pass_stores(rule, dtype):
    model, image = _model(), _image()
    sites = ["F1", "F2", "F6", "resid_pre"] if rule == "chefer_lrp" else ALL_SITES
    plan = TracePlan.for_trace(model, "top2", sites=sites, dtype=dtype, rule=rule)
    prepared = prepare_input(model, image)
    want = _pass(plan, prepared, arrays=False)
    got = _pass(plan, prepared, arrays=True)
    _assert_same(got, want)
    _assert_same(vc.trace(model, image, "top2", sites=sites, dtype=dtype, rule=rule), want)
    assert np.abs(got["grad"].values).max() > 0 and np.abs(got["attn_grad"].values).max() > 0
    if rule == "chefer_lrp":
        assert "attn_plain_grad" in got


def test_a_swin_trace_stores_bitwise_what_the_tensor_pass_stores():
    import timm

    torch.manual_seed(0)
    m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1), num_heads=(2, 4),
                          embed_dim=16, img_size=56, window_size=7, num_classes=5).eval()
    image = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    plan = TracePlan.for_trace(m, "top2", sites=["F1", "F2", "F3", "F6"], dtype="float16")
    prepared = prepare_input(m, image)
    run = run_pass(plan, prepared.tensor)
    want = assemble_tree(plan, prepared, run.image(0), run)
    got = vc.trace(m, image, "top2", sites=["F1", "F2", "F3", "F6"], dtype="float16")  # the array pass
    for node in ("stage_0", "stage_1"):
        for name in ("act", "grad", "attn_window", "attn_window_grad"):
            np.testing.assert_array_equal(got[node][name].values, want[node][name].values, err_msg=f"{node} {name}")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_batch_stores_for_each_image_what_its_tensor_pass_stores(dtype, tmp_path):
    model = _model()
    images = [_image(s) for s in range(3)]
    plan = TracePlan.for_store(model, "top2", sites=["F1", "F2", "F5"], dtype=dtype)
    prepared = [prepare_input(model, im) for im in images]
    x = torch.cat([p.tensor for p in prepared])
    old, new = run_pass(plan, x), run_pass(plan, x, arrays=True)
    want = [assemble(plan, p, old.image(b), old) for b, p in enumerate(prepared)]
    for b, p in enumerate(prepared):
        _assert_same(assemble(plan, p, new.image(b), new), want[b])
    # trace_many takes the array pass for float16: its store holds the same values
    ds = vc.open_traces(vc.trace_many(model, images, tmp_path / "s.zarr", targets="top2", sites=["F1", "F2", "F5"],
                                      dtype=dtype, batch_size=3, progress=False))
    for b in range(3):
        one = vc.image_trace(ds, b)
        for name in ("act", "grad", "attn", "attn_grad"):
            np.testing.assert_array_equal(one[name].values, want[b][name].values, err_msg=f"{name} {b}")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_cpu_trace_takes_the_array_pass_and_hands_memory_back_only_above_its_cap(dtype, monkeypatch):
    # the hooks path, which writes each key's gradients as autograd reaches it (a pass of 4 MiB or more): the
    # resident memory is checked after every key's write
    from vitcam_nb.capture import passes

    monkeypatch.setattr(passes, "HOOKS_FROM", 0)
    # The tensor pass handed freed memory back after every block of the forward pass, at every block of the
    # backward pass, after it, and at every layer of the assembly, and each reused page then faulted in again. On
    # the CPU the array pass hands it back only after a gradient write that finds the resident memory the pass
    # added above PEAK_OVER_ARRAYS times the arrays it fills (values and 3 gradients of 2 layers x 6 sites here).
    from vitcam_nb.capture import resident
    from vitcam_nb.capture import trace as trace_module

    calls, taken, reads = [], [], []
    monkeypatch.setattr(runtime, "_TRIM", lambda pad: calls.append(pad))
    monkeypatch.setattr(trace_module, "run_pass", lambda plan, x, arrays=False: taken.append(arrays) or run_pass(
        plan, x, arrays=arrays))
    monkeypatch.setattr(resident, "resident_bytes", lambda: 10**9)
    flat = vc.trace(_model(), _image(), "top2", dtype=dtype)
    assert taken == [True] and calls == []  # a resident memory that does not grow: never handed back
    arrays = sum(flat[v].nbytes for v in ("act", "grad", "attn", "attn_grad"))
    writes = flat.sizes["layer"] * (flat.sizes["site"] + 1)  # the token sites and F2
    assert writes == 12
    # Resident memory read as: the start, then just under the ceiling for the first six writes, then over it.
    ceiling = 10**9 + resident.PEAK_OVER_ARRAYS * arrays
    values = iter([10**9] + [int(ceiling)] * 6 + [int(ceiling) + 1] * 100)
    monkeypatch.setattr(resident, "resident_bytes", lambda: reads.append(1) or next(values))
    tr = vc.trace(_model(), _image(), "top2", dtype=dtype)
    assert len(reads) == 1 + writes and calls == [0] * (writes - 6)  # a read per write, a hand-back for each above
    _assert_same(tr, flat)


def test_a_small_cpu_trace_checks_its_resident_memory_after_each_group_it_writes(monkeypatch):
    # Under 4 MiB autograd returns the gradients and each whole group of sites goes in with one copy (the token
    # sites of 2 layers, then F2): the resident memory is checked after each group, and handed back when above
    from vitcam_nb.capture import resident

    calls, reads = [], []
    monkeypatch.setattr(runtime, "_TRIM", lambda pad: calls.append(pad))
    monkeypatch.setattr(resident, "resident_bytes", lambda: 10**9)
    flat = vc.trace(_model(), _image(), "top2")
    assert calls == []
    ceiling = 10**9 + resident.PEAK_OVER_ARRAYS * sum(flat[v].nbytes for v in ("act", "grad", "attn", "attn_grad"))
    values = iter([10**9, int(ceiling), int(ceiling) + 1])  # the start, under the ceiling, then over it
    monkeypatch.setattr(resident, "resident_bytes", lambda: reads.append(1) or next(values))
    tr = vc.trace(_model(), _image(), "top2")
    assert len(reads) == 1 + 2 and calls == [0]
    _assert_same(tr, flat)
