"""The tokentm preset (issue #34 item 2) equals a NumPy re-implementation of its stated equations on tiny traces
of two families (1e-5), reads every block in forward order, and refuses a trace without its sites by name."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb.core.errors import RecipeError

SITES = ["F2", "resid_pre", "attn_out", "resid_mid", "F5"]


def _reference(tr, cls: int, rows: str = "cls") -> np.ndarray:
    """TokenTM as the preset's docstring states it, from the trace's raw variables (float64):
    w_i = |y_i|/|u_i| * N exp(cos_i) / sum_j exp(cos_j); C0 = diag(|x_i|) of the first block's input; per block
    C += diag(w_attn) Abar C with Abar = mean_h relu(G_h * A_h); C += diag(w_mlp) C; map = C[cls row, patches]."""
    def site(layer, name):
        return tr["act"].sel(layer=layer, site=name).values.astype(np.float64)

    def weight(u, y):
        nu, ny = np.sqrt((u ** 2).sum(1)), np.sqrt((y ** 2).sum(1))
        cos = (u * y).sum(1) / (nu * ny)
        return ny / nu * len(cos) * np.exp(cos) / np.exp(cos).sum()

    layers = sorted(int(v) for v in tr["layer"].values)
    C = np.diag(np.sqrt((site(layers[0], "resid_pre") ** 2).sum(1)))
    for layer in layers:
        A = tr["attn"].sel(layer=layer).values.astype(np.float64)
        G = tr["attn_grad"].sel(layer=layer, target=f"logit_{cls}").values.astype(np.float64)
        abar = np.clip(G * A, 0, None).mean(0)
        C = C + weight(site(layer, "resid_pre"), site(layer, "attn_out"))[:, None] * (abar @ C)
        C = C + weight(site(layer, "resid_mid"), site(layer, "F5"))[:, None] * C
    kinds = tr["token_kind"].values
    row = C[list(kinds).index("cls")] if rows == "cls" else C.mean(0)
    patch = kinds == "patch"
    grid = np.zeros((int(tr.attrs["grid_h"]), int(tr.attrs["grid_w"])))
    grid[tr["patch_row"].values[patch], tr["patch_col"].values[patch]] = row[patch]
    return grid


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
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    mean_rows = vc.cam(tr, raw.replace(attn_rows="mean", class_=1)).values
    np.testing.assert_allclose(mean_rows, _reference(tr, 1, "mean"), rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # the preset as published: min-max of the bilinear upsampling; named in the checklist with its departure
    full = vc.cam(tr, vc.presets.tokentm().replace(class_=3))
    assert full.shape == (32, 32) and float(full.max()) == pytest.approx(1.0)
    assert "query token" in full.attrs["checklist"] and "product over the listed blocks" in full.attrs["checklist"]


def test_one_block_and_refusals():
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)
    tr = vc.trace(m, img, targets="top1", sites=SITES, layers=[1])
    top = int(tr["target_class"].values[0])
    ours = vc.cam(tr, vc.presets.tokentm(layer=1).replace(upsample="none", normalize="none")).values
    np.testing.assert_allclose(ours, _reference(tr, top), rtol=1e-5, atol=1e-6)
    thin = vc.trace(m, img, targets="top1", sites=["F2", "resid_pre"])
    lacks = r"^weighting: tokentm reads sites .* lacks \['attn_out', 'resid_mid', 'F5'\]"
    with pytest.raises(RecipeError, match=lacks):
        vc.cam(thin, vc.presets.tokentm())
    with pytest.raises(RecipeError, match="^attn_rows:"):
        vc.cam(tr, vc.presets.tokentm(layer=1, attn_rows="patch_mean"))
