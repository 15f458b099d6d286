"""Issue #12: fuzz the public API with random and malformed input. Valid input gives finite results,
invalid input gives ValueError/TypeError naming the argument, nothing else escapes, and the model is left
exactly as it was. Also: no memory growth over repeated traces, bitwise-deterministic cam()."""

from __future__ import annotations

import gc
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vitcam_testing import assert_unchanged, make_model, snapshot

import vitcam_nb as vc

MODEL = make_model("vit")
IMG = int(MODEL.patch_embed.img_size[0])
NUM_CLASSES = MODEL.num_classes
NUM_LAYERS = len(MODEL.blocks)
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALLOWED = (ValueError, TypeError)


def _names_argument(exc: BaseException, names: tuple[str, ...]) -> bool:
    return str(exc).split(":", 1)[0].strip() in names


def _image_strategy():
    dtypes = st.sampled_from([np.uint8, np.float32, np.float64, np.int64, np.bool_])
    shapes = st.one_of(
        st.tuples(st.integers(1, 3), st.integers(1, 3)),
        st.tuples(st.integers(1, 80), st.integers(1, 80), st.sampled_from([1, 3, 4])),
        st.tuples(st.just(1), st.integers(1, 4), st.integers(1, 40), st.integers(1, 40)),
        st.tuples(st.sampled_from([1, 2, 500]), st.sampled_from([1, 500])).map(lambda s: (*s, 3)),
    )
    special = st.sampled_from([None, np.nan, np.inf, -np.inf, "constant"])
    return st.tuples(dtypes, shapes, special, st.booleans())


@FUZZ
@given(spec=_image_strategy())
def test_fuzzed_images_give_a_trace_or_a_named_error_and_leave_the_model_alone(spec):
    dtype, shape, special, as_tensor = spec
    rng = np.random.default_rng(0)
    array = (rng.random(shape) * 255).astype(dtype)
    if special == "constant":
        array[...] = array.flat[0]
    elif special is not None and np.issubdtype(array.dtype, np.floating):
        array.flat[0] = special
    image = torch.from_numpy(np.ascontiguousarray(array)) if as_tensor else array
    before = snapshot(MODEL)
    try:
        tr = vc.trace(MODEL, image, targets="top2", sites=["F1", "F2"], layers=[-1])
    except ALLOWED as exc:
        assert _names_argument(exc, ("image", "model")), str(exc)
    else:
        for name in ("act", "grad", "attn", "attn_grad", "logits"):
            assert np.isfinite(tr[name].values).all()
    assert_unchanged(before, MODEL)


@FUZZ
@given(targets=st.one_of(st.integers(-5, NUM_CLASSES + 5), st.text(max_size=6), st.floats(allow_nan=True),
                         st.lists(st.integers(-3, NUM_CLASSES + 3), max_size=4), st.none(), st.booleans()),
       layers=st.one_of(st.none(), st.integers(-NUM_LAYERS - 2, NUM_LAYERS + 1), st.text(max_size=3),
                        st.lists(st.integers(-NUM_LAYERS - 1, NUM_LAYERS), max_size=3)),
       sites=st.one_of(st.none(), st.sampled_from(["F1", "F2", "F7", "", "resid_mid"]),
                       st.lists(st.sampled_from(["F1", "F3", "F6", "F9", "attn_out"]), max_size=3)))
def test_fuzzed_arguments_give_a_trace_or_a_named_error(targets, layers, sites):
    image = np.full((IMG, IMG, 3), 128, np.uint8)
    before = snapshot(MODEL)
    try:
        tr = vc.trace(MODEL, image, targets=targets, layers=layers, sites=sites)
    except ALLOWED as exc:
        assert _names_argument(exc, ("targets", "layers", "sites")), str(exc)
    else:
        assert np.isfinite(tr["logits"].values).all()
    assert_unchanged(before, MODEL)


TRACE = vc.trace(MODEL, torch.randn(1, 3, IMG, IMG, generator=torch.Generator().manual_seed(3)), targets="top3",
                 sites=["F1", "F2", "F3", "F4", "F5", "F6"])


@FUZZ
@given(fields=st.dictionaries(
    st.sampled_from(["site", "layer", "target", "class_", "weight_tokens", "upsample", "weighting", "heads",
                     "attn_rows", "layer_fusion", "relu", "normalize", "colour"]),
    st.one_of(st.integers(-20, 20), st.text(max_size=8), st.none(), st.floats(allow_nan=True),
              st.lists(st.integers(-4, 4), max_size=3), st.sampled_from(["F2", "all", "top1", "prob", "cls"])),
    max_size=4))
def test_fuzzed_recipes_through_cam_give_a_map_or_a_named_error(fields):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", vc.DegenerateMapWarning)
            m = vc.cam(TRACE, **fields)
    except ALLOWED as exc:
        assert _names_argument(exc, (*fields, "layer", "site", "class_", "target", "heads")), str(exc)
    else:
        assert np.isfinite(m.values).all() and m.dims in (("y", "x"), ("patch_row", "patch_col"))


def test_cam_is_bitwise_deterministic_and_traces_are_identical():
    r = vc.Recipe(site="F2", layer="all", layer_fusion="grad_rollout", target="prob")
    a, b = vc.cam(TRACE, r), vc.cam(TRACE, r)
    assert a.values.tobytes() == b.values.tobytes()
    image = np.random.default_rng(5).integers(0, 255, (IMG, IMG, 3), dtype=np.uint8)
    t1, t2 = vc.trace(MODEL, image), vc.trace(MODEL, image)
    for name in t1.variables:
        assert t1[name].values.tobytes() == t2[name].values.tobytes(), name
    assert t1.attrs == t2.attrs


def test_cuda_traces_switch_deterministic_kernels_on_and_restore_them():
    """The CUDA branch of the tracer's determinism guard, exercised on CPU: only global flags change."""
    from vitcam_nb.capture.runtime import deterministic

    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    torch.backends.cudnn.benchmark = True
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with deterministic(torch.device("cuda")):
                assert torch.are_deterministic_algorithms_enabled()
                assert torch.is_deterministic_algorithms_warn_only_enabled()
                assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
                raise RuntimeError("inside")
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
        assert torch.are_deterministic_algorithms_enabled() == before[0]
        with deterministic(torch.device("cpu")):
            assert torch.backends.cudnn.benchmark  # CPU traces leave the flags alone
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_traces_are_bitwise_identical():
    image = np.random.default_rng(7).integers(0, 255, (IMG, IMG, 3), dtype=np.uint8)
    t1, t2 = vc.trace(MODEL, image, device="cuda"), vc.trace(MODEL, image, device="cuda")
    for name in t1.variables:
        assert t1[name].values.tobytes() == t2[name].values.tobytes(), name
    assert "use_deterministic_algorithms(True" in t1.attrs["deterministic_settings"]
    assert t1.attrs["device"].startswith("cuda") and next(MODEL.parameters()).device.type == "cpu"


def test_repeated_traces_do_not_grow_memory():
    image = np.random.default_rng(6).integers(0, 255, (IMG, IMG, 3), dtype=np.uint8)
    for _ in range(5):  # warm caches (weights hash, interpolation matrices, allocator pools)
        vc.cam(vc.trace(MODEL, image), vc.Recipe())
    gc.collect()
    tracemalloc.start()
    start, _ = tracemalloc.get_traced_memory()
    for _ in range(50):
        vc.cam(vc.trace(MODEL, image), vc.Recipe())
    gc.collect()
    end, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    one_trace = vc.trace(MODEL, image).nbytes
    assert end - start < one_trace, f"memory grew by {end - start} bytes over 50 traces (one trace: {one_trace})"


def test_keyboard_interrupt_inside_a_trace_restores_the_model():
    model = make_model("vit")
    model.train()
    for blk in model.blocks:
        blk.attn.fused_attn = True
    before = snapshot(model)

    def interrupt(*_):
        raise KeyboardInterrupt

    handle = model.blocks[-1].mlp.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        vc.trace(model, np.zeros((IMG, IMG, 3), np.uint8))
    handle.remove()
    assert_unchanged(before, model)
    assert model.training and all(blk.attn.fused_attn for blk in model.blocks)


class _BadShape(vc.targets.Target):
    def scores(self, model, x):
        return model(x)  # (1, classes) instead of (classes,)


class _BadChoice(vc.targets.Target):
    def scores(self, model, x):
        return model(x)[0]

    def choose(self, scores):
        return [int(scores.shape[0]) + 2]


@pytest.mark.parametrize("target,match", [(_BadShape(), r"scores\(\) must return a non-empty 1-D float tensor"),
                                          (_BadChoice(), r"choose\(\) must return a non-empty list of distinct")])
def test_custom_targets_are_checked_and_the_model_restored(target, match):
    before = snapshot(MODEL)
    with pytest.raises(vc.TraceError, match=f"targets: the target's {match}"):
        vc.trace(MODEL, np.zeros((IMG, IMG, 3), np.uint8), targets=target)
    assert_unchanged(before, MODEL)


def test_wrong_labels_are_refused_before_the_forward_pass():
    calls = []
    handle = MODEL.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(vc.TraceError, match="labels: expected a sequence of"):
            vc.trace(MODEL, np.zeros((IMG, IMG, 3), np.uint8), labels=["only one"])
    finally:
        handle.remove()
    assert calls == []
