"""Issue #34 item 1-3, backward rules as a choice of the trace: conservation is a known answer (with every bias of
the blocks, the final norm and the head zero, as LRP's conservation statement requires; the position embedding
and class token are part of the input at block 0), a plain trace is unchanged, a rule preset refuses a trace made
with another rule, and trace_many records the rule of a store."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb.core.errors import RecipeError

IMG = 32


def _model(zero_bias: bool = True, seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    model = VisionTransformer(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    for name, p in model.named_parameters():
        torch.nn.init.normal_(p, std=0.0 if zero_bias and name.endswith("bias") else 0.3)
    return model.eval()


def _image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (IMG, IMG, 3), dtype=np.uint8)


def _input_relevance(tr: xr.Dataset) -> np.ndarray:
    """sum over tokens and channels of h * dh at the input of block 0, per target."""
    h = tr["act"].sel(site="resid_pre").isel(layer=0).values.astype(np.float64)
    g = tr["grad"].sel(site="resid_pre").isel(layer=0).values.astype(np.float64)
    return (h[None] * g).sum(axis=(1, 2))


@pytest.mark.parametrize("rule", ["cp_lrp", "libragrad"])
def test_cp_lrp_and_libragrad_conserve_the_logit(rule):
    """Attention held constant, LayerNorm's std held constant and GELU's gate held constant leave a network that is
    linear in its input at the evaluated point: the input relevance sums to the target logit (float32 rounding:
    1e-4 relative). With the model's own biases it does not (the biases absorb relevance)."""
    tr = vc.trace(_model(), _image(), targets="top2", sites=["resid_pre"], layers=[0], rule=rule)
    logits = tr["logits"].values[tr["target_class"].values[:2]]
    np.testing.assert_allclose(_input_relevance(tr)[:2], logits, rtol=1e-4)
    biased = vc.trace(_model(zero_bias=False), _image(), targets="top1", sites=["resid_pre"], layers=[0], rule=rule)
    assert abs(_input_relevance(biased)[0] - biased["logits"].values.max()) > 1e-3


def test_attnlrp_conserves_the_logit_up_to_what_its_softmax_rule_absorbs():
    """AttnLRP's uniform rules on q k^T and A V and its identity rules on LayerNorm and GELU are conservative; its
    softmax rule (the gradient, in gradient x input form) is not: it passes sum s*ds on from the sum A*dA it gets.
    So logit = input relevance + sum over blocks of (sum A*dA - sum s*ds), every term read from the trace."""
    tr = vc.trace(_model(), _image(), targets="top2", sites=["resid_pre", "F2", "attn_scores"], rule="attnlrp")
    for t, cls in enumerate(tr["target_class"].values[:2]):
        r_a = (tr["attn"].values * tr["attn_grad"].values[t]).astype(np.float64).sum()
        r_s = (tr["attn_scores"].values * tr["attn_scores_grad"].values[t]).astype(np.float64).sum()
        absorbed = r_a - r_s
        assert abs(absorbed) > 1e-4  # the softmax rule really absorbs here, so the identity is not trivial
        np.testing.assert_allclose(_input_relevance(tr)[t] + absorbed, tr["logits"].values[cls], rtol=1e-4)


def test_a_gradient_trace_is_the_trace_of_before():
    model, img = _model(zero_bias=False), _image()
    plain, named = vc.trace(model, img, targets="top2"), vc.trace(model, img, targets="top2", rule="gradient")
    xr.testing.assert_identical(plain, named)
    assert plain.attrs == named.attrs and "backward_rule" not in plain.attrs
    ruled = vc.trace(model, img, targets="top2", rule="attnlrp")
    assert ruled.attrs["backward_rule"] == "attnlrp" and ruled.attrs["trace_id"] != plain.attrs["trace_id"]
    np.testing.assert_array_equal(ruled["act"].values, plain["act"].values)  # the forward pass is unchanged
    np.testing.assert_array_equal(ruled["logits"].values, plain["logits"].values)


def test_a_rule_preset_refuses_a_trace_of_another_rule_and_states_its_rule():
    model, img = _model(), _image()
    plain = vc.trace(model, img, targets="top1", sites=["resid_pre"], layers=[0])
    with pytest.raises(RecipeError, match=r"cp_lrp reads relevance under backward rule 'cp_lrp', but this trace was "
                                          r"made with rule 'gradient'"):
        vc.cam(plain, vc.presets.cp_lrp())
    tr = vc.trace(model, img, targets="top1", sites=["resid_pre"], layers=[0], rule="cp_lrp")
    with pytest.raises(RecipeError, match="rule='attnlrp'"):
        vc.cam(tr, vc.presets.attnlrp())
    grid = vc.cam(tr, vc.presets.cp_lrp(), grid=True)
    h = tr["act"].sel(site="resid_pre").isel(layer=0).values
    g = tr["grad"].sel(site="resid_pre").isel(layer=0, target=0).values
    np.testing.assert_allclose(grid.values.ravel(), (h * g).sum(-1)[1:], rtol=1e-5)  # patches in raster order
    checklist = vc.Recipe.checklist(vc.presets.cp_lrp(), tr)
    assert checklist["gradient target"]["backward rule"].startswith("cp_lrp: conservative propagation")
    assert "Ali et al. 2022" in checklist["gradient target"]["backward rule"]
    assert "backward rule cp_lrp" in grid.attrs["methods"]
    assert "backward rule" not in vc.Recipe.checklist(vc.Recipe(), plain)["gradient target"]


def test_trace_many_records_the_rule_and_equals_single_traces(tmp_path):
    model, imgs = _model(), [_image(0), _image(1)]
    store = vc.trace_many(model, imgs, tmp_path / "s.zarr", targets="top1", sites=["resid_pre"], layers=[0],
                          batch_size=2, progress=False, rule="libragrad")
    ds = vc.open_traces(store)
    for i, img in enumerate(imgs):
        one = vc.trace(model, img, targets="top1", sites=["resid_pre"], layers=[0], rule="libragrad")
        np.testing.assert_allclose(ds["grad"].isel(image=i).values, one["grad"].values, rtol=1e-5, atol=1e-6)
    assert ds.attrs["backward_rule"] == "libragrad" and '"backward_rule": "libragrad"' in ds.attrs["settings"]
    with pytest.raises(vc.TraceFileError, match="another model or settings"):  # a store holds one rule
        vc.trace_many(model, imgs, store, targets="top1", sites=["resid_pre"], layers=[0], progress=False)


def test_vc_score_refuses_to_integrate_autograd_gradients_into_a_rule_trace():
    model, img = _model(), _image()
    tr = vc.trace(model, img, targets="top1", sites=["F2"], rule="cp_lrp")
    with pytest.raises(vc.TraceError, match="backward rule 'cp_lrp'"):
        vc.score(tr, model, vc.presets.transition_attention_maps(start_layer=-2), img)
