"""The one pass (vitcam_nb/capture/passes.py): trace() and trace_many() run the same forward and batched backward,
so an image traced by either has the same provenance (deterministic settings), the same input checks and the
same error translation; a batch of B images gives each image exactly its own single-image trace."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb.capture import passes, runtime
from vitcam_nb.capture.passes import run_pass
from vitcam_nb.capture.plan import TracePlan

IMG = 32


def _model(seed: int = 0, **kw) -> VisionTransformer:
    torch.manual_seed(seed)
    model = VisionTransformer(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5, **kw)
    for p in model.parameters():  # O(1) logits and attention (timm's init is nearly uniform)
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, IMG, IMG, 3), dtype=np.uint8)


def test_trace_many_images_equal_single_traces(tmp_path):
    """Batching is exact in exact arithmetic: the gradient of sum_b s[b, c_bj] w.r.t. image b's tensors is that of
    s[b, c_bj]; in float32 a batched matrix product may round differently, so values agree to rounding."""
    model, images = _model(), _images(5)
    store = vc.trace_many(model, list(images), tmp_path / "s.zarr", targets="top2", batch_size=3, progress=False)
    ds = vc.open_traces(store)
    for i in range(5):
        single = vc.trace(model, images[i], targets="top2")
        from_store = vc.image_trace(ds, i)
        for name in ("act", "grad", "attn", "attn_grad", "logits"):
            np.testing.assert_allclose(from_store[name].values, single[name].values, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name} {i}")
        assert from_store.attrs["trace_id"] == single.attrs["trace_id"]
        assert from_store["target_class"].values.tolist() == single["target_class"].values.tolist()


def test_run_pass_gives_each_image_its_own_targets():
    model, images = _model(), _images(3, seed=1)
    plan = TracePlan.for_store(model, "top2", sites=["F1"], layers=[1])
    x = torch.cat([vc.preprocess.prepare_input(model, im).tensor for im in images])
    run = run_pass(plan, x)
    with torch.no_grad():
        logits = model(x)
    assert run.classes == torch.topk(logits, 2).indices.tolist()
    np.testing.assert_allclose(run.logits.numpy(), logits.numpy(), rtol=1e-5, atol=1e-6)
    one, alone = run.image(2), run_pass(plan, x[2:3]).image(0)
    assert one.classes == alone.classes
    for key in alone.acts:  # image 2 of the batch is what a batch of image 2 alone gives
        assert one.acts[key].shape == alone.acts[key].shape == (1, 17, 32)
        assert one.grads[key].shape == alone.grads[key].shape == (3, 1, 17, 32)
        torch.testing.assert_close(one.acts[key], alone.acts[key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(one.grads[key], alone.grads[key], rtol=1e-4, atol=1e-6)


def test_trace_and_trace_many_record_the_same_deterministic_settings(monkeypatch, tmp_path):
    model, images = _model(), _images(2)
    # The pass's CUDA determinism branch runs on CPU (only global flags change); a hook in the forward pass
    # records whether deterministic algorithms were on.
    seen: list[bool] = []
    real = runtime.deterministic
    monkeypatch.setattr(passes, "deterministic", lambda device: real(torch.device("cuda")))
    handle = model.blocks[0].register_forward_hook(
        lambda *_: seen.append(torch.are_deterministic_algorithms_enabled()))
    before = torch.are_deterministic_algorithms_enabled()
    try:
        single = vc.trace(model, images[0], targets="top1")
        store = vc.trace_many(model, list(images), tmp_path / "s.zarr", targets="top1", progress=False)
    finally:
        handle.remove()
    ds = vc.open_traces(store)
    assert seen == [True, True]  # one forward for trace(), one for the batch of two
    assert torch.are_deterministic_algorithms_enabled() == before
    assert single.attrs["deterministic_settings"] == runtime.CUDA_DETERMINISTIC
    assert ds.attrs["deterministic_settings"] == single.attrs["deterministic_settings"]
    assert ds["deterministic"].values.tolist() == [1, 1] and single.attrs["deterministic"] == 1


def test_a_device_without_a_deterministic_switch_is_recorded_as_such(monkeypatch):
    real = runtime.deterministic
    monkeypatch.setattr(passes, "deterministic", lambda device: real(torch.device("meta")))
    tr = vc.trace(_model(), _images(1)[0], targets="top1")
    assert tr.attrs["deterministic"] == 0 and tr.attrs["deterministic_settings"].startswith("none: meta")


def test_trace_and_trace_many_refuse_the_same_input(tmp_path):
    model = _model()
    wrong = torch.zeros(1, 3, 48, 48)  # a float tensor is used as given: the patch embedding's size is checked
    with pytest.raises(vc.TraceError, match="image: the model expects 32x32 input, got 48x48") as one:
        vc.trace(model, wrong)
    with pytest.raises(vc.TraceError, match="image: the model expects 32x32 input, got 48x48") as many:
        vc.trace_many(model, [wrong[0]], tmp_path / "s.zarr", progress=False)
    assert str(one.value) == str(many.value)


def test_an_adapter_check_input_refuses_in_both(tmp_path, monkeypatch):
    model = _model()
    adapter = vc.adapters.find_adapter(model)

    def refuse(self, model, x):
        raise vc.TraceError(f"image: batch of {x.shape[0]} refused by the adapter")

    monkeypatch.setattr(type(adapter), "check_input", refuse)
    with pytest.raises(vc.TraceError, match="refused by the adapter"):
        vc.trace(model, _images(1)[0])
    with pytest.raises(vc.TraceError, match="batch of 2 refused by the adapter"):
        vc.trace_many(model, list(_images(2)), tmp_path / "s.zarr", progress=False)


def test_trace_and_trace_many_translate_a_foreign_gradient_hook(tmp_path):
    model = _model()
    # Another library's hook that reads gradients out of autograd (as CAM libraries do) cannot be vmapped.
    def read_grad(_module, _inputs, out):
        out.register_hook(lambda g: float(g.numpy().sum()) and None)

    hook = model.blocks[0].norm1.register_forward_hook(read_grad)
    try:
        with pytest.raises(vc.TraceError, match="a gradient hook already on the model") as one:
            vc.trace(model, _images(1)[0])
        with pytest.raises(vc.TraceError, match="a gradient hook already on the model") as many:
            vc.trace_many(model, list(_images(2)), tmp_path / "s.zarr", progress=False)
    finally:
        hook.remove()
    assert str(one.value).split("(")[0] == str(many.value).split("(")[0]
    assert not (tmp_path / "s.zarr").exists()  # nothing written for a batch that failed


def test_a_custom_target_scores_one_image_at_a_time():
    class FirstTwo(vc.targets.Target):
        kind = "first_two"

        def scores(self, model, x):
            return model(x)[0, :2]

    model = _model()
    plan = TracePlan.for_trace(model, FirstTwo(), sites=["F1"], layers=[0])
    with pytest.raises(vc.TraceError, match="scores one image at a time"):
        run_pass(plan, torch.zeros(2, 3, IMG, IMG))
    tr = vc.trace(model, _images(1)[0], targets=FirstTwo(), sites=["F1"], layers=[0])
    assert tr["target_class"].values.tolist() == [0, 1, -1]


@pytest.mark.parametrize("returned, shape", [(lambda z: z[0, 0], "()"), (lambda z: z, "(1, 5)"),
                                             (lambda z: [1.0], "list"), (lambda z: z[0, :0], "(0,)")])
def test_a_custom_target_returns_one_score_vector(returned, shape):
    class Odd(vc.targets.Target):
        def scores(self, model, x):
            return returned(model(x))

    with pytest.raises(vc.TraceError, match=f"targets: the target's scores\\(\\) must return a non-empty 1-D float "
                                            f"tensor, got {re.escape(shape)}"):
        vc.trace(_model(), _images(1)[0], targets=Odd())


def test_a_target_batch_scores_are_checked_against_the_batch():
    class OneRowShort(vc.targets.ClassTargets):
        def batch_scores(self, model, x):
            return model(x)[1:]

    plan = TracePlan.for_store(_model(), "top1", sites=["F1"], layers=[0])
    plan.target = OneRowShort("top1")
    with pytest.raises(vc.TraceError, match=r"batch_scores\(\) must return a non-empty \(3, N\) float tensor, "
                                            r"got \(2, 5\)"):
        run_pass(plan, torch.zeros(3, 3, IMG, IMG))
