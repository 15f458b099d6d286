"""Backward rules (vc.trace(..., rule=...)): the stored gradients of each rule equal a reference written here
independently in plain torch — the ViT block re-implemented from the model's weights with each rule spelled out
(a custom autograd Function halves gradients, LayerNorm divides by a detached std, GELU's gradient is
gelu(x)/x or Phi(x), the attention matrix a detached leaf) — to 1e-5 relative; the model is restored exactly after
the pass, also after an error; bad rules and unsupported models are refused before any model call."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.models.beit import Beit
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer
from vitcam_testing import HalfGradient, rule_layer_norm

import vitcam_nb as vc
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.rules import rule_names

IMG = 32
SITES = ["resid_pre", "F1", "F2", "F3", "F4", "F5", "attn_scores"]


def _model(family: str = "vit", seed: int = 0, zero_bias: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    cls = {"vit": VisionTransformer, "deit_distilled_layerscale": VisionTransformerDistilled, "beit": Beit,
           "dinov2_registers": VisionTransformer}[family]
    # the others carry layer scales; BEiT also a relative position bias, the DINOv2-style ViT four register tokens
    kw = dict(init_values=0.5) if family != "vit" else {}
    if family == "beit":
        kw["use_rel_pos_bias"] = True
    if family == "dinov2_registers":
        kw["reg_tokens"] = 4
    model = cls(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, **kw)
    for name, p in model.named_parameters():  # O(1) activations and attention; biases non-zero unless asked
        torch.nn.init.normal_(p, std=0.0 if zero_bias and name.endswith("bias") else 0.3)
    return model.eval()


def _image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (IMG, IMG, 3), dtype=np.uint8)




def _gelu(u, rule):
    if rule == "gradient":
        return F.gelu(u)
    if rule == "libragrad":  # LibraGrad: x * Phi(x).detach()
        return u * (0.5 * (1 + torch.erf(u / math.sqrt(2)))).detach()
    return u * (F.gelu(u) / u).detach()  # identity rule (no exact zeros in these inputs)


def _scale(blk, timm_name: str, beit_name: str):
    """A block's layer scale (timm ViT's LayerScale, BEiT's gamma), or 1."""
    layer = getattr(blk, timm_name, None)
    if layer is not None and hasattr(layer, "gamma"):
        return layer.gamma
    gamma = getattr(blk, beit_name, None)
    return 1.0 if gamma is None else gamma


def reference(model: torch.nn.Module, h: torch.Tensor, rule: str) -> tuple[torch.Tensor, dict]:
    """Logits from the hidden state entering block 0, and the tensors at every site, with ``rule`` written out."""
    beit = isinstance(model, Beit)
    kept = {}
    for i, blk in enumerate(model.blocks):
        kept[(i, "resid_pre")] = h
        a = rule_layer_norm(h, blk.norm1, rule)
        kept[(i, "F1")] = a
        B, N, C = a.shape
        heads = blk.attn.num_heads
        bias = torch.cat([blk.attn.q_bias, 0 * blk.attn.v_bias, blk.attn.v_bias]) if beit else blk.attn.qkv.bias
        qkv = (a @ blk.attn.qkv.weight.T + bias).reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if rule == "attnlrp":
            q, k = HalfGradient.apply(q), HalfGradient.apply(k)
        s = (q * blk.attn.scale) @ k.transpose(-2, -1)
        if beit:  # a constant of the model (relative position bias); BEiT has no attn_scores site
            s = s + blk.attn._get_rel_pos_bias()
        else:
            kept[(i, "attn_scores")] = s
        A = s.softmax(-1)
        if rule in ("cp_lrp", "libragrad"):
            A = A.detach().requires_grad_(True)
        kept[(i, "F2")] = A
        o = (A @ v).transpose(1, 2).reshape(B, N, C)
        if rule == "attnlrp":
            o = HalfGradient.apply(o)
        kept[(i, "F3")] = o
        attn_out = o @ blk.attn.proj.weight.T + blk.attn.proj.bias
        ls1 = _scale(blk, "ls1", "gamma_1")
        h = h + attn_out * ls1
        a2 = rule_layer_norm(h, blk.norm2, rule)
        kept[(i, "F4")] = a2
        mlp = _gelu(a2 @ blk.mlp.fc1.weight.T + blk.mlp.fc1.bias, rule) @ blk.mlp.fc2.weight.T + blk.mlp.fc2.bias
        kept[(i, "F5")] = mlp
        h = h + mlp * _scale(blk, "ls2", "gamma_2")
    if beit:  # BEiT: mean over the patch tokens, then fc_norm (its final norm is an Identity)
        return (rule_layer_norm(h[:, 1:].mean(1), model.fc_norm, rule) @ model.head.weight.T + model.head.bias)[0], kept
    h = rule_layer_norm(h, model.norm, rule)
    logits = h[:, 0] @ model.head.weight.T + model.head.bias
    if isinstance(model, VisionTransformerDistilled):
        logits = (logits + h[:, 1] @ model.head_dist.weight.T + model.head_dist.bias) / 2
    return logits[0], kept


@pytest.mark.parametrize("family", ["vit", "deit_distilled_layerscale", "dinov2_registers", "beit"])
@pytest.mark.parametrize("rule", ["gradient", "cp_lrp", "attnlrp", "libragrad"])
def test_stored_gradients_equal_the_reference(rule, family):
    """BEiT's attention has no q/k modules: the trace halves the gradient leaving its softmax, the reference halves
    it at q and k (AttnLRP's uniform rule as written); every stored gradient agrees."""
    model = _model(family)
    sites = SITES if family != "beit" else [s for s in SITES if s != "attn_scores"]
    tr = vc.trace(model, _image(), targets="top2", sites=sites, rule=rule)
    with torch.no_grad():
        h0 = torch.tensor(tr["act"].sel(site="resid_pre").isel(layer=0).values[None])
    for p in model.parameters():
        p.requires_grad_(False)
    h0.requires_grad_(True)
    logits, kept = reference(model, h0, rule)
    np.testing.assert_allclose(logits.detach().numpy(), tr["logits"].values, rtol=1e-5, atol=1e-5)
    for t, cls in enumerate(tr["target_class"].values[:2]):
        keys = list(kept)
        grads = torch.autograd.grad(logits[int(cls)], [kept[k] for k in keys], retain_graph=True, allow_unused=True)
        for (layer, site), g in zip(keys, grads):
            want = np.zeros(kept[(layer, site)].shape[1:], np.float32) if g is None else g[0].numpy()
            if site in ("F2", "attn_scores"):
                name = "attn" if site == "F2" else "attn_scores"
                got = tr[f"{name}_grad"].isel(target=t, layer=layer).values
            else:
                got = tr["grad"].sel(site=site).isel(target=t, layer=layer).values
            scale = max(float(np.abs(want).max()), 1e-12)
            assert float(np.abs(got - want).max()) <= 1e-5 * scale, (rule, site, layer)
    if rule in ("cp_lrp", "libragrad") and family != "beit":  # a constant attention: nothing into q k^T, A has one
        assert not tr["attn_scores_grad"].values.any() and tr["attn_grad"].values.any()
    assert tr.attrs.get("backward_rule", "gradient") == rule


def test_the_rules_differ_from_the_gradient_and_each_other():
    model, img = _model(), _image()
    g = {r: vc.trace(model, img, targets="top1", sites=["resid_pre"], layers=[0], rule=r)["grad"].values
         for r in ("gradient", "cp_lrp", "attnlrp")}
    assert not np.allclose(g["gradient"], g["cp_lrp"]) and not np.allclose(g["cp_lrp"], g["attnlrp"])


def _snapshot(model: torch.nn.Module) -> tuple:
    hooks = tuple((len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), "forward" in vars(m),
                   m.training) for m in model.modules())
    return hooks, {k: v.clone() for k, v in model.state_dict().items()}, [p.requires_grad for p in model.parameters()]


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[2] == b[2] and a[1].keys() == b[1].keys() and all(
        torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("rule", ["cp_lrp", "attnlrp", "libragrad"])
def test_the_model_is_restored_after_a_trace_and_after_an_error(rule):
    model = _model().train()
    before = _snapshot(model)
    vc.trace(model, _image(), targets="top1", sites=SITES, rule=rule)
    assert _same(before, _snapshot(model))

    def fail(*_args):
        raise RuntimeError("boom")

    handle = model.head.register_forward_hook(fail)  # raises after every rule hook has fired
    with pytest.raises(RuntimeError, match="boom"):
        vc.trace(model, _image(), targets="top1", sites=SITES, rule=rule)
    handle.remove()
    assert _same(before, _snapshot(model))
    assert model.training


def _never_called(model: torch.nn.Module) -> list:
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_a_bad_rule_is_refused_before_any_model_call():
    model = _model()
    calls = _never_called(model)
    with pytest.raises(TraceError, match=r"rule: unknown backward rule 'lrp'; allowed: \['gradient', ") as info:
        vc.trace(model, _image(), rule="lrp")
    assert calls == []
    # every rule is named (containment: a rule module added later is named too)
    assert all(repr(name) in str(info.value) for name in rule_names())


def test_an_unsupported_family_is_refused_by_name_before_any_model_call():
    import timm

    swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=IMG, window_size=2,
                             depths=(1, 1), num_heads=(1, 2), embed_dim=16, num_classes=5).eval()
    calls = _never_called(swin)
    with pytest.raises(TraceError, match=r"rule='attnlrp' is defined for vit \(timm VisionTransformer.*; beit "
                                         r"\(timm Beit.*; the swin family \(SwinTransformer\) is not supported: "
                                         r"the rules are implemented here for one global softmax attention"):
        vc.trace(swin, _image(), rule="attnlrp")
    swiglu = Beit(img_size=IMG, patch_size=8, embed_dim=32, depth=1, num_heads=2, swiglu_mlp=True).eval()
    with pytest.raises(TraceError, match="MLP is a SwiGLU"):
        vc.trace(swiglu, _image(), rule="libragrad")
    qk = VisionTransformer(img_size=IMG, patch_size=8, embed_dim=32, depth=1, num_heads=2, qk_norm=True).eval()
    with pytest.raises(TraceError, match="query/key norms"):
        vc.trace(qk, _image(), rule="cp_lrp")
    assert calls == []
