"""Cross-library agreement for Swin (issue #18): a tiny random timm Swin and the Hugging Face
``SwinForImageClassification`` carrying the same weights (the state dict converted here by an explicit key
mapping) give the same hierarchical trace at every site, the same window attention and window keys, and the
same map for every preset a Swin trace takes."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import timm
import torch
from vitcam_testing import assert_rel_close

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

SITES = ["F1", "F2", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid"]
DEPTHS, HEADS, DIM, IMG, WINDOW = (2, 2), (2, 4), 16, 64, 4


def make_timm_swin() -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=IMG, window_size=WINDOW,
                              depths=DEPTHS, num_heads=HEADS, embed_dim=DIM, num_classes=5).eval()
    with torch.no_grad():  # sharper attention and a visible position bias, so windows and shifts matter
        for n, p in model.named_parameters():
            if n.endswith("qkv.weight"):
                p.mul_(8.0)
            if n.endswith("relative_position_bias_table"):
                p.copy_(torch.randn_like(p))
    return model


def timm_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm SwinTransformer names -> transformers SwinForImageClassification names. timm merges patches at the
    start of stage s, transformers at the end of stage s - 1; timm's qkv is split into q, k, v."""
    out = {"swin.embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
           "swin.embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
           "swin.embeddings.norm.weight": sd["patch_embed.norm.weight"],
           "swin.embeddings.norm.bias": sd["patch_embed.norm.bias"],
           "swin.layernorm.weight": sd["norm.weight"], "swin.layernorm.bias": sd["norm.bias"],
           "classifier.weight": sd["head.fc.weight"], "classifier.bias": sd["head.fc.bias"]}
    for s, depth in enumerate(DEPTHS):
        if s > 0:
            for name in ("norm.weight", "norm.bias", "reduction.weight"):
                out[f"swin.encoder.layers.{s - 1}.downsample.{name}"] = sd[f"layers.{s}.downsample.{name}"]
        for b in range(depth):
            src, dst = f"layers.{s}.blocks.{b}", f"swin.encoder.layers.{s}.blocks.{b}"
            for a, h in (("norm1", "layernorm_before"), ("norm2", "layernorm_after"), ("attn.proj", "attention.o_proj"),
                         ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
                out[f"{dst}.{h}.weight"], out[f"{dst}.{h}.bias"] = sd[f"{src}.{a}.weight"], sd[f"{src}.{a}.bias"]
            for kind in ("weight", "bias"):
                q, k, v = sd[f"{src}.attn.qkv.{kind}"].chunk(3, dim=0)
                for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    out[f"{dst}.attention.{name}.{kind}"] = t
            out[f"{dst}.attention.relative_position_bias.relative_position_bias_table"] = \
                sd[f"{src}.attn.relative_position_bias_table"]
    return out


@pytest.fixture(scope="module")
def pair():
    timm_model = make_timm_swin()
    cfg = transformers.SwinConfig(image_size=IMG, patch_size=4, embed_dim=DIM, depths=list(DEPTHS),
                                  num_heads=list(HEADS), window_size=WINDOW, num_labels=5, mlp_ratio=4.0,
                                  qkv_bias=True, hidden_act="gelu", layer_norm_eps=1e-5)
    hf = transformers.SwinForImageClassification(cfg).eval()
    missing, unexpected = hf.load_state_dict(timm_to_hf(timm_model.state_dict()), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    x = torch.randn(1, 3, IMG, IMG, generator=torch.Generator().manual_seed(1))
    return (vc.trace(timm_model, x, targets="top3", sites=SITES), vc.trace(hf, x, targets="top3", sites=SITES))


def test_same_trace_at_every_site_and_window(pair):
    t_timm, t_hf = pair
    assert (t_timm.attrs["model_family"], t_hf.attrs["model_family"]) == ("swin", "hf_swin")
    assert_rel_close(t_hf["logits"].values, t_timm["logits"].values, "logits")
    assert sorted(t_hf.children) == sorted(t_timm.children)
    for stage in t_timm.children:
        a, b = t_timm[stage].to_dataset(), t_hf[stage].to_dataset()
        for attr in ("grid_h", "grid_w", "num_heads", "head_dim", "stage_dim", "stage_first_layer"):
            assert a.attrs[attr] == b.attrs[attr], (stage, attr)
        np.testing.assert_array_equal(b["attn_window_key"].values, a["attn_window_key"].values)
        for layer in a["layer"].values:
            assert_rel_close(b["attn_window"].sel(layer=layer).values, a["attn_window"].sel(layer=layer).values,
                             f"F2@{layer}")
            assert_rel_close(b["attn_window_grad"].sel(layer=layer).values,
                             a["attn_window_grad"].sel(layer=layer).values, f"F2 grad@{layer}")
            for site in [s for s in SITES if s != "F2"]:
                what = f"{site}@{layer}"
                assert_rel_close(b["act"].sel(layer=layer, site=site).values,
                                 a["act"].sel(layer=layer, site=site).values, what)
                assert_rel_close(b["grad"].sel(layer=layer, site=site).values,
                                 a["grad"].sel(layer=layer, site=site).values, f"{what} grad")


@pytest.mark.parametrize("preset", vc.presets.names())
def test_same_map_for_every_preset(pair, preset):
    t_timm, t_hf = pair
    recipe = vc.presets.get(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)  # degenerate in both or in neither: compared
        try:
            a = vc.cam(t_timm, recipe)
        except (vc.RecipeError, vc.TraceError) as exc:  # a preset Swin traces do not take is refused alike
            with pytest.raises(type(exc)):
                vc.cam(t_hf, recipe)
            return
        b = vc.cam(t_hf, recipe)
    assert a.dims == b.dims and a.shape == b.shape
    assert np.ptp(a.values) > 0, f"{preset}: a constant map would agree trivially"
    np.testing.assert_allclose(b.values, a.values, rtol=0, atol=1e-5, err_msg=preset)
