"""The tokentm preset (issue #34 item 2) equals an independent NumPy float64 re-implementation of TokenTM as the
LibraGrad authors' code computes it (transform_TokenTM), written with explicit update matrices, on tiny traces of
two families (1e-6); its transformation weights equal hand-computed known answers; it reads every block in forward
order and refuses a trace without its sites, or rows it does not define, by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb.compute.tokentm import transformation_weights
from vitcam_nb.core.errors import RecipeError

SITES = ["F2", "resid_pre", "resid_mid", "F6"]


def _weights(u: np.ndarray, y: np.ndarray) -> np.ndarray:
    """W = L(E~) / (L(E) + 1e-8) * softmax over tokens of cos(E, E~), as transform_TokenTM's W_compute."""
    lu, ly = np.sqrt((u ** 2).sum(1)), np.sqrt((y ** 2).sum(1))
    cos = (u * y).sum(1) / (lu * ly)
    return ly / (lu + 1e-8) * np.exp(cos) / np.exp(cos).sum()


def _reference(tr, cls: int, rows: str = "cls") -> np.ndarray:
    """C_0 = diag(L(x)) of the first block's input; per block U_attn = I + (mean_h A) diag(W_attn) (.) mean_h
    relu(dA), U_mlp = I + diag(W_mlp), C_l = U_mlp U_attn C_(l-1); W_attn of resid_pre -> resid_mid, W_mlp of
    resid_mid -> F6; the map is C's CLS row (or mean row) at the patch columns."""
    def site(layer, name):
        return tr["act"].sel(layer=layer, site=name).values.astype(np.float64)

    layers = sorted(int(v) for v in tr["layer"].values)
    C = np.diag(np.sqrt((site(layers[0], "resid_pre") ** 2).sum(1)))
    eye = np.eye(len(C))
    for layer in layers:
        A = tr["attn"].sel(layer=layer).values.astype(np.float64)
        G = tr["attn_grad"].sel(layer=layer, target=f"logit_{cls}").values.astype(np.float64)
        pre, mid, out = site(layer, "resid_pre"), site(layer, "resid_mid"), site(layer, "F6")
        u_attn = eye + (A.mean(0) @ np.diag(_weights(pre, mid))) * np.clip(G, 0, None).mean(0)
        u_mlp = eye + np.diag(_weights(mid, out))
        C = u_mlp @ u_attn @ C
    kinds = tr["token_kind"].values
    row = C[list(kinds).index("cls")] if rows == "cls" else C.mean(0)
    patch = kinds == "patch"
    grid = np.zeros((int(tr.attrs["grid_h"]), int(tr.attrs["grid_w"])))
    grid[tr["patch_row"].values[patch], tr["patch_col"].values[patch]] = row[patch]
    return grid


def test_transformation_weights_known_answer():
    # lengths x2 and x3, directions kept and reversed: cosines 1 and -1, softmax 1/(1+e^-2) and 1/(1+e^2)
    u = np.array([[1.0, 0.0], [0.0, 1.0]])
    y = np.array([[2.0, 0.0], [0.0, -3.0]])
    expected = [2 / (1 + 1e-8) / (1 + math.exp(-2)), 3 / (1 + 1e-8) / (1 + math.exp(2))]
    np.testing.assert_allclose(transformation_weights(u, y), expected, rtol=1e-12)
    # the softmax sums to 1 over the tokens: with unchanged tokens each weight is 1/N (up to the 1e-8)
    x = np.random.default_rng(0).normal(size=(5, 4))
    np.testing.assert_allclose(transformation_weights(x, x), np.full(5, 0.2), rtol=1e-7)


@pytest.mark.parametrize(("name", "family"), [("vit_tiny_patch16_224", "vit"), ("beit_base_patch16_224", "beit")])
def test_tokentm_equals_the_numpy_reference(name, family):
    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=5, embed_dim=48,
                          num_heads=3).eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    tr = vc.trace(m, x, targets=[1, 3], sites=SITES)
    assert tr.attrs["model_family"] == family
    raw = vc.presets.tokentm().replace(class_=3, upsample="none", normalize="none")
    ours = vc.cam(tr, raw).values
    ref = _reference(tr, 3)
    assert np.ptp(ref) > 0
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    mean_rows = vc.cam(tr, raw.replace(attn_rows="mean", class_=1)).values
    ref_mean = _reference(tr, 1, "mean")
    np.testing.assert_allclose(mean_rows, ref_mean, rtol=1e-6, atol=1e-6 * np.abs(ref_mean).max())
    # the preset as published: min-max of the bilinear upsampling; its checklist names whose formula it is
    full = vc.cam(tr, vc.presets.tokentm().replace(class_=3))
    assert full.shape == (32, 32) and float(full.max()) == pytest.approx(1.0)
    assert "TokenTM (as LibraGrad's code computes it)" in full.attrs["checklist"]
    assert "product over the listed blocks" in full.attrs["checklist"]


def test_one_block_and_refusals():
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)
    tr = vc.trace(m, img, targets="top1", sites=SITES, layers=[1])
    top = int(tr["target_class"].values[0])
    ours = vc.cam(tr, vc.presets.tokentm(layer=1).replace(upsample="none", normalize="none")).values
    ref = _reference(tr, top)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    thin = vc.trace(m, img, targets="top1", sites=["F2", "resid_pre"])
    lacks = r"^weighting: tokentm reads sites .* lacks \['resid_mid', 'F6'\]"
    with pytest.raises(RecipeError, match=lacks):
        vc.cam(thin, vc.presets.tokentm())
    with pytest.raises(RecipeError, match="^attn_rows:"):
        vc.cam(tr, vc.presets.tokentm(layer=1, attn_rows="patch_mean"))


def test_a_model_without_cls_is_refused_for_the_cls_row_and_read_by_the_mean_row():
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                          class_token=False, global_pool="avg", num_classes=4).eval()
    img = np.random.default_rng(1).integers(0, 256, (32, 32, 3), np.uint8)
    tr = vc.trace(m, img, targets=[2], sites=SITES)
    with pytest.raises(RecipeError, match=r"^attn_rows='cls': tokentm .* no CLS token; use attn_rows='mean'"):
        vc.cam(tr, vc.presets.tokentm().replace(class_=2))
    ours = vc.cam(tr, vc.presets.tokentm(attn_rows="mean").replace(class_=2, upsample="none", normalize="none")).values
    ref = _reference(tr, 2, "mean")
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
