"""Issue #17, "the model comes back as it was given": impossible devices are refused before the model is
touched, a device move is undone on every error path, autocast is refused, and two threads tracing one model
either get a trace equal to a lone trace or a clear TraceError, leaving the model bitwise unchanged."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vitcam_testing import assert_unchanged, make_model, snapshot

import vitcam_nb as vc
from vitcam_nb.capture.runtime import on_device

IMG = 32
IMAGE = np.random.default_rng(11).integers(0, 255, (IMG, IMG, 3), dtype=np.uint8)
IMPOSSIBLE = ["meta", "gpu", "cuda:99", "cpu:x", "", "tpu", "xla"] + ([] if torch.cuda.is_available() else ["cuda"])


def _forward_calls(model: torch.nn.Module) -> tuple[list, object]:
    calls: list = []
    return calls, model.register_forward_pre_hook(lambda *_: calls.append(1))


@pytest.mark.parametrize("device", IMPOSSIBLE)
@pytest.mark.parametrize("entry", ["trace", "trace_many"])
def test_impossible_devices_are_refused_before_the_model_is_touched(device, entry, tmp_path):
    model = make_model("vit")
    before = snapshot(model)
    calls, handle = _forward_calls(model)
    with pytest.raises(vc.TraceError, match=r"^device: ") as info:
        if entry == "trace":
            vc.trace(model, IMAGE, targets="top1", device=device)
        else:
            vc.trace_many(model, [IMAGE], tmp_path / "s.zarr", targets="top1", device=device, progress=False)
    handle.remove()
    assert calls == [] and repr(device) in str(info.value)
    assert_unchanged(before, model)
    assert not (tmp_path / "s.zarr").exists()


def test_a_non_string_device_is_refused_naming_the_argument():
    with pytest.raises(vc.TraceError, match=r"^device: expected .* got int 3"):
        vc.trace(make_model("vit"), IMAGE, device=3)


def test_a_model_on_the_meta_device_is_refused():
    from timm.models.vision_transformer import VisionTransformer

    with torch.device("meta"):
        model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4, num_classes=10)
    with pytest.raises(vc.TraceError, match="^model: its parameters are on the meta device"):
        vc.trace(model, IMAGE)


def test_a_move_that_fails_half_way_is_undone():
    """model.to() raising (e.g. out of memory on the device, after moving some parameters) is followed by the
    move back to where the model was."""
    model = make_model("vit")
    before = snapshot(model)
    real_to = torch.nn.Module.to
    calls = []

    def flaky_to(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return real_to(self, *args, **kwargs)

    model.to = flaky_to.__get__(model)
    with pytest.raises(RuntimeError, match="out of memory"):
        with on_device(model, torch.device("meta")):
            pass
    del model.to
    assert len(calls) == 2 and calls[1] == (torch.device("cpu"),)
    assert_unchanged(before, model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_around_a_trace_is_refused_and_the_model_untouched(dtype):
    model = make_model("vit")
    before = snapshot(model)
    with torch.autocast("cpu", dtype=dtype), pytest.raises(vc.TraceError, match="^model: torch.autocast is active"):
        vc.trace(model, IMAGE, targets="top1")
    assert_unchanged(before, model)


def test_a_trace_inside_a_trace_of_the_same_model_is_refused():
    model = make_model("vit")
    inner = []

    def reenter(*_):
        if not inner:
            inner.append(1)
            vc.trace(model, IMAGE, targets="top1")

    handle = model.blocks[0].register_forward_pre_hook(reenter)
    before_flags = {n: m.fused_attn for n, m in model.named_modules() if hasattr(m, "fused_attn")}
    with pytest.raises(vc.TraceError, match="^model: this model is already being traced"):
        vc.trace(model, IMAGE, targets="top1")
    handle.remove()
    assert {n: m.fused_attn for n, m in model.named_modules() if hasattr(m, "fused_attn")} == before_flags


def _equal(a, b) -> bool:
    return all(a[name].values.tobytes() == b[name].values.tobytes() for name in a.variables) and a.attrs == b.attrs


def test_two_threads_tracing_one_model_get_a_lone_trace_or_a_trace_error():
    model = make_model("vit").train()
    for blk in model.blocks:
        blk.attn.fused_attn = True
    before = snapshot(model)
    alone = vc.trace(model, IMAGE, targets="top2", sites=["F1", "F2", "F6"])
    results: list = []
    barrier = threading.Barrier(2)

    def work():
        barrier.wait()
        for _ in range(25):
            try:
                results.append(vc.trace(model, IMAGE, targets="top2", sites=["F1", "F2", "F6"]))
            except vc.TraceError as exc:
                results.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, Exception)]
    traces = [r for r in results if not isinstance(r, Exception)]
    assert len(results) == 50 and traces
    assert all("this model is already being traced" in str(e) for e in errors)
    assert all(_equal(t, alone) for t in traces)
    assert_unchanged(before, model)
    assert model.training and all(blk.attn.fused_attn for blk in model.blocks)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(device=st.one_of(st.sampled_from(IMPOSSIBLE + ["cpu", None, torch.device("cpu")]), st.text(max_size=6),
                        st.integers(-2, 2)),
       autocast=st.sampled_from([None, torch.bfloat16]))
def test_fuzzed_devices_and_autocast_give_a_trace_or_a_named_error(device, autocast):
    model = make_model("vit")
    before = snapshot(model)
    try:
        if autocast is None:
            tr = vc.trace(model, IMAGE, targets="top1", sites=["F1"], device=device)
        else:
            with torch.autocast("cpu", dtype=autocast):
                tr = vc.trace(model, IMAGE, targets="top1", sites=["F1"], device=device)
    except vc.TraceError as exc:
        assert str(exc).split(":", 1)[0] in ("device", "model"), str(exc)
    else:
        assert tr.attrs["device"] == "cpu" and autocast is None
    assert_unchanged(before, model)


def _mixed_flags_model() -> torch.nn.Module:
    model = make_model("vit")
    for i, p in enumerate(model.parameters()):
        p.requires_grad_(i % 3 != 0)  # some frozen by the user, as fine-tuning leaves them
    return model


def test_parameters_are_frozen_for_the_pass_and_each_flag_restored():
    model = _mixed_flags_model()
    before = snapshot(model)
    seen: list = []
    handle = model.blocks[0].register_forward_pre_hook(
        lambda *_: seen.append(any(p.requires_grad for p in model.parameters())))
    vc.trace(model, IMAGE, targets="top2")
    handle.remove()
    assert seen == [False]  # autograd keeps no layer inputs for weight gradients
    assert_unchanged(before, model)


def test_parameter_flags_are_restored_when_the_pass_fails():
    model = _mixed_flags_model()
    before = snapshot(model)

    def boom(*_):
        raise RuntimeError("boom")

    handle = model.blocks[-1].register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        vc.trace(model, IMAGE, targets="top2")
    handle.remove()
    assert_unchanged(before, model)


def test_freezing_does_not_change_the_numbers():
    # Independent of the kit's own freezing: a model the user froze entirely and one with every flag on give
    # bitwise the same trace (the gradients are with respect to activations only).
    trainable = make_model("vit")
    frozen = make_model("vit")
    frozen.load_state_dict(trainable.state_dict())
    frozen.requires_grad_(False)
    a = vc.trace(trainable, IMAGE, targets="top3")
    b = vc.trace(frozen, IMAGE, targets="top3")
    assert _equal(a, b)


def test_a_model_sharing_modules_with_one_being_traced_is_refused():
    from vitcam_nb.capture.runtime import exclusive

    model = make_model("vit")
    sharing = make_model("vit")
    sharing.blocks[0] = model.blocks[0]  # e.g. two heads on one backbone
    container = torch.nn.ModuleDict({"inner": model})
    before = snapshot(sharing)
    with exclusive(model):
        with pytest.raises(vc.TraceError, match="^model: this model is already being traced, or a model that "):
            vc.trace(sharing, IMAGE, targets="top1")
        with pytest.raises(vc.TraceError, match="^model: this model is already being traced"):
            with exclusive(container):
                pass
    assert_unchanged(before, sharing)
    with exclusive(container):  # the model inside a container being traced
        with pytest.raises(vc.TraceError, match="^model: this model is already being traced"):
            vc.trace(model, IMAGE, targets="top1")
    vc.trace(sharing, IMAGE, targets="top1")  # nothing traced now: allowed
