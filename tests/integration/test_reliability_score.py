"""Issue #32, model-in-the-loop scoring (vc.score): a model that behaves otherwise than the traced one (same
weights: another global_pool, a forward hook, a patched forward) is refused with its score and the trace's, for
the perturbation weightings, the integrated gradient, ViT-CX and non-class targets alike; the untouched model is
still scored as before; torch.autocast and Swin DataTrees are refused; a store another process holds the lock of is
refused with the lock's error and left as it is; the Ablation-CAM text says what pytorch-grad-cam does otherwise.
Every refusal leaves the trace and the model as they were."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from timm.models.vision_transformer import VisionTransformer
from vitcam_testing import assert_unchanged, make_input, make_model, snapshot

import vitcam_nb as vc
from vitcam_nb.capture.store_lock import LOCK_NAME

MODEL = make_model("vit")
X = make_input("vit")
TRACE = vc.trace(MODEL, X, targets="top2", sites=["F1", "F4"])
REQUESTS = [("scorecam", dict(layer=1, site="F4")), ("ablationcam", dict(layer=1, site="F1")),
            ("gscorecam", dict(layer=1, site="F4", k=3)), ("transition", dict(steps=2)),
            (vc.presets.vit_cx().replace(layer=1), {})]
IDS = ["scorecam", "ablationcam", "gscorecam", "integrated-gradient", "vitcx"]


def _logits(model: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(x)[0].double().numpy()


def _assert_refused_with_both_values(trace, model, request, fields, traced_scores, model_scores):
    """The refusal names the score that differs most, with the model's value and the trace's."""
    before, kept = snapshot(model), trace.copy(deep=True)
    i = int(np.argmax(np.abs(model_scores - traced_scores)))
    assert abs(model_scores[i] - traced_scores[i]) > 1e-2  # the change is real, not float noise
    with pytest.raises(vc.TraceError, match="on the traced input its scores are not the trace's logits") as info:
        vc.score(trace, model, request, X, progress=False, **fields)
    text = str(info.value)
    assert f" {i} is {model_scores[i]:.6g} here, {traced_scores[i]:.6g} in the trace" in text, text
    assert_unchanged(before, model)
    assert trace.identical(kept) and not any(v in trace for v in ("score", "ablation", "attn_grad_ig", "vitcx_score"))


@pytest.mark.parametrize(("request_", "fields"), REQUESTS, ids=IDS)
def test_another_global_pool_is_refused(request_, fields):
    other = copy.deepcopy(MODEL)
    other.global_pool = "avg"  # the weights (and so their hash) are the traced ones; the pooling is not
    assert vc.core.provenance.weights_sha256(other) == TRACE.attrs["weights_sha256"]
    _assert_refused_with_both_values(TRACE, other, request_, fields, TRACE["logits"].values, _logits(other, X))


@pytest.mark.parametrize(("request_", "fields"), REQUESTS, ids=IDS)
@pytest.mark.parametrize("where", ["model", "block"])
def test_a_forward_hook_that_changes_the_output_is_refused_and_kept(request_, fields, where):
    model = make_model("vit")
    module = model if where == "model" else model.blocks[2].mlp
    handle = module.register_forward_hook(lambda _m, _i, out: out * 1.5)
    try:
        _assert_refused_with_both_values(TRACE, model, request_, fields, TRACE["logits"].values, _logits(model, X))
        assert len(module._forward_hooks) == 1  # the user's hook is still there
    finally:
        handle.remove()


@pytest.mark.parametrize(("request_", "fields"), REQUESTS, ids=IDS)
def test_a_patched_forward_is_refused(request_, fields):
    model = make_model("vit")
    model.forward = types.MethodType(lambda self, x: VisionTransformer.forward(self, x) - 2.0 * x.mean(), model)
    _assert_refused_with_both_values(TRACE, model, request_, fields, TRACE["logits"].values, _logits(model, X))
    assert "forward" in vars(model)  # the patch is the user's: left in place


def test_a_non_class_target_with_a_hooked_model_is_refused():
    model = make_model("vit", num_classes=0)
    vectors = np.random.default_rng(3).normal(size=(3, 32))
    target = vc.targets.similarity(vectors, ["a", "b", "c"])
    tr = vc.trace(model, X, targets=target, sites=["F1"])
    scale = torch.linspace(0.0, 2.0, 32)  # per channel: the final LayerNorm would undo a uniform change
    handle = model.blocks[1].register_forward_hook(lambda _m, _i, out: out * scale)
    try:
        with torch.no_grad():
            emb = model(X)[0].double().numpy()
        cos = vectors @ emb / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(emb))  # independent similarity
        i = int(np.argmax(np.abs(cos - tr["logits"].values)))
        with pytest.raises(vc.TraceError, match=r"^model, targets: on the traced input") as info:
            vc.score(tr, model, "scorecam", X, targets=target, layer=0, batch_size=1, progress=False)
        assert f"score {i} is {cos[i]:.6g} here, {tr['logits'].values[i]:.6g} in the trace" in str(info.value)
    finally:
        handle.remove()
    assert "score" in vc.score(tr, model, "scorecam", X, targets=target, layer=0, batch_size=1, progress=False)


def test_the_untouched_model_and_a_harmless_hook_are_still_scored_as_before():
    model = make_model("vit")
    seen: list[int] = []
    handle = model.register_forward_hook(lambda _m, args, _o: seen.append(int(args[0].shape[0])))  # returns None
    try:
        before = snapshot(model)
        tr = vc.score(TRACE, model, [vc.Recipe(weighting="scorecam", layer=0, site="F4"),
                                     vc.Recipe(weighting="ablationcam", layer=1)], X, batch_size=64, progress=False)
        assert_unchanged(before, model)
    finally:
        handle.remove()
    assert seen == [1, 32, 32]  # the check pass of the unperturbed input, then one pass per (layer, site)
    # Score-CAM: the logit of the input times channel k's upsampled, min-max normalised patch map (by hand)
    act = TRACE["act"].sel(layer=0, site="F4").values[1:].astype(np.float64)
    classes = [int(c) for c in TRACE["target_class"].values]
    for k in (0, 13, 31):
        grid = torch.from_numpy(act[:, k].reshape(1, 1, 4, 4))
        up = torch.nn.functional.interpolate(grid, size=(32, 32), mode="bilinear", align_corners=True)
        z = _logits(MODEL, X * ((up - up.min()) / (up.max() - up.min() + 1e-8)).float())
        np.testing.assert_allclose(tr["score"].sel(layer=0, site="F4", channel=k).values[0], z[classes[0]],
                                   rtol=1e-5, atol=1e-5)
    # Ablation-CAM at F1: zeroing LayerNorm channel k is zeroing its weight and bias
    ref = copy.deepcopy(MODEL)
    with torch.no_grad():
        ref.blocks[1].norm1.weight[5] = 0
        ref.blocks[1].norm1.bias[5] = 0
    np.testing.assert_allclose(tr["ablation"].sel(layer=1, site="F1", channel=5).values[0],
                               _logits(ref, X)[classes[0]], rtol=1e-5, atol=1e-5)
    # and the map is the formula on those scores: A @ softmax(s)
    s = tr["score"].sel(layer=0, site="F4").values[0].astype(np.float64)
    w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    raw = dict(upsample="none", normalize="none", relu="none")
    np.testing.assert_allclose(vc.cam(tr, vc.Recipe(weighting="scorecam", layer=0, site="F4", **raw)).values.ravel(),
                               act @ w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("request_", "fields"), REQUESTS, ids=IDS)
def test_score_inside_autocast_is_refused_as_trace_is(request_, fields):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(vc.TraceError, match=r"^model: torch.autocast is active") as traced:
            vc.trace(MODEL, X, targets="top2", sites=["F1"])
        before, kept = snapshot(MODEL), TRACE.copy(deep=True)
        with pytest.raises(type(traced.value), match=r"^model: torch.autocast is active.*outside the autocast block"):
            vc.score(TRACE, MODEL, request_, X, progress=False, **fields)
    assert_unchanged(before, MODEL)
    assert TRACE.identical(kept)


def _swin() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, window_size=4,
                             depths=(2, 2), num_heads=(2, 4), embed_dim=16, num_classes=5).eval()


@pytest.mark.parametrize("request_", ["scorecam", "ablationcam", "transition", vc.presets.vit_cx()],
                         ids=["scorecam", "ablationcam", "integrated-gradient", "vitcx"])
def test_a_swin_datatree_is_refused_clearly(request_):
    model = _swin()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    tree = vc.trace(model, x, targets="top1", sites=["F1"])
    assert tree.attrs["hierarchical"] == 1
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"^trace: .*vc.score does not support Swin \(hierarchical\) traces"):
        vc.score(tree, model, request_, x, progress=False)
    assert_unchanged(before, model)


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}


def test_a_store_locked_by_another_process_is_refused_and_left_alone(tmp_path):
    images = [make_input("vit", seed)[0] for seed in range(2)]
    path = vc.trace_many(MODEL, images, tmp_path / "t.zarr", targets="top1", sites=["F1"], progress=False)
    files = _files(path)
    root = str(Path(vc.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    holder = ("import sys; from pathlib import Path; from vitcam_nb.capture.store_lock import StoreLock; "
              "lock = StoreLock(Path(sys.argv[1])); lock.acquire(); print('held', flush=True); sys.stdin.read(); "
              "lock.release()")
    proc = subprocess.Popen([sys.executable, "-c", holder, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "held"  # blocks until the other process holds the lock
        before = snapshot(MODEL)
        for store in (path, vc.open_traces(path)):
            with pytest.raises(vc.TraceFileError, match=rf"^path: .* is being written .*process {proc.pid}\b"):
                vc.score(store, MODEL, "ablationcam", images, layer=0, progress=False)
        assert_unchanged(before, MODEL)
        assert _files(path) == files and (path / LOCK_NAME).exists()
    finally:
        proc.stdin.close()  # the holder releases its lock and exits
        proc.wait(timeout=120)
    assert proc.returncode == 0 and not (path / LOCK_NAME).exists()
    ds = vc.score(path, MODEL, "ablationcam", images, layer=0, progress=False)  # unlocked: scored
    assert np.isfinite(ds["ablation"].sel(layer=0, site="F1").values).all()
    assert not (path / LOCK_NAME).exists()  # vc.score released its own lock


def test_a_store_being_scored_is_refused_to_trace_many(tmp_path):
    """vc.score takes the lock trace_many takes: a trace_many started from a score's progress hook is refused."""
    images = [make_input("vit", seed)[0] for seed in range(2)]
    path = vc.trace_many(MODEL, images, tmp_path / "t.zarr", targets="top1", sites=["F1"], progress=False)
    refused: list[Exception] = []

    def writer(_m, _args, _out):
        if not refused:
            try:
                vc.trace_many(make_model("vit"), images, path, targets="top1", sites=["F1"], progress=False)
            except vc.TraceFileError as exc:
                refused.append(exc)

    model = make_model("vit")
    handle = model.register_forward_hook(writer)
    try:
        vc.score(path, model, "ablationcam", images, layer=0, progress=False)
    finally:
        handle.remove()
    assert refused and "is being written by another vc.score call" in str(refused[0])


def test_ablation_text_says_what_pytorch_grad_cam_does_otherwise():
    text = vc.Recipe(weighting="ablationcam").checklist().to_json()
    assert "as in pytorch-grad-cam 1.5.7 with its ViT ablation layer)" not in text
    assert re.search(r"pytorch-grad-cam 1\.5\.7 with its ViT ablation layer does the same only where the activation "
                     r"minimum is 0; elsewhere \(every LayerNorm site, e\.g\. F1\) it writes min - 1e7 into the "
                     r"ablated channel, which is not copied here", text)
    # the statement itself, on pytorch-grad-cam's own layer: min - 1e7 where the minimum is not 0, 0 where it is
    ablation = pytest.importorskip("pytorch_grad_cam.ablation_layer")
    layer = ablation.AblationLayerVit()
    act = torch.tensor([[[-1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]])  # (batch, token, channel), minimum -1
    layer.set_next_batch(0, act, 1)
    layer.indices = [1]
    np.testing.assert_array_equal(layer(act)[0, :, 1].numpy(), [-1.0 - 1e7] * 2)
    layer.set_next_batch(0, act.clamp(min=0), 1)
    np.testing.assert_array_equal(layer(act)[0, :, 1].numpy(), [0.0, 0.0])


# ----------------------------------------------------------------------------------------------------------------
# Fuzz: whatever vc.score is given, it scores or refuses with the kit's own error, naming the argument.

_REFUSAL = re.compile(r"^(?:[a-z_][\w.]*)(?:, [a-z_][\w.]*)*: ")
_NAMES = st.sampled_from(["scorecam", "ablationcam", "gscorecam", "gradcam", "vitcx", "transition", "bt_token",
                          "bt_head", "no_such_weighting", "", "SCORECAM"])
_RECIPES = st.sampled_from([vc.Recipe(weighting="scorecam", site="F4"), vc.Recipe(weighting="ablationcam", layer=0),
                            vc.Recipe(weighting="gscorecam", k=2), vc.Recipe(), vc.presets.vit_cx().replace(layer=1),
                            vc.presets.transition_attention_maps(start_layer=-2)])
# Names and recipes drawn more often than the rest, so that most examples get past the recipe to the model.
METHODS = st.one_of(_NAMES, _NAMES, _RECIPES, _RECIPES,
                    st.lists(st.sampled_from([vc.Recipe(weighting="scorecam", layer=2, site="F4"),
                                              vc.Recipe(weighting="ablationcam", layer=0), vc.Recipe()]), max_size=3),
                    st.sampled_from([None, 3, 1.5, b"scorecam", ("scorecam",), {"weighting": "scorecam"}]))
BATCH = st.one_of(st.integers(-2, 70), st.integers(1, 70), st.sampled_from([0.5, 2.0, True, "4", None, np.int64(5)]))
IMAGES = st.one_of(st.just("traced"), st.sampled_from(["traced", "traced_numpy", "none", "other", "text", "small",
                                                       "channels4", "flat", "uint8", "nan", "empty", "list"]))
GOOD = X.numpy()


def _image(kind: str, seed: int) -> object:
    rng = np.random.default_rng(seed)
    return {"traced": X, "traced_numpy": GOOD, "none": None, "other": X + 0.25, "text": "not an image",
            "small": torch.randn(1, 3, 16, 16), "channels4": torch.randn(1, 4, 32, 32), "flat": torch.randn(32, 32),
            "uint8": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "nan": torch.full((1, 3, 32, 32), np.nan),
            "empty": np.zeros((0, 0, 3), np.uint8), "list": [1, 2, 3]}[kind]


FIELDS = st.fixed_dictionaries({}, optional={
    "layer": st.one_of(st.integers(-5, 4), st.sampled_from(["all", "x", 1.0, (0, 1)])),
    "site": st.sampled_from(["F1", "F4", "F2", "F9", 3]),
    "k": st.one_of(st.integers(-1, 40), st.none()),
    "steps": st.one_of(st.integers(-1, 3), st.just("2")),
    "target": st.sampled_from(["logit", "prob", "logprob", "x"]),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=METHODS, batch=BATCH, image=IMAGES, seed=st.integers(0, 3), fields=FIELDS)
def test_fuzzed_score_arguments_give_scores_or_a_named_kit_error(method, batch, image, seed, fields):
    model = make_model("vit")
    before, kept = snapshot(model), TRACE.copy(deep=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = vc.score(TRACE, model, method, _image(image, seed), batch_size=batch, progress=False, **fields)
    except (vc.TraceError, vc.RecipeError, vc.TraceFileError, TypeError) as exc:
        assert _REFUSAL.match(str(exc)), f"{type(exc).__name__} without the argument's name: {exc}"
    else:
        assert isinstance(out, type(TRACE))
    assert_unchanged(before, model)
    assert TRACE.identical(kept)
