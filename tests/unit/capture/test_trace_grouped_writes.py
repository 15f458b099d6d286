"""The trace's cheaper per-call paths of 0.3.0's last round (issue 55's trace-cost row) store exactly what the
established ones store: a whole group of sites written with one stacked copy against the same sites written key by
key, bitwise (a tiny LLaVA whose last tower layer gets no gradient, a timm ViT, float32 and float16 storage); the
module tree walked once per trace; the weights' hash and origin read with one walk of the state and recomputed after
an in-place write; the one-group bounds and the MemAvailable reading against their plain formulas."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from test_trace_fast_paths import _same  # this folder's: two traces equal bitwise, attributes and all

import vitcam_nb as vc
from vitcam_nb.capture import prealloc
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.core import module_walk
from vitcam_nb.core.provenance import untrained, weights_facts, weights_origin, weights_sha256

transformers = pytest.importorskip("transformers")


def _one_by_one(self, items):
    for key, g in items:
        self.put_grad(key, g)


def _grouped_and_one_by_one(monkeypatch, model, x, **kwargs):
    """The trace with the grouped writes, then with every key written by itself; and how many keys each wrote by
    itself."""
    single: list[tuple] = []
    put_grad = prealloc.Arrays.put_grad
    monkeypatch.setattr(prealloc.Arrays, "put_grad", lambda self, key, g: single.append(key) or put_grad(self, key, g))
    grouped = vc.trace(model, x, **kwargs)
    n_grouped = len(single)
    single.clear()
    monkeypatch.setattr(prealloc.Arrays, "put_grads", _one_by_one)
    return grouped, vc.trace(model, x, **kwargs), n_grouped, len(single)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_llava_trace_written_a_group_at_a_time_is_the_key_by_key_trace_bitwise(monkeypatch, dtype):
    from benchmarks.items.vlm_trace_cost import ANSWER, PROMPT, tiny_llava

    m = tiny_llava()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)
    grouped, single, n_grouped, n_single = _grouped_and_one_by_one(monkeypatch, m, x, targets=target, dtype=dtype)
    _same(grouped, single)
    # the tower's 3 layers x 6 sites went in as two groups, the LM's projector, lm_resid and lm_attn (5 keys) key by
    # key; one by one, the 12 tower keys with a gradient went in too (the other 6 are written when the pass ends)
    assert n_grouped == 5 and n_single == 17
    # the last tower layer is above vision_feature_layer=-2: no gradient reaches it, and its rows are zeros
    assert not grouped["grad"].isel(layer=-1).values.any() and grouped["grad"].isel(layer=0).values.any()
    assert not grouped["attn_grad"].isel(layer=-1).values.any()


@pytest.mark.parametrize("layers", [None, [1]])
def test_a_vit_trace_written_a_group_at_a_time_is_the_key_by_key_trace_bitwise(monkeypatch, layers):
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    grouped, single, n_grouped, _ = _grouped_and_one_by_one(monkeypatch, m, x, targets="top2",
                                                            sites=["F1", "F2", "F6"], layers=layers)
    _same(grouped, single)
    assert n_grouped == 0


def test_a_group_whose_shapes_differ_is_written_key_by_key():
    # two layers of different widths: the group cannot be stacked, so each key goes where put_grad puts it
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    plan = TracePlan.for_trace(m, "top1", sites=["F1"])
    a = prealloc.Arrays(plan, 1, lambda k, t: t, hooks=False)
    tensors = {(0, "F1"): torch.ones(1, 17, 192, requires_grad=True) * 1,
               (1, "F1"): torch.ones(1, 17, 96, requires_grad=True) * 2}
    for key, t in tensors.items():
        a.keep(key, t)
    a.begin_backward(2)
    a.put_grads([(key, torch.full((2, *t.shape), 3.0)) for key, t in tensors.items()])
    a.finish_backward()
    assert a.filled[0] == {} and a.acts[0][(1, "F1")].shape == (1, 17, 96)
    assert a.grads[0][(0, "F1")].shape == (2, 1, 17, 192) and (a.grads[0][(1, "F1")] == 3).all()


def test_the_module_tree_is_walked_once_per_trace_and_the_trace_is_the_same(monkeypatch):
    from benchmarks.items.vlm_trace_cost import ANSWER, PROMPT, tiny_llava

    m = tiny_llava()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)
    walks: list[int] = []
    walk = module_walk._walk
    monkeypatch.setattr(module_walk, "_walk", lambda model: walks.append(id(model)) or walk(model))
    got = vc.trace(m, x, targets=target)
    assert walks == [id(m), id(m)]  # once for the checks, once for eval mode inside the pass (adapters add modules)
    monkeypatch.setattr(module_walk, "walk_scope", _no_scope)  # lookup_scope opens it by the module's name
    walks.clear()
    _same(vc.trace(m, x, targets=target), got)
    assert len(walks) > 3  # each check walked the tree again, and found the same modules
    assert module_walk.modules(m) == list(m.modules())


def test_every_module_runs_in_eval_mode_also_those_an_adapter_adds_for_the_trace():
    # Qwen2-VL's adapter adds an attention-probe module to every tower block inside the pass (created in train
    # mode): the eval-mode walk must see them, not the call's remembered walk from before the pass
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from vlm_qwen_tiny import tiny_qwen

    from vitcam_nb.adapters.qwen_tower import PROBS

    model, pixel_values, target = tiny_qwen("qwen2")
    attns = [blk.attn for blk in model.model.visual.blocks]
    probes: list[bool] = []  # the training flag of every added probe module that ran

    def seen(m, _i, _o):
        if any(a._modules.get(PROBS) is m for a in attns):
            probes.append(m.training)

    handle = torch.nn.modules.module.register_module_forward_hook(seen)
    try:
        vc.trace(model, pixel_values, targets=target)
    finally:
        handle.remove()
    assert len(probes) == len(attns) and not any(probes)
    assert all(PROBS not in a._modules for a in attns)  # removed after the trace


def _no_scope():
    import contextlib

    return contextlib.nullcontext()


def test_the_walk_scope_is_per_model_and_forgotten_on_exit():
    a, b = torch.nn.Sequential(torch.nn.Linear(1, 1)), torch.nn.Sequential(torch.nn.ReLU())
    with module_walk.walk_scope():
        la, lb = module_walk.modules(a), module_walk.modules(b)
        assert la == list(a.modules()) and lb == list(b.modules()) and module_walk.modules(a) is la
    a.append(torch.nn.Tanh())  # outside the scope: the tree may change, and the next walk sees it
    assert module_walk.modules(a) == list(a.modules()) and len(module_walk.modules(a)) == 3


def test_weights_facts_are_the_hash_and_origin_and_follow_an_in_place_write():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    h0, o0 = weights_facts(m)
    assert (h0, o0) == (weights_sha256(m), weights_origin(m)) == (h0, "random-init") and untrained(m)
    with torch.no_grad():
        m[1].weight.mul_(3)  # trained-looking now: the cached answer must not survive the write
    h1, o1 = weights_facts(m)
    assert (h1, o1) == (weights_sha256(m), "unknown") and h1 != h0 and not untrained(m)
    with torch.no_grad():
        m[1].weight.fill_(1)
    assert weights_facts(m) == (h0, "random-init")


def test_one_group_bounds_are_the_linspace_bounds():
    from vitcam_nb.capture.plan import group_bounds

    for n in range(7):
        for groups in range(5):
            want = np.linspace(0, n, min(groups, n) + 1).round().astype(int)
            got = group_bounds(n, groups)
            assert got.dtype == want.dtype and got.tolist() == want.tolist(), (n, groups)


def test_memavailable_is_read_from_its_line_wherever_it_sits():
    from vitcam_nb.capture.budget import available_bytes, meminfo_available

    text = b"MemTotal:       32000 kB\nMemFree:        1000 kB\nMemAvailable:   20480 kB\nBuffers: 1 kB\n"
    assert meminfo_available(text) == 20480 * 1024
    assert meminfo_available(b"MemAvailable: 7 kB\n") == 7 * 1024
    assert meminfo_available(b"MemTotal: 5 kB\n") is None and meminfo_available(b"MemAvailable: x kB\n") is None
    try:
        with open("/proc/meminfo") as f:
            lines = [line for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pytest.skip("no /proc/meminfo here")
    want = int(lines[0].split()[1]) * 1024
    assert abs(available_bytes() - want) < max(want // 10, 64 << 20)  # read a moment apart: the value moves
