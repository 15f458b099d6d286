"""The trace's cheaper per-call paths (issue 55's trace-cost row) store exactly what the established ones store:
a small pass whose gradients autograd returns (no tensor hooks) against the same pass written by the hooks, bitwise,
on a tiny LLaVA, a tiny Qwen2-VL and a timm ViT (plain and recomputing passes); the plan's extra-site counts against
the adapter's; and the remembered lookups (a VLM family per class, an adapter per call) give way to a table that
changed."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
import vitcam_nb.capture.passes as passes
from vitcam_nb.adapters import VitAdapter, find_adapter, register_adapter, unregister_adapter
from vitcam_nb.adapters.registry import lookup_scope
from vitcam_nb.capture.plan import TracePlan

transformers = pytest.importorskip("transformers")


def _same(a, b) -> None:
    """Two traces hold the same variables, coordinates and attributes (the trace id included), every array bitwise."""
    assert list(a.variables) == list(b.variables) and list(a.coords) == list(b.coords)
    assert a.attrs == b.attrs
    for name in a.variables:
        x, y = a[name].values, b[name].values
        assert x.dtype == y.dtype and x.shape == y.shape, name
        if x.dtype.kind in "fiub":
            assert x.tobytes() == y.tobytes(), name
        else:
            assert (x == y).all(), name
        assert a[name].attrs == b[name].attrs, name


def _hooks_and_returned(monkeypatch, model, x, **kwargs):
    """The trace with tensor hooks writing every gradient (the established array pass), then with autograd returning
    them (the small pass's path), as the pass chooses by :data:`~vitcam_nb.capture.prealloc.HOOKS_FROM`."""
    seen: list[bool] = []
    arrays = passes.Arrays

    def spy(*args, **kw):
        seen.append(kw["hooks"])
        return arrays(*args, **kw)

    monkeypatch.setattr(passes, "Arrays", spy)
    monkeypatch.setattr(passes, "HOOKS_FROM", 0)
    hooked = vc.trace(model, x, **kwargs)
    monkeypatch.setattr(passes, "HOOKS_FROM", 1 << 40)
    returned = vc.trace(model, x, **kwargs)
    assert seen == [True, False]  # each path ran once
    return hooked, returned


def test_llava_answer_trace_without_hooks_is_the_hooked_trace_bitwise(monkeypatch):
    from benchmarks.items.vlm_trace_cost import ANSWER, PROMPT, tiny_llava

    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)
    hooked, returned = _hooks_and_returned(monkeypatch, tiny_llava(), x, targets=target)
    _same(hooked, returned)
    assert {"lm_resid_grad", "lm_attn_grad", "projector_grad", "grad"} <= set(returned.data_vars)
    assert np.abs(returned["lm_resid_grad"].values).max() > 0  # gradients were written, not left at zero


def test_qwen2_vl_answer_trace_without_hooks_is_the_hooked_trace_bitwise(monkeypatch):
    from vlm_qwen_tiny import tiny_qwen

    model, pixel_values, target = tiny_qwen("qwen2")
    hooked, returned = _hooks_and_returned(monkeypatch, model, pixel_values, targets=target)
    _same(hooked, returned)


@pytest.mark.parametrize("layers", [None, [-1]])  # every block (plain pass); one late block (recomputing pass)
def test_vit_trace_without_hooks_is_the_hooked_trace_bitwise(monkeypatch, layers):
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3).eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    hooked, returned = _hooks_and_returned(monkeypatch, m, x, targets="top3", sites=["F1", "F2", "F6"], layers=layers)
    _same(hooked, returned)
    assert returned.attrs["memory_mode"] == ("plain" if layers is None else hooked.attrs["memory_mode"])


def test_the_plans_extra_site_counts_are_the_adapters():
    from benchmarks.items.vlm_trace_cost import ANSWER, PROMPT, tiny_llava

    m = tiny_llava()
    plan = TracePlan.for_trace(m, vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER))
    want = {name: len(where) for name, where in find_adapter(m).extra_sites(m).items()}
    assert plan.extra_counts == plan.extra_layers == want and want["lm_resid"] == 2
    # a plan made without the counts reads them from the adapter
    assert TracePlan(**{**plan.__dict__, "extra_counts": None}).extra_layers == want
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    assert TracePlan.for_trace(vit, 1).extra_layers == {} and TracePlan.for_trace(vit, 1).graph_start == 0


def test_a_replaced_vlm_family_row_is_found_again():
    from benchmarks.items.vlm_trace_cost import tiny_llava
    from vitcam_nb.adapters import hf_vlm

    m = tiny_llava()
    old = hf_vlm.vlm_family_of(m)
    assert hf_vlm.vlm_family_of(m) is old  # remembered
    # the table restored whole and in its order afterwards (monkeypatch's undo of a delitem would append the row
    # at the end, and the generated docs tables follow the table's order)
    saved = dict(hf_vlm.VLM_FAMILIES)
    try:
        hf_vlm.VLM_FAMILIES["llava"] = hf_vlm.VlmFamily(
            "llava", old.classes, old.tower, old.projector, old.lm_layers, old.layout, tower_prefix=())
        new = hf_vlm.vlm_family_of(m)
        assert new is hf_vlm.VLM_FAMILIES["llava"] and new.tower_prefix == () and old.tower_prefix == ("cls",)
        del hf_vlm.VLM_FAMILIES["llava"]  # no row reads the class: refused by name, never remembered
        with pytest.raises(vc.core.errors.ArgumentTypeError, match="not a generative VLM"):
            hf_vlm.vlm_family_of(m)
    finally:
        hf_vlm.VLM_FAMILIES.clear()
        hf_vlm.VLM_FAMILIES.update(saved)
    assert list(hf_vlm.VLM_FAMILIES) == list(saved) and hf_vlm.vlm_family_of(m) is old


def test_find_adapter_inside_a_scope_follows_the_table():
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    first = find_adapter(m)
    mine = VitAdapter()
    with lookup_scope():
        assert find_adapter(m) is first and find_adapter(m) is first
        register_adapter(mine)  # in front of every other: it reads the model from now on
        try:
            assert find_adapter(m) is mine
        finally:
            unregister_adapter(mine)
        assert find_adapter(m) is first
    with pytest.raises(TypeError):
        with lookup_scope():
            find_adapter(object())  # a refusal is never remembered


def test_scoped_answers_are_found_once_per_model_inside_a_scope_only():
    from vitcam_nb.adapters.registry import scoped

    calls: list[object] = []

    def path(model):
        calls.append(model)
        if model == "bad":
            raise TypeError("no layer list")
        return f"layers of {model}"

    owner = object()
    assert [scoped(owner, "a", "p", lambda: path("a")) for _ in range(2)] == ["layers of a"] * 2
    assert len(calls) == 2  # outside a scope: every call computes
    with lookup_scope():
        got = [scoped(owner, m, "p", lambda m=m: path(m)) for m in ("a", "b", "a", "b")]
        assert got == ["layers of a", "layers of b"] * 2 and calls[2:] == ["a", "b"]
        assert scoped(object(), "a", "p", lambda: path("a")) == "layers of a" and len(calls) == 5  # another owner
        for _ in range(2):
            with pytest.raises(TypeError):
                scoped(owner, "bad", "p", lambda: path("bad"))
        assert calls[5:] == ["bad", "bad"]  # a failure is never remembered
    assert scoped(owner, "a", "p", lambda: path("a")) == "layers of a" and len(calls) == 8  # the scope forgot


def test_a_hf_layer_list_path_is_found_once_per_trace(monkeypatch):
    from benchmarks.items.vlm_trace_cost import ANSWER, PROMPT, tiny_llava
    from vitcam_nb.adapters.hf import HfVitAdapter

    m = tiny_llava()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)
    want = vc.trace(m, x, targets=target, sites=["F1", "lm_resid"])
    calls: list[str] = []
    found = HfVitAdapter._blocks_path
    monkeypatch.setattr(HfVitAdapter, "_blocks_path", lambda self, model: calls.append(1) or found(self, model))
    got = vc.trace(m, x, targets=target, sites=["F1", "lm_resid"])
    assert len(calls) == 1
    _same(want, got)
    assert find_adapter(m).blocks_path(m) == "model.vision_tower.encoder.layers" and len(calls) == 2


def test_the_image_token_layout_is_found_once_per_trace_and_the_trace_is_the_same(monkeypatch):
    from benchmarks.items.vlm_trace_cost import ANSWER, PROMPT, tiny_llava
    from vitcam_nb.adapters import hf_vlm

    m = tiny_llava()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    asked, computed = [], []
    real = hf_vlm.scoped_layout

    def counted(compute):
        return lambda: computed.append(1) or compute()

    # every call computing it (the path before the scope)
    monkeypatch.setattr(hf_vlm, "scoped_layout", lambda owner, model, ids, extra, compute: (
        asked.append(1), counted(compute)())[1])
    want = vc.trace(m, x, targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER))
    assert len(asked) == len(computed) == 5  # the target's check, the memory estimate, three LM-side sites
    asked.clear(), computed.clear()
    monkeypatch.setattr(hf_vlm, "scoped_layout", lambda owner, model, ids, extra, compute: (
        asked.append(1), real(owner, model, ids, extra, counted(compute)))[1])
    got = vc.trace(m, x, targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER))
    assert len(asked) == 5 and len(computed) == 1
    _same(want, got)


def test_a_scoped_layout_is_keyed_on_the_sequence_and_arguments_content():
    from benchmarks.items.vlm_trace_cost import IMAGE_ID, PROMPT, tiny_llava
    from vitcam_nb.adapters.vlm_layout_scope import content_key

    m = tiny_llava()
    ad = find_adapter(m)
    ids = np.array(PROMPT)
    other = np.array([IMAGE_ID] * 16 + [1, 2])  # the image tokens first: other positions
    with lookup_scope():
        a, b, c = ad.layout(m, ids), ad.layout(m, other), ad.layout(m, ids.copy())
    assert a.positions.tolist() == list(range(3, 19)) and b.positions.tolist() == list(range(16))
    assert c is a  # equal content, the call's answer
    t = torch.tensor([[32, 32]])
    assert content_key({"s": t}) == content_key({"s": t.clone()}) != content_key({"s": torch.tensor([[32, 33]])})
    assert content_key({"s": t}) != content_key({"s": t.to(torch.int32)}) != content_key({"s": t.numpy()})
    assert content_key({"s": [1, 2]}) != content_key({"s": (1, 2)}) and content_key({"s": object()}) is None


def _torch_copy(dest, t) -> None:
    """The copy before numpy's path: torch's copy through float32 (the established one)."""
    torch.from_numpy(dest).copy_(t.detach().to("cpu", torch.float32).reshape(dest.shape))


def test_copy_into_float32_by_numpy_is_torchs_copy_bitwise():
    from vitcam_nb.capture.prealloc import copy_into

    base = torch.randn(5, 1, 17, 32, generator=torch.Generator().manual_seed(0), requires_grad=True) * 1
    odd = torch.tensor([float("nan"), -0.0, 1e-45, float("inf"), -3.5])
    for t in (base, base.transpose(2, 3), base[:, :, ::2], odd, torch._neg_view(odd), base.to(torch.float16)):
        for dtype in (np.float32, np.float16):
            got, want = np.empty(tuple(t.shape), dtype), np.empty(tuple(t.shape), dtype)
            copy_into(got, t)
            _torch_copy(want, t)
            assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_trace_copied_by_numpy_is_the_torch_copied_trace_bitwise(monkeypatch, dtype):
    import vitcam_nb.capture.prealloc as prealloc
    from benchmarks.items.vlm_trace_cost import ANSWER, PROMPT, tiny_llava

    m = tiny_llava()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)
    got = vc.trace(m, x, targets=target, dtype=dtype)
    monkeypatch.setattr(prealloc, "copy_into", _torch_copy)
    _same(vc.trace(m, x, targets=target, dtype=dtype), got)


def test_a_hf_layer_list_and_site_table_are_found_once_per_trace_and_the_trace_is_the_same(monkeypatch):
    from benchmarks.items.vlm_trace_cost import ANSWER, PROMPT, tiny_llava
    from vitcam_nb.adapters import hf

    m = tiny_llava()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)
    made: list[str] = []
    relative = hf.HfVitAdapter.relative_sites
    monkeypatch.setattr(hf.HfVitAdapter, "relative_sites", lambda self, path: made.append(path) or relative(self, path))
    got = vc.trace(m, x, targets=target)
    assert made.count("model.vision_tower.encoder.layers") == 1  # the site table built once for the call
    monkeypatch.setattr(hf, "scoped", lambda owner, model, name, compute: compute())  # each call its own answer
    _same(vc.trace(m, x, targets=target), got)
    assert made.count("model.vision_tower.encoder.layers") > 2
    ad = find_adapter(m)
    with lookup_scope():
        a, b = ad.site_table(m), ad.site_table(m)
        a.pop("F1")  # the caller's copy: the next caller's table is whole
        assert "F1" in b and "F1" in ad.site_table(m)
        blocks = ad.blocks(m)
        blocks.pop()
        assert len(ad.blocks(m)) == 3 and ad.blocks(m)[-1] is m.get_submodule("model.vision_tower.encoder.layers")[-1]
