"""Acceptance tests of ``vc.cam`` (issue #3) against the direct NumPy reference of ``cam_reference.py``, on
hand-made traces: every weighting formula, head rule, attention-row rule and target, the post-processing,
placement by coordinates (the same trace with its tokens shuffled), layer fusion and the rollouts."""

from __future__ import annotations

import numpy as np
import pytest
from cam_reference import (
    GH,
    GW,
    IMG_H,
    IMG_W,
    NL,
    PATCH,
    SEED,
    TOP1_POS,
    TOP2_POS,
    T,
    close,
    handmade,
    minmax,
    raw_cam,
    ref_raw,
    ref_rows,
    ref_target_grad,
    relu,
    torch_resize,
)

import vitcam_nb as vc
from vitcam_nb.core.recipe import HEAD_RULES, weighting_names
from vitcam_nb.core.weighting import WEIGHTINGS as REGISTRY

# Weightings that read model-in-the-loop scores (vc.score) are tested against their own references in
# tests/unit/capture/test_scoring.py; these hand-made traces hold gradients only.
# The published methods (method=True) read several sites each: tests/unit/compute/test_published.py.
WEIGHTINGS = tuple(w for w in weighting_names() if not REGISTRY.get(w).scores and not REGISTRY.get(w).method)


# --------------------------------------------------------------------------------------------------
# Weighting formulas, head rules, attention rows, targets


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("site", ["F1", "F3"])
@pytest.mark.parametrize("layer", [0, -1])
def test_weighting_formulas_token_sites(hm, arr, weighting, site, layer):
    got = raw_cam(hm, site=site, layer=layer, weighting=weighting)
    want = ref_raw(arr, site=site, layer=layer % NL, weighting=weighting)
    # A formula may be constant on these 6-token traces (a threshold at 2 standard deviations over the tokens is
    # hardly ever crossed by 6 values): the map must then be that constant. Every weighting is also checked on
    # data where its map is not constant: tests/unit/compute/test_weighting_registry.py.
    close(got, want, rtol=1e-4, nontrivial=np.ptp(want) > 0)


@pytest.mark.parametrize("weighting", ["gradcam", "gradcampp", "xgradcam"])
@pytest.mark.parametrize("wtok", ["patch", "all", "cls"])
def test_weight_tokens(hm, arr, weighting, wtok):
    got = raw_cam(hm, site="F3", layer=1, weighting=weighting, weight_tokens=wtok)
    close(got, ref_raw(arr, site="F3", layer=1, weighting=weighting, wtok=wtok), rtol=1e-4)


@pytest.mark.parametrize("heads", [*HEAD_RULES, 0, 1])
@pytest.mark.parametrize("weighting", ["gradcam", "hirescam", "gradcampp", "layercam", "gradient"])
def test_head_rules_on_F3(hm, arr, heads, weighting):
    got = raw_cam(hm, site="F3", layer=1, weighting=weighting, heads=heads)
    close(got, ref_raw(arr, site="F3", layer=1, weighting=weighting, heads=heads), rtol=1e-4)


def test_head_rules_differ_on_F3(hm):
    # guard against a reference and implementation that both ignore the head rule
    maps = {h: raw_cam(hm, site="F3", layer=1, heads=h) for h in [*HEAD_RULES, 0, 1]}
    assert not np.allclose(maps["channels"], maps["max"])
    assert not np.allclose(maps["mean_then_relu"], maps["relu_then_mean"])
    assert not np.allclose(maps[0], maps[1])


@pytest.mark.parametrize("rows", ["cls", "mean", "patch_mean"])
@pytest.mark.parametrize("heads", [*HEAD_RULES, 1])
@pytest.mark.parametrize("weighting", ["gradcam", "hirescam", "gradcam_elementwise", "xgradcam", "layercam",
                                       "gradient"])
def test_attention_site_F2(hm, arr, rows, heads, weighting):
    got = raw_cam(hm, site="F2", layer=0, weighting=weighting, heads=heads, attn_rows=rows)
    close(got, ref_raw(arr, site="F2", layer=0, weighting=weighting, heads=heads, rows=rows), rtol=1e-4)


@pytest.mark.parametrize("weighting", ["eigencam", "eigengradcam", "gradcampp"])
def test_attention_site_F2_other_weightings(hm, arr, weighting):
    got = raw_cam(hm, site="F2", layer=1, weighting=weighting)
    close(got, ref_raw(arr, site="F2", layer=1, weighting=weighting), rtol=1e-4)


@pytest.mark.parametrize("target", ["logit", "prob", "logprob"])
@pytest.mark.parametrize("class_, pos", [("top1", TOP1_POS), ("top2", TOP2_POS), (0, 0), (1, 1)])
@pytest.mark.parametrize("site", ["F1", "F2"])
def test_targets_and_derived_gradients(hm, arr, target, class_, pos, site):
    got = raw_cam(hm, site=site, layer=1, target=target, class_=class_, weighting="hirescam")
    close(got, ref_raw(arr, site=site, layer=1, target=target, cls_pos=pos, weighting="hirescam"))


def test_targets_really_differ(hm):
    a, b, c = (raw_cam(hm, target=t, weighting="gradient") for t in ("logit", "prob", "logprob"))
    assert not np.allclose(a, b) and not np.allclose(a, c) and not np.allclose(b, c)


def test_untraced_class_names_traced_classes_and_how_to_trace(hm):
    with pytest.raises(vc.RecipeError) as e:
        vc.cam(hm, vc.Recipe(class_=2))
    msg = str(e.value)
    assert msg.startswith("class_")
    assert "[0, 1]" in msg and "targets=" in msg
    with pytest.raises(ValueError, match="class_"):
        vc.cam(hm, vc.Recipe(class_="top3"))   # class 2 is ranked 3rd and was not traced
    with pytest.raises(ValueError, match="class_"):
        vc.cam(hm, vc.Recipe(class_=7))        # beyond the model's 3 classes


def test_prob_without_expected_logit_names_target():
    tr = handmade(SEED, expected=False)
    vc.cam(tr, vc.Recipe(target="logit"))      # direct target still works
    for target in ("prob", "logprob"):
        with pytest.raises(ValueError, match="target|expected"):
            vc.cam(tr, vc.Recipe(target=target))


# --------------------------------------------------------------------------------------------------
# Post-processing: ReLU, normalisation, upsampling


@pytest.mark.parametrize("mode", ["bilinear", "bicubic", "nearest"])
def test_relu_minmax_upsample(hm, arr, mode):
    raw = ref_raw(arr, site="F1", layer=1, weighting="hirescam")
    grid = minmax(relu(raw))
    close(vc.cam(hm, vc.Recipe(weighting="hirescam"), grid=True).values, grid)
    m = vc.cam(hm, vc.Recipe(weighting="hirescam", upsample=mode))
    assert m.dims == ("y", "x") and m.shape == (IMG_H, IMG_W)
    close(m.values, minmax(torch_resize(grid, mode)))
    assert m.values.min() == 0 and m.values.max() == 1


def test_upsample_none_equals_grid(hm):
    a = vc.cam(hm, vc.Recipe(upsample="none"))
    b = vc.cam(hm, vc.Recipe(), grid=True)
    assert a.dims == ("patch_row", "patch_col") and a.shape == (GH, GW)
    np.testing.assert_array_equal(a.values, b.values)


def test_relu_none_and_max_normalisation(hm, arr):
    raw = ref_raw(arr, site="F1", layer=1, weighting="hirescam")
    assert raw.min() < 0 < raw.max()
    close(raw_cam(hm, weighting="hirescam"), raw)
    got = vc.cam(hm, vc.Recipe(weighting="hirescam", relu="none", normalize="max"), grid=True).values
    close(got, raw / raw.max())
    got = vc.cam(hm, vc.Recipe(weighting="hirescam", relu="none", normalize="minmax"), grid=True).values
    close(got, minmax(raw))
    got = vc.cam(hm, vc.Recipe(weighting="hirescam", relu="after", normalize="none"), grid=True).values
    close(got, relu(raw))


# --------------------------------------------------------------------------------------------------
# Raster placement uses the coordinates, not the token order


PERM = np.array([4, 0, 6, 2, 1, 5, 3])   # CLS moves to position 1; patches shuffled


@pytest.mark.parametrize("fields", [
    {}, {"weighting": "hirescam"}, {"weighting": "eigencam"}, {"weighting": "gradcampp", "weight_tokens": "all"},
    {"weighting": "gradcam", "weight_tokens": "cls"}, {"site": "F3", "heads": "relu_then_mean"},
    {"site": "F2"}, {"site": "F2", "attn_rows": "patch_mean", "heads": 1}, {"site": "F2", "attn_rows": "mean"},
    {"site": "F2", "layer": "all", "layer_fusion": "rollout"},
    {"site": "F2", "layer": "all", "layer_fusion": "grad_rollout"},
    {"layer": "all", "layer_fusion": "max"},
])
def test_tokens_out_of_raster_order(hm, fields):
    shuffled = handmade(SEED, perm=PERM)
    assert list(shuffled.token_kind.values[:2]) == ["patch", "cls"]
    want = raw_cam(hm, **fields)
    assert np.ptp(want) > 0
    np.testing.assert_allclose(raw_cam(shuffled, **fields), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # and at the input size
    np.testing.assert_allclose(vc.cam(shuffled, vc.Recipe(**fields)).values,
                               vc.cam(hm, vc.Recipe(**fields)).values, rtol=1e-5, atol=1e-6)


def test_placement_by_coordinates_on_known_grid():
    """Hirescam with a gradient on one channel puts each token's activation at its (row, col) cell."""
    tr = handmade(SEED, perm=PERM)
    act = tr["act"].values.copy()
    grad = np.zeros_like(tr["grad"].values)
    rows, cols = tr.patch_row.values, tr.patch_col.values
    for t in range(T):
        act[:, :, t, 0] = 10 * rows[t] + cols[t] + 100   # value encodes its own position
    grad[:, :, :, :, 0] = 1
    tr = tr.assign(act=(tr["act"].dims, act), grad=(tr["grad"].dims, grad))
    got = raw_cam(tr, weighting="hirescam")
    want = 100 + 10 * np.arange(GH)[:, None] + np.arange(GW)[None, :]
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------------------------------
# Layer fusion, rollout, gradient rollout


@pytest.mark.parametrize("fusion", ["mean", "sum", "max"])
@pytest.mark.parametrize("layer", ["all", (0, 1), (1, 0)])
def test_layer_fusion(hm, arr, fusion, layer):
    per_layer = [minmax(relu(ref_raw(arr, layer=lay, weighting="hirescam"))) for lay in (0, 1)]
    fuse = {"mean": np.mean, "sum": np.sum, "max": np.max}[fusion]
    want_grid = minmax(fuse(np.stack(per_layer), axis=0))
    r = vc.Recipe(weighting="hirescam", layer=layer, layer_fusion=fusion)
    close(vc.cam(hm, r, grid=True).values, want_grid)
    want = minmax(fuse(np.stack([torch_resize(m) for m in per_layer]), axis=0))
    close(vc.cam(hm, r).values, want)


def ref_rollout(arr, grad_weighted: bool, target="logit", cls_pos=TOP1_POS, rows="cls") -> np.ndarray:
    R = np.eye(T)
    for layer in range(NL):
        A = arr["attn"][layer]
        if grad_weighted:
            G = ref_target_grad(arr["attn_grad"][:, layer], arr["logits"], target, cls_pos)
            R = R + relu(G * A).mean(0) @ R
        else:
            R = (0.5 * A.mean(0) + 0.5 * np.eye(T)) @ R
    return ref_rows(R, rows)[PATCH].reshape(GH, GW)


@pytest.mark.parametrize("rows", ["cls", "mean", "patch_mean"])
def test_attention_rollout(hm, arr, rows):
    want = ref_rollout(arr, False, rows=rows)
    close(raw_cam(hm, site="F2", layer="all", layer_fusion="rollout", attn_rows=rows), want)
    got = vc.cam(hm, vc.Recipe(site="F2", layer="all", layer_fusion="rollout", attn_rows=rows))
    close(got.values, minmax(torch_resize(minmax(want))))


@pytest.mark.parametrize("target", ["logit", "prob", "logprob"])
@pytest.mark.parametrize("rows", ["cls", "mean"])
def test_gradient_rollout(hm, arr, target, rows):
    want = ref_rollout(arr, True, target=target, rows=rows)
    r = dict(site="F2", layer="all", layer_fusion="grad_rollout", target=target, attn_rows=rows)
    close(raw_cam(hm, **r), want)
    close(vc.cam(hm, vc.Recipe(**r)).values, minmax(torch_resize(minmax(want))))


def test_presets_rollouts_on_handmade(hm, arr):
    close(vc.cam(hm, vc.presets.attention_rollout(), grid=True).values, minmax(ref_rollout(arr, False)))
    close(vc.cam(hm, vc.presets.gradient_rollout(), grid=True).values, minmax(ref_rollout(arr, True)))


def test_legrad_style_preset(hm, arr):
    per_layer = []
    for layer in range(NL):
        G = ref_rows(ref_target_grad(arr["attn_grad"][:, layer], arr["logits"], "logit", TOP1_POS), "mean")
        per_layer.append(minmax(relu(G).mean(0)[PATCH].reshape(GH, GW)))
    close(vc.cam(hm, vc.presets.legrad_style(), grid=True).values, minmax(np.sum(per_layer, axis=0)))


def test_chefer_attention_gradcam_on_handmade(hm, arr):
    A = arr["attn"][-1][:, 0, PATCH]
    G = arr["attn_grad"][TOP1_POS, -1][:, 0, PATCH]
    want = minmax(relu((A * G.mean(-1, keepdims=True)).mean(0))).reshape(GH, GW)
    close(vc.cam(hm, vc.presets.chefer_attention_gradcam(), grid=True).values, want)


@pytest.mark.parametrize("fusion", ["rollout", "grad_rollout"])
def test_rollout_goes_in_block_order_whatever_the_tuple_order(hm, arr, fusion):
    want = ref_rollout(arr, fusion == "grad_rollout")
    for layer in ((0, 1), (1, 0), (-1, 0), "all"):
        close(raw_cam(hm, site="F2", layer=layer, layer_fusion=fusion), want)
