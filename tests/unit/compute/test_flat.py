"""Acceptance tests of ``vc.cam`` / ``vc.gallery`` (issue #3) against a direct NumPy implementation.

The reference below is written from the formulas of docs/architecture.md ("Recipes and formulas") only. It runs on small
hand-made Datasets in the trace schema (1 CLS + a 2x3 patch grid, 4 channels, 2 heads of dim 2,
2 layers, sites F1 and F3 + F2) whose values are small quarter-integers, so every expected answer is
computed independently of vitcam_nb. A second hand-made trace stores the very same tokens in a
shuffled token order (CLS included) to prove that maps are placed by ``patch_row``/``patch_col``.
Real-model tests (tiny random-init timm ViT from conftest) cover derived prob/logprob gradients against
autograd, degenerate variants, the Chefer attention baseline and the gallery.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import xarray as xr

import vitcam_nb as vc
from vitcam_nb.core.recipe import HEAD_RULES, weighting_names
from vitcam_nb.core.weighting import WEIGHTINGS as REGISTRY

# Weightings that read model-in-the-loop scores (vc.score) are tested against their own references in
# tests/unit/capture/test_scoring.py; these hand-made traces hold gradients only.
# The published methods (method=True) read several sites each: tests/unit/compute/test_published.py.
WEIGHTINGS = tuple(w for w in weighting_names() if not REGISTRY.get(w).scores and not REGISTRY.get(w).method)

# --------------------------------------------------------------------------------------------------
# Hand-made traces

GH, GW, C, NH, NL = 2, 3, 4, 2, 2          # grid, channels, heads (head_dim 2), layers
P = GH * GW
T = 1 + P                                    # CLS + patches
IMG_H, IMG_W = 8, 12                         # 4x upsampling
LOGITS = np.array([0.5, 2.0, -1.0], np.float32)   # top1 = class 1, top2 = class 0; class 2 NOT traced
TRACED = [0, 1]                              # target order: logit_0, logit_1, expected_logit
TOP1_POS, TOP2_POS, E_POS = 1, 0, 2
# A seed whose F2 maps keep positive cells after the ReLU and whose Grad-CAM++ / SVD cases are well posed
# (the reference asserts the latter).
SEED = 30


def handmade(seed: int = SEED, perm: np.ndarray | None = None, *, expected: bool = True,
             zero_patch_grad: tuple[int, str] | None = None) -> xr.Dataset:
    """A trace-schema Dataset built by hand. Canonical token order: CLS, then the raster patch grid.

    ``perm`` (a permutation of the T tokens) stores token ``perm[i]`` at position i, for every variable
    and coordinate: the same trace, another token order. ``zero_patch_grad=(layer, site)`` zeroes every
    target's gradient at that site's patch tokens (what CLS pooling gives at the last block).
    """
    rng = np.random.default_rng(seed)
    n_t = len(TRACED) + (1 if expected else 0)
    # Quarter-integer activations: channel sums over 1, 6 or 7 tokens are never -2/G for integer G, so the
    # Grad-CAM++ denominator G^2 (2 + S G) stays away from 0 and the comparison is well conditioned.
    act = (rng.integers(-3, 4, size=(NL, 2, T, C)) + 0.25).astype(np.float32)
    grad = rng.integers(-3, 4, size=(n_t, NL, 2, T, C)).astype(np.float32)
    attn = rng.random((NL, NH, T, T)) + 0.1
    attn = (attn / attn.sum(-1, keepdims=True)).astype(np.float32)
    attn_grad = (rng.integers(-6, 7, size=(n_t, NL, NH, T, T)) / 2).astype(np.float32)
    if zero_patch_grad is not None:
        layer, site = zero_patch_grad
        if site == "F2":
            attn_grad[:, layer, :, 1:, :] = 0  # only the CLS query row keeps a gradient
        else:
            grad[:, layer, ["F1", "F3"].index(site), 1:, :] = 0
    kinds = np.array(["cls"] + ["patch"] * P)
    rows = np.array([-1] + [r for r in range(GH) for _ in range(GW)])
    cols = np.array([-1] + [c for _ in range(GH) for c in range(GW)])
    if perm is not None:
        act, grad = act[..., perm, :], grad[..., perm, :]
        attn = attn[..., perm, :][..., perm]
        attn_grad = attn_grad[..., perm, :][..., perm]
        kinds, rows, cols = kinds[perm], rows[perm], cols[perm]
    classes = TRACED + ([-1] if expected else [])
    names = [f"logit_{c}" for c in TRACED] + (["expected_logit"] if expected else [])
    coords = {
        "layer": ("layer", np.arange(NL)),
        "site": ("site", np.array(["F1", "F3"])),
        "token": ("token", np.arange(T)),
        "token_kind": ("token", kinds),
        "patch_row": ("token", rows),
        "patch_col": ("token", cols),
        "channel": ("channel", np.arange(C)),
        "head": ("head", np.arange(NH)),
        "target": ("target", np.array(names)),
        "target_class": ("target", np.array(classes)),
        "class": ("class", np.arange(LOGITS.size)),
    }
    for axis in ("query", "key"):
        coords[axis] = (axis, np.arange(T))
        coords[f"{axis}_kind"] = (axis, kinds)
        coords[f"{axis}_patch_row"] = (axis, rows)
        coords[f"{axis}_patch_col"] = (axis, cols)
    data = {
        "act": (("layer", "site", "token", "channel"), act),
        "grad": (("target", "layer", "site", "token", "channel"), grad),
        "attn": (("layer", "head", "query", "key"), attn),
        "attn_grad": (("target", "layer", "head", "query", "key"), attn_grad),
        "logits": (("class",), LOGITS),
        "image": (("y", "x", "rgb"), np.zeros((IMG_H, IMG_W, 3), np.uint8)),
    }
    attrs = {"schema_version": 1, "grid_h": GH, "grid_w": GW, "num_prefix_tokens": 1, "num_heads": NH,
             "head_dim": C // NH, "num_layers": NL, "trace_id": f"handmade-{seed}", "img_height": IMG_H,
             "img_width": IMG_W, "model_name": "handmade", "hook_F1": "blocks.{layer}.norm1:output",
             "hook_F2": "blocks.{layer}.attn.attn_drop:output", "hook_F3": "blocks.{layer}.attn.proj:input"}
    return xr.Dataset(data, coords=coords, attrs=attrs)


def canonical_arrays(seed: int = SEED, **kw) -> dict[str, np.ndarray]:
    """The canonical-order arrays (float64) the reference works from."""
    ds = handmade(seed, **kw)
    return {k: ds[k].values.astype(np.float64) for k in ("act", "grad", "attn", "attn_grad", "logits")}


# --------------------------------------------------------------------------------------------------
# The direct NumPy reference (docs/architecture.md, "Recipes and formulas"), canonical token order: token 0 = CLS,
# 1.. raster

PATCH = np.arange(1, T)
WMASK = {"patch": PATCH, "all": np.arange(T), "cls": np.array([0])}


def relu(x):
    return np.maximum(x, 0)


def ref_target_grad(g: np.ndarray, logits: np.ndarray, target: str, cls_pos: int) -> np.ndarray:
    """g: (target, ...) -> the gradient of the recipe's scalar (derived for prob/logprob)."""
    gc, ge = g[cls_pos], g[E_POS]
    if target == "logit":
        return gc
    if target == "logprob":
        return gc - ge
    p = np.exp(logits - logits.max())
    p /= p.sum()
    cls = TRACED[cls_pos]
    return p[cls] * (gc - ge)


def ref_map(A: np.ndarray, G: np.ndarray, weighting: str, wtok: str = "patch") -> np.ndarray:
    """(T, K) activations and gradients -> map over the patch tokens (P,)."""
    w = WMASK[wtok]
    Ap, Gp = A[PATCH], G[PATCH]
    if weighting == "gradcam":
        return Ap @ G[w].mean(0)
    if weighting == "hirescam":
        return (Gp * Ap).sum(1)
    if weighting == "gradcam_elementwise":
        return relu(Gp * Ap).sum(1)
    if weighting == "gradcampp":
        Gw, S = G[w], A[w].sum(0)
        den = 2 * Gw**2 + S * Gw**3 + 1e-6
        assert np.all(np.abs(den[Gw != 0]) > 1e-2), "hand-made data must keep Grad-CAM++ well conditioned"
        a = np.where(Gw != 0, Gw**2 / den, 0)
        return Ap @ (relu(Gw) * a).sum(0)
    if weighting == "xgradcam":
        Gw, Aw = G[w], A[w]
        return Ap @ (Gw * Aw / (Aw.sum(0) + 1e-7)).sum(0)
    if weighting == "layercam":
        return (relu(Gp) * Ap).sum(1)
    if weighting in ("eigencam", "eigengradcam"):
        X = Ap if weighting == "eigencam" else Gp * Ap
        X = X - X.mean(0)
        _, s, vt = np.linalg.svd(X)
        assert s[0] - s[1] > 1e-3 * s[0], "first singular vector must be well defined"
        proj = X @ vt[0]
        mag = np.sort(np.abs(proj))
        assert mag[-1] - mag[-2] > 1e-6, "the largest-|value| token must be unique"
        return proj if proj[np.abs(proj).argmax()] > 0 else -proj
    if weighting == "gradient":
        return Gp.sum(1)
    raise AssertionError(weighting)


def ref_heads(per_head: list[np.ndarray], rule) -> np.ndarray:
    if isinstance(rule, int):
        return per_head[rule]
    stack = np.stack(per_head)
    return {"channels": stack.sum(0), "mean_then_relu": stack.mean(0), "relu_then_mean": relu(stack).mean(0),
            "max": stack.max(0)}[rule]


def ref_rows(x: np.ndarray, rows: str) -> np.ndarray:
    """x: (..., query, key) -> (..., key)."""
    return {"cls": x[..., 0, :], "mean": x.mean(-2), "patch_mean": x[..., PATCH, :].mean(-2)}[rows]


def ref_raw(arr: dict, *, site="F1", layer=1, target="logit", cls_pos=TOP1_POS, weighting="gradcam",
            wtok="patch", heads="channels", rows="cls") -> np.ndarray:
    """The raw signed map of one layer on the (GH, GW) grid (canonical raster order)."""
    if site == "F2":
        A = ref_rows(arr["attn"][layer], rows)                       # (H, T)
        G = ref_rows(ref_target_grad(arr["attn_grad"][:, layer], arr["logits"], target, cls_pos), rows)
        if heads == "channels":   # heads are the channels k, key tokens the tokens t
            per_head = [ref_map(A.T, G.T, weighting, wtok)]
        else:
            per_head = [ref_map(A[h][:, None], G[h][:, None], weighting, wtok) for h in range(NH)]
    else:
        s = ["F1", "F3"].index(site)
        A = arr["act"][layer, s]
        G = ref_target_grad(arr["grad"][:, layer, s], arr["logits"], target, cls_pos)
        if site == "F3" and heads != "channels":
            d = C // NH
            per_head = [ref_map(A[:, h * d:(h + 1) * d], G[:, h * d:(h + 1) * d], weighting, wtok)
                        for h in range(NH)]
        else:
            per_head = [ref_map(A, G, weighting, wtok)]
    return ref_heads(per_head, heads if len(per_head) > 1 else "channels").reshape(GH, GW)


def minmax(x):
    span = x.max() - x.min()
    return (x - x.min()) / span if span > 0 else np.zeros_like(x)


def torch_resize(grid: np.ndarray, mode: str = "bilinear", size=(IMG_H, IMG_W)) -> np.ndarray:
    kw = {} if mode == "nearest" else {"align_corners": False}
    t = torch.from_numpy(np.ascontiguousarray(grid, dtype=np.float64))[None, None]
    return F.interpolate(t, size=size, mode=mode, **kw)[0, 0].numpy()


def raw_cam(tr, **fields) -> np.ndarray:
    m = vc.cam(tr, vc.Recipe(relu="none", normalize="none", **fields), grid=True)
    assert m.dims == ("patch_row", "patch_col")
    return m.values


def close(got, want, rtol=1e-5, nontrivial=True):
    want = np.asarray(want, np.float64)
    if nontrivial:   # a constant expected map would let a wrong implementation pass
        assert np.ptp(want) > 0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(1.0, np.abs(want).max()))


@pytest.fixture(scope="module")
def hm():
    return handmade(SEED)


@pytest.fixture(scope="module")
def arr():
    return canonical_arrays(SEED)


# --------------------------------------------------------------------------------------------------
# Weighting formulas, head rules, attention rows, targets


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("site", ["F1", "F3"])
@pytest.mark.parametrize("layer", [0, -1])
def test_weighting_formulas_token_sites(hm, arr, weighting, site, layer):
    got = raw_cam(hm, site=site, layer=layer, weighting=weighting)
    close(got, ref_raw(arr, site=site, layer=layer % NL, weighting=weighting), rtol=1e-4)


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


# --------------------------------------------------------------------------------------------------
# Degenerate variants


def _cam_warns(tr, r, **kw):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        m = vc.cam(tr, r, **kw)
    return m, [w for w in rec if issubclass(w.category, vc.DegenerateMapWarning)]


@pytest.mark.parametrize("fields", [
    {"site": "F3", "layer": 1}, {"site": "F3", "layer": 1, "weighting": "layercam"},
    {"site": "F3", "layer": 1, "weighting": "eigengradcam"}, {"site": "F3", "layer": 1, "heads": "max"},
    {"site": "F2", "layer": 1, "attn_rows": "patch_mean"},
])
def test_zero_gradient_is_degenerate(fields):
    tr = handmade(SEED, zero_patch_grad=(1, fields["site"]))
    for normalize in ("minmax", "max", "none"):
        m, ws = _cam_warns(tr, vc.Recipe(normalize=normalize, **fields))
        assert ws, "a DegenerateMapWarning is expected"
        assert m.attrs["degenerate"] and "zero" in m.attrs["degenerate"]
        assert np.all(np.isfinite(m.values)) and np.all(m.values == 0)


def test_zero_patch_gradient_but_cls_weights_is_fine():
    tr = handmade(SEED, zero_patch_grad=(1, "F3"))
    m, ws = _cam_warns(tr, vc.Recipe(site="F3", layer=1, weight_tokens="cls"))
    assert not ws and m.attrs["degenerate"] == "" and m.values.max() == 1
    m, ws = _cam_warns(tr, vc.Recipe(site="F3", layer=1, weighting="eigencam"))  # gradient-free
    assert not ws and m.attrs["degenerate"] == ""
    m, ws = _cam_warns(handmade(SEED, zero_patch_grad=(1, "F2")), vc.Recipe(site="F2", layer=1))  # CLS row is fine
    assert not ws and m.attrs["degenerate"] == ""


def test_constant_map_after_relu_is_degenerate(hm):
    # flip the sign of layer 1's activations where the hirescam map is positive -> all <= 0 -> ReLU kills it
    tr = hm.copy(deep=True)
    act = tr["act"].values
    act[1, 0] = -np.abs(act[1, 0])
    grad = tr["grad"].values
    grad[:, 1, 0] = np.abs(grad[:, 1, 0])
    tr = tr.assign(act=(tr["act"].dims, act), grad=(tr["grad"].dims, grad))
    m, ws = _cam_warns(tr, vc.Recipe(weighting="hirescam", layer=1))
    assert ws and m.attrs["degenerate"] and np.all(m.values == 0)
    m, ws = _cam_warns(tr, vc.Recipe(weighting="hirescam", layer=1, relu="none"))   # the signed map is fine
    assert not ws and m.values.max() == 1


def test_fusion_with_one_degenerate_layer(arr):
    tr = handmade(SEED, zero_patch_grad=(1, "F1"))
    m, ws = _cam_warns(tr, vc.Recipe(weighting="hirescam", layer="all", layer_fusion="mean"))
    assert not ws and m.attrs["degenerate"] == ""
    assert "layer 1" in m.attrs["degenerate_layers"]
    want = minmax(relu(ref_raw(arr, layer=0, weighting="hirescam")))   # layer 1 contributes zeros
    close(vc.cam(tr, vc.Recipe(weighting="hirescam", layer="all", layer_fusion="mean"), grid=True).values, want)


def test_all_layers_degenerate_fusion():
    tr = handmade(SEED, zero_patch_grad=(1, "F1"))
    grad = tr["grad"].values.copy()
    grad[:, :, 0, 1:] = 0
    tr = tr.assign(grad=(tr["grad"].dims, grad))
    m, ws = _cam_warns(tr, vc.Recipe(weighting="hirescam", layer="all", layer_fusion="sum"))
    assert ws and m.attrs["degenerate"] and np.all(m.values == 0)


# --------------------------------------------------------------------------------------------------
# Refusals: the field is named, never IndexError / KeyError


def test_bad_trace_inputs(hm):
    with pytest.raises(TypeError, match="trace"):
        vc.cam({"act": 1}, vc.Recipe())
    with pytest.raises(TypeError, match="recipe"):
        vc.cam(hm, "F1")
    with pytest.raises(TypeError, match="grid"):
        vc.cam(hm, vc.Recipe(), grid="yes")
    with pytest.raises(ValueError, match="schema_version"):
        vc.cam(hm.assign_attrs(schema_version=2), vc.Recipe())
    no_version = hm.copy()
    del no_version.attrs["schema_version"]
    with pytest.raises(ValueError, match="schema_version"):
        vc.cam(no_version, vc.Recipe())


@pytest.mark.parametrize("fields, field", [
    ({"layer": 2}, "layer"), ({"layer": -3}, "layer"), ({"layer": (0, 5), "layer_fusion": "mean"}, "layer"),
    ({"site": "F4"}, "site"), ({"site": "resid_pre"}, "site"),
    ({"site": "F3", "heads": 2}, "heads"), ({"site": "F2", "heads": 5}, "heads"),
    ({"class_": 2}, "class_"), ({"class_": 99}, "class_"), ({"class_": "top9"}, "class_"),
])
def test_bad_recipe_for_this_trace(hm, fields, field):
    with pytest.raises(vc.RecipeError) as e:
        vc.cam(hm, vc.Recipe(**fields))
    assert str(e.value).startswith(field)


def test_layer_not_traced():
    tr = handmade(SEED).isel(layer=[1])
    vc.cam(tr, vc.Recipe(layer=-1))
    with pytest.raises(vc.RecipeError, match="layer.*not traced"):
        vc.cam(tr, vc.Recipe(layer=0))


def test_site_not_traced(hm):
    tr = hm.drop_vars(["attn", "attn_grad"])
    with pytest.raises(vc.RecipeError, match="^site"):
        vc.cam(tr, vc.Recipe(site="F2"))
    with pytest.raises(vc.RecipeError, match="^site"):
        vc.cam(tr, vc.presets.attention_rollout())
    tr = hm.drop_vars(["act", "grad"]).drop_dims(["site", "channel"])
    vc.cam(tr, vc.Recipe(site="F2"))
    with pytest.raises(vc.RecipeError, match="^site"):
        vc.cam(tr, vc.Recipe(site="F1"))


def test_keyword_fields_and_unknown_field(hm):
    a = vc.cam(hm, site="F3", weighting="layercam")
    b = vc.cam(hm, vc.Recipe(site="F3", weighting="layercam"))
    np.testing.assert_array_equal(a.values, b.values)
    c = vc.cam(hm, vc.Recipe(), site="F3", weighting="layercam")
    np.testing.assert_array_equal(a.values, c.values)
    with pytest.raises((TypeError, ValueError), match="colour"):
        vc.cam(hm, colour="red")
    with pytest.raises((TypeError, ValueError), match="colour"):
        vc.cam(hm, vc.Recipe(), colour="red")


def test_attn_rows_cls_without_cls_token(hm):
    tr = hm.assign_coords(token_kind=("token", np.array(["reg"] + ["patch"] * P)))
    tr = tr.assign_coords(query_kind=("query", tr.token_kind.values), key_kind=("key", tr.token_kind.values))
    with pytest.raises(vc.RecipeError, match="^attn_rows"):
        vc.cam(tr, vc.Recipe(site="F2"))
    with pytest.raises(vc.RecipeError, match="^weight_tokens"):
        vc.cam(tr, vc.Recipe(weight_tokens="cls"))
    vc.cam(tr, vc.Recipe(site="F2", attn_rows="patch_mean"))


# --------------------------------------------------------------------------------------------------
# Real model: derived gradients against autograd, attrs, degenerate last block, Chefer baseline, gallery


@pytest.fixture(scope="module")
def real():
    from vitcam_testing import make_input, make_model

    torch.manual_seed(0)
    model, x = make_model("vit"), make_input("vit")
    return model, x, vc.trace(model, x, targets="top3")


@pytest.mark.parametrize("target", ["logit", "prob", "logprob"])
@pytest.mark.parametrize("class_", ["top1", "top2"])
def test_derived_gradients_match_autograd(real, target, class_):
    model, x, tr = real
    store = {}
    handle = model.blocks[1].norm1.register_forward_hook(lambda _m, _i, out: store.setdefault("a", out))
    try:
        z = model(x)[0]
    finally:
        handle.remove()
    c = int(torch.argsort(z, descending=True)[int(class_[3:]) - 1])
    scalar = {"logit": z[c], "prob": torch.softmax(z, 0)[c], "logprob": torch.log_softmax(z, 0)[c]}[target]
    (g,) = torch.autograd.grad(scalar, store["a"])
    want = g[0, 1:].sum(-1).reshape(4, 4).numpy()
    got = raw_cam(tr, site="F1", layer=1, target=target, class_=class_, weighting="gradient")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_attrs_of_a_map(real):
    _, _, tr = real
    r = vc.Recipe(site="F4", layer=0, weighting="layercam")
    m = vc.cam(tr, r)
    assert m.dims == ("y", "x") and m.shape == (32, 32) and m.dtype == np.float32
    assert m.attrs["recipe"] == r.to_json() and m.attrs["recipe_id"] == r.id
    assert m.attrs["trace_id"] == tr.attrs["trace_id"] and m.attrs["degenerate"] == ""
    assert vc.Recipe.from_json(m.attrs["recipe"]) == r
    import json

    checklist = json.loads(m.attrs["checklist"])
    for cat in ("feature representation", "gradient target", "token handling", "aggregation",
                "spatial reconstruction"):
        assert cat in checklist


@pytest.mark.parametrize("site", ["F3", "F4", "F5", "F6"])
def test_last_block_cls_pooling_degenerate(real, site):
    _, _, tr = real
    assert not np.any(tr["grad"].sel(layer=2, site=site).values[..., 1:, :])   # the premise: zero gradients
    for weighting in ("gradcam", "hirescam", "layercam", "gradcampp", "xgradcam", "eigengradcam", "gradient"):
        m, ws = _cam_warns(tr, vc.Recipe(site=site, layer=-1, weighting=weighting))
        assert ws and m.attrs["degenerate"], (site, weighting)
        assert np.all(m.values == 0)
    # with CLS weights the map is a real map; EigenCAM uses no gradient
    for fields in ({"weight_tokens": "cls"}, {"weighting": "eigencam"}):
        m, ws = _cam_warns(tr, vc.Recipe(site=site, layer=-1, **fields))
        assert not ws and m.attrs["degenerate"] == "" and m.values.max() == 1


def test_last_block_F2_only_cls_row_has_gradient(real):
    _, _, tr = real
    m, ws = _cam_warns(tr, vc.Recipe(site="F2", layer=-1, attn_rows="patch_mean"))
    assert ws and m.attrs["degenerate"] and np.all(m.values == 0)
    m, ws = _cam_warns(tr, vc.Recipe(site="F2", layer=-1))
    assert not ws and m.values.max() == 1


def test_chefer_attention_gradcam_real(real):
    _, _, tr = real
    c = int(np.argmax(tr["logits"].values))
    A = tr["attn"].isel(layer=-1).values[:, 0, 1:].astype(np.float64)                   # (head, patch key)
    G = tr["attn_grad"].sel(target=f"logit_{c}").isel(layer=-1).values[:, 0, 1:].astype(np.float64)
    want = minmax(relu((A * G.mean(-1, keepdims=True)).mean(0))).reshape(4, 4)
    got = vc.cam(tr, vc.presets.chefer_attention_gradcam(), grid=True)
    np.testing.assert_allclose(got.values, want, atol=1e-5)
    assert got.attrs["degenerate"] == ""


SITES_ALL = ["F1", "F2", "F3", "F4", "F5", "F6"]


def _quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        return fn(*a, **k)


@pytest.mark.parametrize("base", [vc.Recipe(), vc.Recipe(weighting="hirescam", upsample="none"),
                                  vc.Recipe(weighting="eigencam", relu="none", normalize="max"),
                                  vc.Recipe(target="prob", class_="top2", upsample="bicubic")])
def test_gallery_layers_and_sites_equal_individual_cams(real, base):
    _, _, tr = real
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        g = vc.gallery(tr, base, vary={"layer": "all", "site": SITES_ALL})
    assert g.dims[:2] == ("layer", "site") and g.shape[:2] == (3, 6)
    assert list(g.site.values) == SITES_ALL and list(g.layer.values) == [0, 1, 2]
    any_degenerate = False
    for layer in range(3):
        for site in SITES_ALL:
            r = base.replace(layer=layer, site=site)
            m = _quiet(vc.cam, tr, r)
            cell = g.sel(layer=layer, site=site)
            np.testing.assert_allclose(cell.values, m.values, atol=1e-6, err_msg=f"{site}@{layer}")
            assert str(cell.recipe_id.values) == r.id
            assert str(cell.degenerate.values) == m.attrs["degenerate"], f"{site}@{layer}"
            any_degenerate |= bool(m.attrs["degenerate"])
    if any_degenerate:
        assert any(issubclass(w.category, vc.DegenerateMapWarning) for w in rec)


@pytest.mark.parametrize("sites", [["F1", "F3", "F4", "F5", "F6"], ["F6", "F4", "F1"], ["F3", "F5"]])
def test_gallery_maps_are_bitwise_the_cams_whichever_way_the_sites_are_batched(real, sites):
    # Consecutive stored sites go through the pipeline as one view, others one site at a time; every map must
    # be the one vc.cam computes for its recipe alone, bit for bit.
    _, _, tr = real
    g = _quiet(vc.gallery, tr, vc.Recipe(), vary={"layer": "all", "site": sites})
    for layer in range(3):
        for site in sites:
            m = _quiet(vc.cam, tr, vc.Recipe(layer=layer, site=site))
            np.testing.assert_array_equal(g.sel(layer=layer, site=site).values, m.values, err_msg=f"{site}@{layer}")


def test_gallery_other_fields(real):
    _, _, tr = real
    vary = {"weighting": ["gradcam", "layercam", "eigencam"], "target": ["logit", "prob", "logprob"],
            "class_": ["top1", 0]}
    tr_classes = [int(c) for c in tr.target_class.values if c >= 0]
    if 0 not in tr_classes:
        vary["class_"] = ["top1", tr_classes[-1]]
    g = _quiet(vc.gallery, tr, vc.Recipe(site="F1", layer=1), vary=vary)
    assert g.dims == ("weighting", "target", "class_", "y", "x")
    for w in vary["weighting"]:
        for t in vary["target"]:
            for c in vary["class_"]:
                m = _quiet(vc.cam, tr, vc.Recipe(site="F1", layer=1, weighting=w, target=t, class_=c))
                np.testing.assert_allclose(g.sel(weighting=w, target=t, class_=c).values, m.values, atol=1e-6)


def test_gallery_with_layer_fusion_varying_site(real):
    _, _, tr = real
    base = vc.Recipe(layer=(0, 1), layer_fusion="mean")
    g = _quiet(vc.gallery, tr, base, vary={"site": ["F1", "F2", "F4"], "layer_fusion": ["mean", "max"]})
    for s in ["F1", "F2", "F4"]:
        for f in ["mean", "max"]:
            m = _quiet(vc.cam, tr, base.replace(site=s, layer_fusion=f))
            np.testing.assert_allclose(g.sel(site=s, layer_fusion=f).values, m.values, atol=1e-6)


def test_gallery_refusals(real):
    _, _, tr = real
    with pytest.raises(vc.RecipeError, match="colour"):
        vc.gallery(tr, vc.Recipe(), vary={"colour": ["red"]})
    with pytest.raises(vc.RecipeError, match="vary"):
        vc.gallery(tr, vc.Recipe(), vary={"weighting": []})
    with pytest.raises(vc.RecipeError, match="heads"):
        vc.gallery(tr, vc.Recipe(), vary={"heads": ["max"]})   # heads on F1 is meaningless
    with pytest.raises(vc.RecipeError, match="site"):
        vc.gallery(tr, vc.Recipe(), vary={"site": ["F1", "resid_pre"]})   # not traced
    with pytest.raises(vc.RecipeError, match="layer"):
        vc.gallery(tr, vc.Recipe(), vary={"layer": [0, 9]})   # out of range
    with pytest.raises(vc.RecipeError, match="vary"):
        vc.gallery(tr, vc.Recipe(), vary={"layer": 1})        # not a list
    with pytest.raises(vc.RecipeError, match="vary"):
        vc.gallery(tr, vc.presets.attention_rollout(), vary={"layer": "all"})
    with pytest.raises(TypeError, match="recipe"):
        vc.gallery(tr, "F1")


def test_gallery_field_names_mean_all(real):
    _, _, tr = real
    g = _quiet(vc.gallery, tr, vc.Recipe(layer=0))
    assert g.dims[:2] == ("layer", "site") and list(g.layer.values) == [0, 1, 2]
    assert set(g.site.values) == set(SITES_ALL)
    m = _quiet(vc.cam, tr, vc.Recipe(layer=1, site="F2"))
    np.testing.assert_allclose(g.sel(layer=1, site="F2").values, m.values, atol=1e-6)


@pytest.mark.parametrize("fusion", ["rollout", "grad_rollout"])
def test_rollout_goes_in_block_order_whatever_the_tuple_order(hm, arr, fusion):
    want = ref_rollout(arr, fusion == "grad_rollout")
    for layer in ((0, 1), (1, 0), (-1, 0), "all"):
        close(raw_cam(hm, site="F2", layer=layer, layer_fusion=fusion), want)



def test_a_block_named_twice_through_a_negative_index_is_refused(real):
    _, _, tr = real
    n = int(tr.attrs["num_layers"])
    with pytest.raises(vc.RecipeError, match=r"^layer: .*twice"):
        vc.cam(tr, vc.Recipe(layer=(0, -n), layer_fusion="mean"))


def test_gallery_over_sites_without_a_cls_token_reads_f2_by_mean_rows():
    import timm

    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                          embed_dim=32, num_heads=2, num_classes=4, class_token=False, global_pool="avg").eval()
    tr = vc.trace(m, torch.randn(1, 3, 32, 32), targets="top2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        g = vc.gallery(tr, vc.Recipe(), vary={"layer": "all", "site": "all"})
        f2 = vc.cam(tr, vc.Recipe(site="F2", layer=1, attn_rows="mean"))
        f3 = vc.cam(tr, vc.Recipe(site="F3", layer=1))
        back = vc.gallery(tr, vc.Recipe(site="F2", attn_rows="patch_mean"), vary={"site": ["F2", "F4"]})
    np.testing.assert_array_equal(g.sel(site="F2", layer=1).values, f2.values)
    np.testing.assert_array_equal(g.sel(site="F3", layer=1).values, f3.values)
    assert g.recipe_id.sel(site="F2", layer=1).item() == f2.attrs["recipe_id"]
    assert back.recipe_id.values[0] == vc.Recipe(site="F2", attn_rows="patch_mean").id
    assert back.recipe_id.values[1] == vc.Recipe(site="F4").id
