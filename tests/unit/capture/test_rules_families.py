"""Backward rules on the families beyond timm ViT/BEiT (issue #34 item 1): timm EVA, open_clip, Hugging Face ViT,
DeiT, CLIP and SigLIP vision towers. The stored gradients of each rule equal a reference written here in plain
torch from the model's weights, with the rule spelled out (a custom Function halves gradients, LayerNorm divides by
a detached std, the activation's gradient is act(x)/x or its gate, the attention matrix a detached leaf), 1e-5
relative; every other module of the families is refused by name before any model call."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from vitcam_testing import HalfGradient, rule_layer_norm

import vitcam_nb as vc
from vitcam_nb.core.errors import TraceError

transformers = pytest.importorskip("transformers")
open_clip = pytest.importorskip("open_clip")

IMG = 32
RULES = ["gradient", "cp_lrp", "attnlrp", "libragrad"]
CONSTANT = ("cp_lrp", "libragrad")


def _image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (IMG, IMG, 3), dtype=np.uint8)


def _redraw(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    for p in model.parameters():  # O(1) activations and attention
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()




def _act(u, kind, rule):
    phi = {"none": lambda: 0.5 * (1 + torch.erf(u / math.sqrt(2))),
           "tanh": lambda: 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3))),
           "quick": lambda: torch.sigmoid(1.702 * u)}[kind]()
    out = u * phi
    if rule == "gradient":
        return out
    if rule == "libragrad":  # the gate detached
        return u * phi.detach()
    return u * (out / u).detach()  # identity rule (no exact zeros in these inputs)


def _lin(x, w, b=None):
    return x @ w.T + (0 if b is None else b)


def _heads(t, heads):  # (B, N, C) -> (B, heads, N, d)
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _attend(q, k, v, scale, rule, kept, i):
    """softmax(scale q k^T) V with the rule: q, k halved (attnlrp), A a detached leaf (constant rules)."""
    if rule == "attnlrp":
        q, k = HalfGradient.apply(q), HalfGradient.apply(k)
    A = ((q * scale) @ k.transpose(-2, -1)).softmax(-1)
    if rule in CONSTANT:
        A = A.detach().requires_grad_(True)
    kept[(i, "F2")] = A
    o = (A @ v).transpose(1, 2).flatten(-2)
    if rule == "attnlrp":
        o = HalfGradient.apply(o)
    kept[(i, "F3")] = o
    return o


def _block(h, i, rule, kept, *, ln1, ln2, qkv: Callable, post: Callable, mlp: Callable, ls=(1.0, 1.0)):
    kept[(i, "resid_pre")] = h
    a = rule_layer_norm(h, ln1, rule)
    kept[(i, "F1")] = a
    o = _attend(*qkv(a), rule, kept, i)
    h = h + post(o) * ls[0]
    a2 = rule_layer_norm(h, ln2, rule)
    kept[(i, "F4")] = a2
    m = mlp(a2)
    kept[(i, "F5")] = m
    return h + m * ls[1]


def _eva(model, h, rule):
    from timm.layers import apply_rot_embed_cat

    kept, rope, npt = {}, model.rope.get_embed(), model.num_prefix_tokens
    for i, blk in enumerate(model.blocks):
        at = blk.attn

        def qkv(a, at=at):
            bias = torch.cat([at.q_bias, at.k_bias, at.v_bias])
            q, k, v = (_heads(t, at.num_heads) for t in _lin(a, at.qkv.weight, bias).chunk(3, -1))
            q, k = (torch.cat([t[:, :, :npt], apply_rot_embed_cat(t[:, :, npt:], rope, half=at.rotate_half)], 2)
                    for t in (q, k))
            return q, k, v, at.scale

        def mlp(a, m=blk.mlp):
            hidden = rule_layer_norm(_act(_lin(a, m.fc1.weight, m.fc1.bias), "none", rule), m.norm, rule)
            return _lin(hidden, m.fc2.weight, m.fc2.bias)

        h = _block(h, i, rule, kept, ln1=blk.norm1, ln2=blk.norm2, qkv=qkv, mlp=mlp, ls=(blk.gamma_1, blk.gamma_2),
                   post=lambda o, at=at: _lin(rule_layer_norm(o, at.norm, rule), at.proj.weight, at.proj.bias))
    pooled = rule_layer_norm(h[:, npt:].mean(1), model.fc_norm, rule)  # global_pool 'avg', then fc_norm
    return _lin(pooled, model.head.weight, model.head.bias)[0], kept


def _mha_qkv(mha, a):
    q, k, v = (_heads(t, mha.num_heads) for t in _lin(a, mha.in_proj_weight, mha.in_proj_bias).chunk(3, -1))
    return q, k, v, q.shape[-1] ** -0.5


def _open_clip(visual, h, rule, vectors):
    kept = {}
    for i, blk in enumerate(visual.transformer.resblocks):
        mlp = blk.mlp
        h = _block(h, i, rule, kept, ln1=blk.ln_1, ln2=blk.ln_2, qkv=lambda a, b=blk: _mha_qkv(b.attn, a),
                   post=lambda o, b=blk: _lin(o, b.attn.out_proj.weight, b.attn.out_proj.bias),
                   mlp=lambda a, m=mlp: _lin(_act(_lin(a, m.c_fc.weight, m.c_fc.bias), "quick", rule),
                                            m.c_proj.weight, m.c_proj.bias))
    emb = rule_layer_norm(h[:, 0], visual.ln_post, rule) @ visual.proj  # pool_type 'tok'
    return (emb @ vectors.T)[0], kept


def _hf_layers(layers, h, rule, kind, attention, out_proj, norms, scales=None):
    kept, scales = {}, scales or [(1.0, 1.0)] * len(layers)
    for i, lay in enumerate(layers):
        at, m = getattr(lay, attention), lay.mlp

        def qkv(a, at=at, i=i):
            q, k = _lin(a, at.q_proj.weight, at.q_proj.bias), _lin(a, at.k_proj.weight, at.k_proj.bias)
            kept[(i, "q")], kept[(i, "k")] = q, k
            n = at.config.num_attention_heads
            return _heads(q, n), _heads(k, n), _heads(_lin(a, at.v_proj.weight, at.v_proj.bias), n), at.scaling \
                if hasattr(at, "scaling") else at.scale

        h = _block(h, i, rule, kept, ln1=getattr(lay, norms[0]), ln2=getattr(lay, norms[1]), qkv=qkv,
                   post=lambda o, at=at: _lin(o, getattr(at, out_proj).weight, getattr(at, out_proj).bias),
                   mlp=lambda a, m=m: _lin(_act(_lin(a, m.fc1.weight, m.fc1.bias), kind, rule), m.fc2.weight,
                                           m.fc2.bias), ls=scales[i])
    return h, kept


def _hf_vit(model, h, rule):
    h, kept = _hf_layers(model.vit.layers, h, rule, "none", "attention", "o_proj",
                         ("layernorm_before", "layernorm_after"))
    h = rule_layer_norm(h, model.vit.layernorm, rule)
    return _lin(h[:, 0], model.classifier.weight, model.classifier.bias)[0], kept


def _hf_deit(model, h, rule):
    h, kept = _hf_layers(model.deit.layers, h, rule, "tanh", "attention", "o_proj",
                         ("layernorm_before", "layernorm_after"))
    h = rule_layer_norm(h, model.deit.layernorm, rule)
    cls, dist = model.cls_classifier, model.distillation_classifier
    return ((_lin(h[:, 0], cls.weight, cls.bias) + _lin(h[:, 1], dist.weight, dist.bias)) / 2)[0], kept


def _hf_dinov2(model, h, rule):
    base = getattr(model, "dinov2", None) or model.dinov2_with_registers
    ls = [(lay.layer_scale1.lambda1, lay.layer_scale2.lambda1) for lay in base.encoder.layer]
    h, kept = _hf_layers(base.encoder.layer, h, rule, "none", "attention", "o_proj", ("norm1", "norm2"), ls)
    h = rule_layer_norm(h, base.layernorm, rule)
    first_patch = 1 + getattr(model.config, "num_register_tokens", 0)
    pooled = torch.cat([h[:, 0], h[:, first_patch:].mean(1)], dim=1)  # class token and mean of the patches
    return _lin(pooled, model.classifier.weight, model.classifier.bias)[0], kept


def _hf_clip(model, h, rule, vectors):
    vm = getattr(model, "vision_model", model)  # transformers 5: the vision model is the tower itself
    h, kept = _hf_layers(vm.encoder.layers, h, rule, "quick", "self_attn", "out_proj", ("layer_norm1", "layer_norm2"))
    return (rule_layer_norm(h[:, 0], vm.post_layernorm, rule) @ vectors.T)[0], kept


def _hf_siglip(model, h, rule, vectors):
    vm = getattr(model, "vision_model", model)  # transformers 5: the vision model is the tower itself
    h, kept = _hf_layers(vm.encoder.layers, h, rule, "tanh", "self_attn", "out_proj", ("layer_norm1", "layer_norm2"))
    h = rule_layer_norm(h, vm.post_layernorm, rule)
    head, mha = vm.head, vm.head.attention
    w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    b_q, b_k, b_v = mha.in_proj_bias.chunk(3)
    q = _heads(_lin(head.probe, w_q, b_q), mha.num_heads)  # the probe: a parameter, so q k^T is linear in k
    A = ((q * q.shape[-1] ** -0.5) @ _heads(_lin(h, w_k, b_k), mha.num_heads).transpose(-2, -1)).softmax(-1)
    if rule in CONSTANT:
        A = A.detach()
    o = (A @ _heads(_lin(h, w_v, b_v), mha.num_heads)).transpose(1, 2).flatten(-2)
    if rule == "attnlrp":
        o = HalfGradient.apply(o)
    x = _lin(o, mha.out_proj.weight, mha.out_proj.bias)
    m = head.mlp
    hidden = _act(_lin(rule_layer_norm(x, head.layernorm, rule), m.fc1.weight, m.fc1.bias), "tanh", rule)
    x = x + _lin(hidden, m.fc2.weight, m.fc2.bias)
    return (x[:, 0] @ vectors.T)[0], kept


def _hf(name, cfg_kw, model_cls):
    cfg = getattr(transformers, name)(image_size=IMG, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64, **cfg_kw)
    return _redraw(getattr(transformers, model_cls)(cfg))


VECTORS = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))


def _family(name):
    """(model, targets, sites, reference(model, h0, rule))."""
    base = ["resid_pre", "F1", "F2", "F3", "F4", "F5"]
    sim = vc.targets.similarity(VECTORS, metric="dot")
    if name == "eva":
        from timm.models.eva import Eva

        model = _redraw(Eva(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                            use_rot_pos_emb=True, scale_attn_inner=True, scale_mlp=True, init_values=0.5))
        return model, "top2", base, _eva
    if name == "open_clip":
        clip = open_clip.model.CLIP(embed_dim=32, quick_gelu=True, vision_cfg=open_clip.model.CLIPVisionCfg(
            layers=2, width=32, head_width=16, patch_size=8, image_size=IMG), text_cfg=open_clip.model.CLIPTextCfg(
            context_length=8, vocab_size=100, width=16, heads=2, layers=1))
        visual = _redraw(clip.visual)
        return visual, sim, base, lambda m, h, r: _open_clip(m, h, r, VECTORS)
    if name == "hf_vit":
        return _hf("ViTConfig", {"num_labels": 5}, "ViTForImageClassification"), "top2", base, _hf_vit
    if name == "hf_deit":
        model = _hf("DeiTConfig", {"num_labels": 5, "hidden_act": "gelu_pytorch_tanh"},
                    "DeiTForImageClassificationWithTeacher")
        return model, "top2", base, _hf_deit
    if name in ("hf_dinov2", "hf_dinov2_registers"):
        registers = name == "hf_dinov2_registers"
        cfg = getattr(transformers, "Dinov2WithRegistersConfig" if registers else "Dinov2Config")(
            image_size=IMG, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
            num_labels=5, layerscale_value=0.5, **({"num_register_tokens": 2} if registers else {}))
        cls = "Dinov2WithRegistersForImageClassification" if registers else "Dinov2ForImageClassification"
        return _redraw(getattr(transformers, cls)(cfg)), "top2", base, _hf_dinov2
    if name == "hf_clip":
        return (_hf("CLIPVisionConfig", {}, "CLIPVisionModel"), sim, base + ["q", "k"],
                lambda m, h, r: _hf_clip(m, h, r, VECTORS))
    return (_hf("SiglipVisionConfig", {}, "SiglipVisionModel"), sim, base + ["q", "k"],
            lambda m, h, r: _hf_siglip(m, h, r, VECTORS))


FAMILIES = ["eva", "open_clip", "hf_vit", "hf_deit", "hf_dinov2", "hf_dinov2_registers", "hf_clip", "hf_siglip"]


@pytest.mark.parametrize("family", FAMILIES)
def test_stored_gradients_equal_the_reference(family):
    """Every rule on one model per family: the logits (or similarities) and every stored gradient agree with the
    reference; under a constant attention nothing reaches q and k while the attention matrix keeps its gradient."""
    model, targets, sites, reference = _family(family)
    for p in model.parameters():
        p.requires_grad_(False)
    for rule in RULES:
        tr = vc.trace(model, _image(), targets=targets, sites=sites, rule=rule)
        h0 = torch.tensor(tr["act"].sel(site="resid_pre").isel(layer=0).values[None], requires_grad=True)
        scores, kept = reference(model, h0, rule)
        np.testing.assert_allclose(scores.detach().numpy(), tr["logits"].values, rtol=1e-5, atol=1e-5)
        for t, cls in enumerate(tr["target_class"].values[:2]):
            keys = [k for k in kept if k[1] in sites]  # q, k: sites of CLIP and SigLIP only
            grads = torch.autograd.grad(scores[int(cls)], [kept[k] for k in keys], retain_graph=True,
                                        allow_unused=True)
            for (layer, site), g in zip(keys, grads):
                want = np.zeros(kept[(layer, site)].shape[1:], np.float32) if g is None else g[0].numpy()
                got = (tr["attn_grad"] if site == "F2" else tr["grad"].sel(site=site)).isel(target=t, layer=layer)
                scale = max(float(np.abs(want).max()), 1e-12)
                assert float(np.abs(got.values - want).max()) <= 1e-5 * scale, (rule, site, layer)
        assert tr["attn_grad"].values.any()
        if "q" in sites:  # no gradient into q k^T under a constant attention; halved (non-zero) under AttnLRP
            assert tr["grad"].sel(site=["q", "k"]).values.any() == (rule not in CONSTANT)
        assert tr.attrs.get("backward_rule", "gradient") == rule


def _snapshot(model: torch.nn.Module) -> tuple:
    hooks = tuple((len(m._forward_hooks), len(m._forward_pre_hooks), tuple(m._modules), "forward" in vars(m),
                   m.training) for m in model.modules())
    return hooks, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", ["open_clip", "hf_siglip"])
def test_the_model_is_restored_and_the_forward_pass_unchanged(family):
    model, targets, sites, _ = _family(family)
    model.train()
    before = _snapshot(model)
    plain = vc.trace(model, _image(), targets=targets, sites=sites)
    for rule in ("cp_lrp", "attnlrp"):
        ruled = vc.trace(model, _image(), targets=targets, sites=sites, rule=rule)
        np.testing.assert_array_equal(ruled["act"].values, plain["act"].values)
        np.testing.assert_array_equal(ruled["logits"].values, plain["logits"].values)
        after = _snapshot(model)
        assert before[0] == after[0] and all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    assert model.training


def _never_called(model: torch.nn.Module) -> list:
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_modules_the_rules_are_not_defined_on_are_refused_by_name_before_any_model_call():
    import timm
    from timm.models.eva import Eva

    cases = [
        (timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=IMG, patch_size=8, depth=1,
                           num_classes=5),
         "cp_lrp", r"timm Eva .*block 0's MLP is a GluMlp with SiLU"),
        (Eva(img_size=IMG, patch_size=8, embed_dim=32, depth=1, num_heads=2, qk_norm=True), "attnlrp",
         "block 0's attention has query/key norms"),
        (_hf("ViTConfig", {"hidden_act": "relu"}, "ViTModel"), "libragrad",
         r"transformers ViTModel.*layer 0's MLP activation is a ReLU"),
        (_hf("Dinov2Config", {"use_swiglu_ffn": True}, "Dinov2Model"), "cp_lrp",
         r"transformers Dinov2Model.*layer 0's MLP is a Dinov2SwiGLUFFN"),
        (_hf("BeitConfig", {}, "BeitModel"), "cp_lrp",
         r"rule='cp_lrp' is defined for .*hf_siglip .*; the hf_beit family \(BeitModel\) is not supported"),
        (timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, window_size=2,
                           depths=(1, 1), num_heads=(1, 2), embed_dim=16, num_classes=5),
         "attnlrp", r"the swin family \(SwinTransformer\) is not supported: .*Swin's shifted-window attention"),
        (transformers.SwinForImageClassification(transformers.SwinConfig(
            image_size=IMG, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=2)),
         "libragrad", r"the hf_swin family \(SwinForImageClassification\) is not supported: .*shifted-window"),
    ]
    for model, rule, match in cases:
        model.eval()
        calls = _never_called(model)
        with pytest.raises(TraceError, match=match):
            vc.trace(model, _image(), rule=rule)
        assert calls == []
