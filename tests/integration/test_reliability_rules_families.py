"""Issue #34 item 1, backward rules on every family that has the modules: on timm EVA, open_clip and Hugging Face
ViT, DeiT, DINOv2 (with registers), CLIP and SigLIP vision towers (all refused by name before), CP-LRP and
LibraGrad conserve the target score, a known answer: with every bias zero (blocks, norms, heads), the attention and
LayerNorm's std held constant and the activation's gate held constant, the network is linear in the hidden state
entering block 0, so that state times its stored gradient sums to the score (float32: 1e-4 relative). A rule that
let any gradient through the softmax or the std, or a family left on autograd's gradient, breaks the identity (the
plain gradient does not satisfy it, checked too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")
open_clip = pytest.importorskip("open_clip")

IMG = 32
VECTORS = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))


def _zero_biases(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        torch.nn.init.normal_(p, std=0.0 if name.endswith("bias") else 0.3)
    return model.eval()


def _hf(config: str, model_cls: str, **kw) -> torch.nn.Module:
    cfg = getattr(transformers, config)(image_size=IMG, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64, **kw)
    return _zero_biases(getattr(transformers, model_cls)(cfg))


def _family(name: str) -> tuple[torch.nn.Module, object]:
    sim = vc.targets.similarity(VECTORS, metric="dot")  # linear in the embedding (cosine is not)
    if name == "eva":
        from timm.models.eva import Eva

        return _zero_biases(Eva(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                                use_rot_pos_emb=True, scale_attn_inner=True, init_values=0.5)), "top1"
    if name == "open_clip":
        clip = open_clip.model.CLIP(embed_dim=32, quick_gelu=True, vision_cfg=open_clip.model.CLIPVisionCfg(
            layers=2, width=32, head_width=16, patch_size=8, image_size=IMG), text_cfg=open_clip.model.CLIPTextCfg(
            context_length=8, vocab_size=100, width=16, heads=2, layers=1))
        return _zero_biases(clip.visual), sim
    if name == "hf_vit":
        return _hf("ViTConfig", "ViTForImageClassification", num_labels=5), "top1"
    if name == "hf_deit":
        return _hf("DeiTConfig", "DeiTForImageClassificationWithTeacher", num_labels=5), "top1"
    if name == "hf_dinov2":
        cfg = transformers.Dinov2WithRegistersConfig(image_size=IMG, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, mlp_ratio=2, num_labels=5,
                                                     num_register_tokens=2)
        return _zero_biases(transformers.Dinov2WithRegistersForImageClassification(cfg)), "top1"
    if name == "hf_clip":
        return _hf("CLIPVisionConfig", "CLIPVisionModel"), sim
    return _hf("SiglipVisionConfig", "SiglipVisionModel"), sim


def _relevance_and_score(tr) -> tuple[float, float]:
    h = tr["act"].sel(site="resid_pre").isel(layer=0).values.astype(np.float64)
    g = tr["grad"].sel(site="resid_pre").isel(layer=0, target=0).values.astype(np.float64)
    return float((h * g).sum()), float(tr["logits"].values[int(tr["target_class"].values[0])])


@pytest.mark.parametrize("family", ["eva", "open_clip", "hf_vit", "hf_deit", "hf_dinov2", "hf_clip", "hf_siglip"])
def test_cp_lrp_and_libragrad_conserve_the_score_on_every_family(family):
    model, targets = _family(family)
    image = np.random.default_rng(0).integers(0, 256, (IMG, IMG, 3), dtype=np.uint8)
    for rule in ("cp_lrp", "libragrad"):
        tr = vc.trace(model, image, targets=targets, sites=["resid_pre"], layers=[0], rule=rule)
        relevance, score = _relevance_and_score(tr)
        assert abs(score) > 1e-2
        np.testing.assert_allclose(relevance, score, rtol=1e-4)
    plain = vc.trace(model, image, targets=targets, sites=["resid_pre"], layers=[0])
    relevance, score = _relevance_and_score(plain)
    assert abs(relevance - score) > 1e-3 * abs(score)
