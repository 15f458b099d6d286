"""Issue #36, "one badge, one cause": a degenerate map names its cause. Hand-made traces (one CLS token and a 2x3
patch grid, HiResCAM at F1, so every map is sum_c act * grad per patch and its sign is set by hand) and two
tiny real models produce each cause: zero gradient, nothing left after the ReLU, a constant map, a saturated
softmax, a softmax over one score. Each is checked in ``attrs["degenerate_cause"]``, at the start of the
DegenerateMapWarning, in the Explorer's, the Gallery's and the Compare's data, and (node) in the browser's
classifier, which must give the kernel's label for the same reason. The reason text itself keeps its old start."""

from __future__ import annotations

import json
import shutil
import subprocess
import warnings

import numpy as np
import pytest
import torch
import xarray as xr
from vitcam_testing import make_model

import vitcam_nb as vc
from vitcam_nb.compute.maps import DEGENERATE_CAUSES, cause_counts, degenerate_cause
from vitcam_nb.widgets import Compare, Explorer, Gallery, assets
from vitcam_nb.widgets.results import compute_grid

GH, GW, C, T, NL = 2, 3, 4, 7, 2
HIRES = vc.Recipe(site="F1", weighting="hirescam", layer=0)


def handmade(act: np.ndarray, grad: np.ndarray) -> xr.Dataset:
    """A trace-schema Dataset: act (layer, token, channel) at F1, grad (target, layer, token, channel) for the
    targets logit_1 and expected_logit; token 0 is CLS, then the 2x3 patch grid in raster order."""
    rows = np.array([-1] + [r for r in range(GH) for _ in range(GW)])
    cols = np.array([-1] + [c for _ in range(GH) for c in range(GW)])
    coords = {"layer": ("layer", np.arange(NL)), "site": ("site", np.array(["F1"])), "token": ("token", np.arange(T)),
              "token_kind": ("token", np.array(["cls"] + ["patch"] * (T - 1))), "patch_row": ("token", rows),
              "patch_col": ("token", cols), "channel": ("channel", np.arange(C)),
              "target": ("target", np.array(["logit_1", "expected_logit"])),
              "target_class": ("target", np.array([1, -1])), "class": ("class", np.arange(3))}
    data = {"act": (("layer", "site", "token", "channel"), act[:, None].astype(np.float32)),
            "grad": (("target", "layer", "site", "token", "channel"), grad[:, :, None].astype(np.float32)),
            "logits": (("class",), np.array([0.5, 2.0, -1.0], np.float32)),
            "image": (("y", "x", "rgb"), np.zeros((8, 12, 3), np.uint8))}
    attrs = {"schema_version": 1, "grid_h": GH, "grid_w": GW, "num_prefix_tokens": 1, "num_heads": 2, "head_dim": 2,
             "num_layers": NL, "trace_id": "badge", "img_height": 8, "img_width": 12, "model_name": "handmade",
             "hook_F1": "blocks.{layer}.norm1:output"}
    return xr.Dataset(data, coords=coords, attrs=attrs)


def parts(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    act = rng.integers(1, 4, size=(NL, T, C)) + 0.25  # every activation > 0
    grad = rng.integers(1, 4, size=(2, NL, T, C)).astype(np.float64)  # every gradient > 0: maps > 0
    return act, grad


def zero_gradient() -> xr.Dataset:
    act, grad = parts()
    grad[:, 0, 1:] = 0  # the patch tokens' gradient at layer 0
    return handmade(act, grad)


def all_negative() -> xr.Dataset:
    act, grad = parts()
    act[0] = -act[0]  # act < 0, grad > 0: every HiResCAM value at layer 0 is < 0
    return handmade(act, grad)


def constant() -> xr.Dataset:
    act, grad = parts()
    act[0], grad[:, 0] = 1.0, 2.0  # every patch's value is 4 * 1 * 2 = 8: flat, and positive
    return handmade(act, grad)


def cam_and_warnings(trace, recipe: vc.Recipe) -> tuple[xr.DataArray, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = vc.cam(trace, recipe)
    return m, [str(w.message) for w in caught if issubclass(w.category, vc.DegenerateMapWarning)]


def check(m: xr.DataArray, messages: list[str], label: str, start: str) -> None:
    assert m.attrs["degenerate_cause"] == label == degenerate_cause(m.attrs["degenerate"])
    assert m.attrs["degenerate"].startswith(start), m.attrs["degenerate"]  # the reason text keeps its start
    assert len(messages) == 1 and messages[0].startswith(f"{label}: recipe {m.attrs['recipe_id']}"), messages
    assert not m.values.any()


def test_zero_gradient_is_named():
    m, messages = cam_and_warnings(zero_gradient(), HIRES)
    check(m, messages, "zero gradient", "gradients are exactly zero at these tokens")


def test_all_negative_before_the_relu_is_named_apart_from_a_constant_map():
    tr = all_negative()
    m, messages = cam_and_warnings(tr, HIRES)
    check(m, messages, "nothing left after ReLU", "the map is constant")
    signed, messages = cam_and_warnings(tr, HIRES.replace(relu="none"))  # the same values, signed: a real map
    assert messages == [] and signed.attrs["degenerate_cause"] == "" and signed.values.max() == 1


@pytest.mark.parametrize("relu", ["after", "none"])
def test_a_flat_positive_map_is_a_constant_map_with_or_without_relu(relu):
    m, messages = cam_and_warnings(constant(), HIRES.replace(relu=relu))
    check(m, messages, "constant map", "the map is constant (after the ReLU nothing is left, or only rounding")


def test_a_saturated_softmax_is_named():
    model = make_model("vit", num_classes=3)
    with torch.no_grad():  # class 0's logit exceeds the others by ~1e3: its probability is exactly 1 in float32
        model.head.weight.zero_()
        model.head.bias.copy_(torch.tensor([1000.0, 0.0, 0.0]))
        model.head.weight[0].fill_(1e-3)
    tr = vc.trace(model, np.random.default_rng(8).integers(0, 255, (32, 32, 3), dtype=np.uint8), targets=[0])
    m, messages = cam_and_warnings(tr, vc.Recipe(target="prob", class_=0))
    check(m, messages, "softmax saturated", "target 'prob': the softmax is saturated")


def test_a_softmax_over_one_score_is_named():
    tr = vc.trace(make_model("vit", num_classes=1), np.zeros((32, 32, 3), np.uint8), targets="top1")
    m, messages = cam_and_warnings(tr, vc.Recipe(target="prob"))
    check(m, messages, "softmax over one score", "target 'prob': a softmax over one score is constant")


def test_a_fusion_of_layers_degenerate_for_two_causes_names_both_in_order():
    act, grad = parts()
    grad[:, 0, 1:] = 0  # layer 0: zero gradient
    act[1] = -act[1]  # layer 1: all negative
    m, messages = cam_and_warnings(handmade(act, grad), HIRES.replace(layer="all", layer_fusion="mean"))
    assert m.attrs["degenerate"].startswith("layer 0: gradients are exactly zero")
    assert "layer 1: the map is constant: nothing is left after the ReLU" in m.attrs["degenerate"]
    check(m, messages, "zero gradient + nothing left after ReLU", "layer 0: ")


def test_a_map_that_is_not_degenerate_has_no_cause_and_an_unknown_reason_is_other():
    act, grad = parts()
    m, messages = cam_and_warnings(handmade(act, grad), HIRES)
    assert messages == [] and m.attrs["degenerate"] == "" and m.attrs["degenerate_cause"] == ""
    assert degenerate_cause("a reason no phrase names") == "other"


def test_the_explorer_and_gallery_carry_the_cause():
    tr = all_negative()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        ex = Explorer(tr, HIRES)
        assert compute_grid(tr, HIRES).cause == "nothing left after ReLU"
        assert ex.options["degenerate_causes"] == [list(pair) for pair in DEGENERATE_CAUSES]
        gal = Gallery(tr, HIRES, vary="layer")
        cmp = Compare(tr, HIRES, HIRES.replace(layer=1))
        zero = Compare(zero_gradient(), HIRES.replace(layer=1), HIRES)
    assert gal.thumbnails.causes == [["nothing left after ReLU", ""]]
    causes = (cmp.cause_a, cmp.cause_b, zero.cause_a, zero.cause_b)
    assert causes == ("nothing left after ReLU", "", "", "zero gradient")
    assert gal.thumbnails.degenerate[0][0].startswith("the map is constant") and gal.thumbnails.degenerate[0][1] == ""


@pytest.mark.parametrize("vary,start", [
    ({"layer": [0, 1], "relu": ["after", "none"]}, "2 zero gradient: 2 of 4 gallery maps"),  # one cam per cell
    ({"layer": [0, 1]}, "1 zero gradient: 1 of 2 gallery maps"),  # the fast path over layers and sites
])
def test_a_gallery_warning_starts_with_its_causes_counted(vary, start):
    act, grad = parts()
    grad[:, 0, 1:] = 0
    tr = handmade(act, grad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vc.gallery(tr, HIRES, vary=vary)
    messages = [str(w.message) for w in caught if issubclass(w.category, vc.DegenerateMapWarning)]
    assert messages[-1].startswith(f"{start} are degenerate"), messages
    assert cause_counts(["", "the fused map is constant", "x", "the map is constant (after"]) == \
        "2 constant map, 1 other"


REASONS = ["", "gradients are exactly zero at these tokens (the target does not depend on them)",
           "target 'prob': the softmax is saturated (one score exceeds ...), so its gradient is exactly zero; use x",
           "target 'prob': a softmax over one score is constant, so its gradient is zero; use target='logit'",
           "the map is constant: nothing is left after the ReLU (every value is <= 0, or within rounding noise)",
           "the map is constant (after the ReLU nothing is left, or only rounding noise remains)",
           "layer 0: the map is constant: nothing is left after the ReLU (x); layer 2: gradients are exactly zero; "
           "the fused map is constant", "a reason (with [regex] chars.*) no phrase names"]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_browsers_classifier_gives_the_kernels_label(tmp_path):
    module = tmp_path / "core.mjs"
    module.write_text((assets.STATIC_DIR / "core.js").read_text() + "\nexport { degenerateCause };\n")
    script = tmp_path / "run.mjs"
    script.write_text(f"import {{ degenerateCause }} from {json.dumps(str(module))};\nimport fs from 'fs';\n"
                      "const [reasons, table] = JSON.parse(fs.readFileSync(0, 'utf8'));\n"
                      "console.log(JSON.stringify(reasons.map((r) => degenerateCause(r, table))));\n")
    payload = [REASONS, [list(pair) for pair in DEGENERATE_CAUSES]]
    out = subprocess.run([shutil.which("node"), str(script)], input=json.dumps(payload), capture_output=True,
                         text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    assert got == [degenerate_cause(r) for r in REASONS]
    assert got == ["", "zero gradient", "softmax saturated", "softmax over one score", "nothing left after ReLU",
                   "constant map", "nothing left after ReLU + zero gradient + constant map", "other"]
