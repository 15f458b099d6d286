"""The optional sites q, k, v and attn_scores (issue #20 part A) on tiny random timm ViT/DeiT/DINOv2-style,
open_clip and Hugging Face CLIP towers, checked against identities the stored sites must satisfy:

- values: ``q, k, v = F1 W + b`` with the block's own projection weights, ``S = q k^T / sqrt(d)`` per head and
  ``softmax(S) = F2``;
- gradients: F1 feeds only the q, k, v projections, so ``dF1 = dq Wq + dk Wk + dv Wv`` (chain rule through the
  weights), and ``dS = A * (dA - sum_key(dA * A))`` (the softmax backward from the stored F2 gradient).
"""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb.core.errors import TraceError

SITES = ["F1", "F2", "q", "k", "v", "attn_scores"]
RTOL = 1e-5


def _close(a, b, rtol=RTOL):
    scale = max(float(np.abs(b).max()), 1e-30)
    assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) <= rtol * scale


def _image(size=32, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def _check(tr, weights, heads):
    """weights[layer] = (W (3C, C), b (3C,)) of the fused q, k, v projection."""
    n_layers = tr.sizes["layer"]
    for li in range(n_layers):
        layer = int(tr.layer[li])
        W, b = weights[layer]
        f1 = tr["act"].sel(site="F1").values[li].astype(np.float64)
        qkv = f1 @ W.T + b
        C = W.shape[1]
        for i, s in enumerate(("q", "k", "v")):
            _close(tr["act"].sel(site=s).values[li], qkv[:, i * C:(i + 1) * C])
        q = tr["act"].sel(site="q").values[li].astype(np.float64)
        k = tr["act"].sel(site="k").values[li].astype(np.float64)
        d = C // heads
        qh = q.reshape(-1, heads, d).transpose(1, 0, 2)
        kh = k.reshape(-1, heads, d).transpose(1, 0, 2)
        S = qh @ kh.transpose(0, 2, 1) / np.sqrt(d)
        _close(tr["attn_scores"].values[li], S)
        A = tr["attn"].values[li].astype(np.float64)
        e = np.exp(S - S.max(-1, keepdims=True))
        _close(A, e / e.sum(-1, keepdims=True))
        for t in range(tr.sizes["target"]):
            g = {s: tr["grad"].sel(site=s).values[t, li].astype(np.float64) for s in ("F1", "q", "k", "v")}
            dqkv = np.concatenate([g["q"], g["k"], g["v"]], axis=-1)
            _close(g["F1"], dqkv @ W)
            dA = tr["attn_grad"].values[t, li].astype(np.float64)
            _close(tr["attn_scores_grad"].values[t, li], A * (dA - (dA * A).sum(-1, keepdims=True)), rtol=1e-4)


@pytest.mark.parametrize("kwargs", [
    {},  # ViT with a class token
    {"class_token": False, "global_pool": "avg"},  # no prefix token
    {"reg_tokens": 2, "no_embed_class": True},  # DINOv2-style registers
])
def test_timm_qkv_and_scores(kwargs):
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                          num_heads=2, embed_dim=16, num_classes=5, **kwargs).eval()
    tr = vc.trace(m, _image(), targets=[1, 3], sites=SITES)
    weights = {i: (b.attn.qkv.weight.detach().double().numpy(), b.attn.qkv.bias.detach().double().numpy())
               for i, b in enumerate(m.blocks)}
    _check(tr, weights, 2)
    assert tr.attrs["hook_attn_scores"] == "blocks.{layer}.attn:scores"
    assert tr.attrs["model_optional_sites"] == "q,k,v,q_out,k_out,attn_scores"
    assert "q" not in tr.attrs["model_sites"].split(",")
    assert m.blocks[0].attn.attn_drop._forward_pre_hooks == {} and m.blocks[0].attn.q_norm._forward_hooks == {}


def test_deit_distilled_qkv():
    torch.manual_seed(1)
    m = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                          num_heads=2, embed_dim=16, num_classes=4).eval()
    tr = vc.trace(m, _image(seed=1), targets=[0], sites=SITES)
    _check(tr, {0: (m.blocks[0].attn.qkv.weight.detach().double().numpy(),
                    m.blocks[0].attn.qkv.bias.detach().double().numpy())}, 2)


def test_optional_sites_are_off_by_default_and_refused_where_absent():
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                          num_heads=2, embed_dim=16, num_classes=3).eval()
    tr = vc.trace(m, _image(), targets=[0])
    assert "attn_scores" not in tr and not {"q", "k", "v"} & set(tr.site.values.tolist())
    qk = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                           num_heads=2, embed_dim=16, num_classes=3, qk_norm=True).eval()
    with pytest.raises(TraceError, match="sites: a site this model does not have 'attn_scores'"):
        vc.trace(qk, _image(), targets=[0], sites=["attn_scores"])
    # an output norm before proj: proj(q) would not be the block's q_out, so the sites are not offered
    normed = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                               num_heads=2, embed_dim=16, num_classes=3, scale_attn_norm=True).eval()
    with pytest.raises(TraceError, match="sites: a site this model does not have 'q_out'"):
        vc.trace(normed, _image(), targets=[0], sites=["q_out"])


def test_open_clip_qkv_and_scores():
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.model.CLIP(
        embed_dim=8, vision_cfg=open_clip.model.CLIPVisionCfg(layers=2, width=16, head_width=8, patch_size=8,
                                                              image_size=32),
        text_cfg=open_clip.model.CLIPTextCfg(context_length=8, vocab_size=49408, width=16, heads=2, layers=1)).eval()
    target = vc.targets.similarity(torch.randn(2, 8, generator=torch.Generator().manual_seed(0)))
    tr = vc.trace(model, torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2)), targets=target,
                  sites=SITES)
    blocks = model.visual.transformer.resblocks
    _check(tr, {i: (b.attn.in_proj_weight.detach().double().numpy(), b.attn.in_proj_bias.detach().double().numpy())
                for i, b in enumerate(blocks)}, 2)
    assert "attn_q" not in blocks[0].attn._modules


def test_hf_clip_qkv():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, image_size=32, patch_size=8, projection_dim=8)
    torch.manual_seed(0)
    model = transformers.CLIPVisionModelWithProjection(cfg).eval()
    target = vc.targets.similarity(torch.randn(2, 8, generator=torch.Generator().manual_seed(0)))
    tr = vc.trace(model, torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3)), targets=target,
                  sites=["F1", "F2", "q", "k", "v"])
    layers = model.vision_model.encoder.layers
    for li, lay in enumerate(layers):
        a = lay.self_attn
        W = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().double().numpy()
        b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach().double().numpy()
        f1 = tr["act"].sel(site="F1").values[li].astype(np.float64)
        qkv = f1 @ W.T + b
        for i, s in enumerate(("q", "k", "v")):
            _close(tr["act"].sel(site=s).values[li], qkv[:, i * 16:(i + 1) * 16])
        for t in range(tr.sizes["target"]):
            dqkv = np.concatenate([tr["grad"].sel(site=s).values[t, li] for s in ("q", "k", "v")], -1)
            _close(tr["grad"].sel(site="F1").values[t, li], dqkv.astype(np.float64) @ W)
