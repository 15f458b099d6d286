"""Cross-library agreement (issue #18): a timm model and the Hugging Face model carrying the same weights (the state
dict converted here, by hand) give the same trace values at every site and the same map for every preset."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from vitcam_testing import SPECS, assert_rel_close, make_input, make_model, plain_presets, traced

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

SITES = ["F1", "F2", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid"]


def timm_to_hf(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """timm VisionTransformer(Distilled) state dict -> transformers ViT / DeiT names (qkv split into q, k, v)."""
    sd, out = model.state_dict(), {}
    emb = f"{prefix}.embeddings"
    out[f"{emb}.patch_embeddings.projection.weight"] = sd["patch_embed.proj.weight"]
    out[f"{emb}.patch_embeddings.projection.bias"] = sd["patch_embed.proj.bias"]
    out[f"{emb}.cls_token"] = sd["cls_token"]
    if "dist_token" in sd:
        out[f"{emb}.distillation_token"] = sd["dist_token"]
    out[f"{emb}.position_embeddings"] = sd["pos_embed"]
    for i in range(len(model.blocks)):
        src, dst = f"blocks.{i}", f"{prefix}.layers.{i}"
        for a, b in (("norm1", "layernorm_before"), ("norm2", "layernorm_after"), ("attn.proj", "attention.o_proj"),
                     ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
            out[f"{dst}.{b}.weight"], out[f"{dst}.{b}.bias"] = sd[f"{src}.{a}.weight"], sd[f"{src}.{a}.bias"]
        for kind in ("weight", "bias"):
            q, k, v = sd[f"{src}.attn.qkv.{kind}"].chunk(3, dim=0)
            out[f"{dst}.attention.q_proj.{kind}"], out[f"{dst}.attention.k_proj.{kind}"] = q, k
            out[f"{dst}.attention.v_proj.{kind}"] = v
    out[f"{prefix}.layernorm.weight"], out[f"{prefix}.layernorm.bias"] = sd["norm.weight"], sd["norm.bias"]
    heads = {"classifier": "head"} if "head_dist.weight" not in sd else \
        {"cls_classifier": "head", "distillation_classifier": "head_dist"}
    for dst, src in heads.items():
        out[f"{dst}.weight"], out[f"{dst}.bias"] = sd[f"{src}.weight"], sd[f"{src}.bias"]
    return out


def hf_twin(timm_model: torch.nn.Module, kind: str) -> torch.nn.Module:
    cfg_cls, model_cls, prefix = {
        "vit": ("ViTConfig", "ViTForImageClassification", "vit"),
        "deit_distilled": ("DeiTConfig", "DeiTForImageClassificationWithTeacher", "deit"),
    }[kind]
    blk = timm_model.blocks[0]
    cfg = getattr(transformers, cfg_cls)(
        image_size=SPECS[kind].input_hw[0], patch_size=8, hidden_size=timm_model.embed_dim,
        num_hidden_layers=len(timm_model.blocks), num_attention_heads=blk.attn.num_heads,
        intermediate_size=blk.mlp.fc1.out_features, num_labels=timm_model.num_classes, layer_norm_eps=1e-6,
        hidden_act="gelu", qkv_bias=True)
    hf = getattr(transformers, model_cls)(cfg).eval()
    missing, unexpected = hf.load_state_dict(timm_to_hf(timm_model, prefix), strict=False)
    assert not unexpected and all(name.startswith(f"{prefix}.pooler") for name in missing), (missing, unexpected)
    return hf


@pytest.fixture(scope="module", params=["vit", "deit_distilled"])
def pair(request):
    kind = request.param
    timm_model = make_model(kind)
    hf = hf_twin(timm_model, kind)
    x = make_input(kind)
    targets = "top3"  # the presets differentiate the top-1 class
    return kind, vc.trace(timm_model, x, targets=targets, sites=SITES), vc.trace(hf, x, targets=targets, sites=SITES)


def test_same_trace_values_at_every_site(pair):
    kind, t_timm, t_hf = pair
    assert t_hf.attrs["model_family"] == {"vit": "hf_vit", "deit_distilled": "hf_deit_distilled"}[kind]
    assert_rel_close(t_hf["logits"].values, t_timm["logits"].values, f"{kind} logits")
    assert list(t_hf["token_kind"].values) == list(t_timm["token_kind"].values)
    for site in SITES:
        for layer in t_timm["layer"].values:
            what = f"{kind} {site}@{layer}"
            assert_rel_close(traced(t_hf, site, int(layer)), traced(t_timm, site, int(layer)), what)
            for target in t_timm["target"].values:
                assert_rel_close(traced(t_hf, site, int(layer), str(target)),
                                 traced(t_timm, site, int(layer), str(target)), f"{what} grad {target}")


@pytest.mark.parametrize("preset", plain_presets())
def test_same_map_for_every_preset(pair, preset):
    kind, t_timm, t_hf = pair
    recipe = vc.presets.get(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)  # degenerate in both or in neither: compared
        a, b = vc.cam(t_timm, recipe), vc.cam(t_hf, recipe)
    assert a.dims == b.dims and a.shape == b.shape
    assert np.ptp(a.values) > 0, f"{kind} {preset}: a constant map would agree trivially"
    np.testing.assert_allclose(b.values, a.values, rtol=0, atol=1e-5, err_msg=f"{kind} {preset}")
