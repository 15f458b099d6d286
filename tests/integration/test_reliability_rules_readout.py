"""Issue #34 loose ends: Transformer Attribution from a trace_many store equals it on single traces (and map_many,
which keeps maps of one pass's sites, refuses it by name before any model call); LibraGrad's own read-out, Libra
FullGrad+ (input x gradient at every block's input plus every bias x its gradient, per token), equals an autograd
reference written here: the ViT re-implemented from the model's weights with LibraGrad's constants (attention,
LayerNorm's std and GELU's gate detached) and every bias broadcast to a per-token leaf, whose gradient times the
bias is the bias's term at that token."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb.core.errors import RecipeError

IMG = 32
FULLGRAD_SITES = ["resid_pre", "resid_mid", "F6", "v", "F3", "attn_out", "F5"]


def _model(seed: int = 0, zero_final_bias: bool = False) -> VisionTransformer:
    torch.manual_seed(seed)
    model = VisionTransformer(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    for name, p in model.named_parameters():  # O(1) activations; every bias non-zero
        final = name in ("norm.bias", "head.bias")
        torch.nn.init.normal_(p, std=0.0 if zero_final_bias and final else 0.3)
    return model.eval()


def _image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (IMG, IMG, 3), dtype=np.uint8)


def test_transformer_attribution_of_a_trace_many_store_equals_single_traces(tmp_path):
    model, imgs = _model(), [_image(0), _image(1), _image(2)]
    store = vc.trace_many(model, imgs, tmp_path / "s.zarr", targets="top1", sites=["F2"], rule="chefer_lrp",
                          batch_size=2, progress=False)  # a batch of two and a batch of one
    ds = vc.open_traces(store)
    assert "attn_plain_grad" in ds
    preset = vc.presets.transformer_attribution()
    many = vc.cam(ds, preset, grid=True)
    for i, img in enumerate(imgs):
        single = vc.cam(vc.trace(model, img, targets="top1", sites=["F2"], rule="chefer_lrp"), preset, grid=True)
        np.testing.assert_allclose(many.isel(image=i).values, single.values, rtol=0, atol=1e-6)
        one = vc.cam(ds.isel(image=i), preset, grid=True)
        np.testing.assert_allclose(one.values, single.values, rtol=0, atol=1e-6)
    assert np.ptp(many.values) > 0  # a real map, not a constant that would equal anything


def test_map_many_refuses_transformer_attribution_by_name_before_any_model_call(tmp_path):
    model, calls = _model(), []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(RecipeError, match="transformer_attribution"):
            vc.map_many(model, [_image()], [vc.presets.transformer_attribution()], tmp_path / "m.zarr",
                        progress=False)
    finally:
        handle.remove()
    assert calls == [] and not (tmp_path / "m.zarr").exists()


# --- Libra FullGrad+ -------------------------------------------------------------------------------------------

def _ln(x: torch.Tensor, mod: torch.nn.LayerNorm, bias: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    std = ((x - mean) ** 2).mean(-1, keepdim=True).add(mod.eps).sqrt().detach()  # LibraGrad: std constant
    return (x - mean) / std * mod.weight + bias


def _per_token(bias: torch.Tensor, n: int) -> torch.Tensor:
    return bias.detach().double().expand(n, -1).clone().requires_grad_(True)


def libra_fullgrad_reference(model: VisionTransformer, h: torch.Tensor, cls: int) -> tuple[np.ndarray, ...]:
    """Per token (all tokens, class token first), from the hidden state entering block 0 (batch of one), float64:
    x_l . dx_l of each block l (blocks, tokens), the sum of every block bias's b . db at the token where it is
    added (tokens); and the logit."""
    model = model.double()
    h = h.double()
    n, c = h.shape[-2:]
    inputs, biases = [], []
    for blk in model.blocks:
        h = h.detach().requires_grad_(True) if not inputs else h
        inputs.append(h)
        h.retain_grad()
        b = {name: _per_token(p, n) for name, p in (("n1", blk.norm1.bias), ("qkv", blk.attn.qkv.bias),
                                                     ("proj", blk.attn.proj.bias), ("n2", blk.norm2.bias),
                                                     ("fc1", blk.mlp.fc1.bias), ("fc2", blk.mlp.fc2.bias))}
        biases.extend(b.values())
        a = _ln(h, blk.norm1, b["n1"])
        heads = blk.attn.num_heads
        qkv = (a @ blk.attn.qkv.weight.T + b["qkv"]).reshape(n, 3, heads, c // heads).permute(1, 2, 0, 3)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q * blk.attn.scale) @ k.transpose(-2, -1)).softmax(-1).detach()  # LibraGrad: attention constant
        o = (attn @ v).transpose(0, 1).reshape(n, c)
        h = h + o @ blk.attn.proj.weight.T + b["proj"]
        u = _ln(h, blk.norm2, b["n2"]) @ blk.mlp.fc1.weight.T + b["fc1"]
        gelu = u * (0.5 * (1 + torch.erf(u / math.sqrt(2)))).detach()  # LibraGrad: GELU's gate constant
        h = h + gelu @ blk.mlp.fc2.weight.T + b["fc2"]
        if len(inputs) < len(model.blocks):
            h.retain_grad()
    pooled = _ln(h, model.norm, model.norm.bias)[0]
    logit = pooled @ model.head.weight[cls] + model.head.bias[cls]
    logit.backward()
    model.float()
    per_block = torch.stack([(x * x.grad).sum(-1).reshape(n) for x in inputs]).detach().numpy()
    return per_block, sum((b * b.grad).sum(-1) for b in biases).detach().numpy(), float(logit.detach())


def test_libra_fullgrad_equals_the_autograd_reference_per_token():
    model, img = _model(), _image()
    tr = vc.trace(model, img, targets="top1", sites=FULLGRAD_SITES, rule="libragrad")
    cls = int(tr["target_class"].values[0])
    h0 = torch.from_numpy(tr["act"].sel(site="resid_pre").isel(layer=0).values.copy())
    per_block, bias_terms, _ = libra_fullgrad_reference(model, h0, cls)
    ref = per_block.sum(0) + bias_terms
    got = vc.cam(tr, vc.presets.libragrad(biases=True), grid=True)
    np.testing.assert_allclose(got.values.ravel(), ref[1:], rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # The bias terms are really there: the input terms alone differ from the reference.
    inputs_only = vc.cam(tr, vc.presets.libragrad(layer="all"), grid=True).values.ravel()
    assert np.abs(inputs_only - ref[1:]).max() > 1e-2 * np.abs(ref).max()
    assert "Libra FullGrad+" in got.attrs["methods"]


def test_libra_fullgrad_bias_terms_complete_the_input_term():
    """The paper's FG-completeness under LibraGrad: input x gradient at block 0 plus every bias x its gradient sums
    to the logit. The kit's bias terms per patch (its FullGrad+ map minus its input terms of every block) with its
    block-0 input term, plus the class token's own terms from the reference, give the logit (the final norm's and
    the head's biases, which act on the pooled class token only, are zero here)."""
    model, img = _model(zero_final_bias=True), _image()
    tr = vc.trace(model, img, targets="top1", sites=FULLGRAD_SITES, rule="libragrad")
    cls = int(tr["target_class"].values[0])
    h0 = torch.from_numpy(tr["act"].sel(site="resid_pre").isel(layer=0).values.copy())
    per_block, bias_terms, logit = libra_fullgrad_reference(model, h0, cls)
    np.testing.assert_allclose(per_block[0].sum() + bias_terms.sum(), logit, rtol=1e-9)  # the reference is complete
    np.testing.assert_allclose(logit, tr["logits"].values[cls], rtol=1e-5)

    def grid(recipe):
        return vc.cam(tr, recipe, grid=True).values.astype(np.float64).ravel()

    kit_bias = grid(vc.presets.libragrad(biases=True)) - grid(vc.presets.libragrad(layer="all"))
    total = grid(vc.presets.libragrad()).sum() + kit_bias.sum() + per_block[0][0] + bias_terms[0]
    np.testing.assert_allclose(total, logit, rtol=1e-4)
    assert abs(kit_bias.sum()) > 1e-2 * abs(logit)  # the biases carry part of the logit here


def test_libra_fullgrad_refuses_other_rules_and_missing_sites_by_name():
    model, img = _model(), _image()
    with pytest.raises(RecipeError, match="rule 'attnlrp'"):
        vc.cam(vc.trace(model, img, targets="top1", sites=FULLGRAD_SITES, rule="attnlrp"),
               vc.presets.libragrad(biases=True))
    with pytest.raises(RecipeError, match=r"lacks \['resid_mid', 'F6', 'v', 'F3', 'attn_out', 'F5'\]"):
        vc.cam(vc.trace(model, img, targets="top1", sites=["resid_pre"], rule="libragrad"),
               vc.presets.libragrad(biases=True))
    with pytest.raises(RecipeError, match="biases: expected True or False"):
        vc.presets.libragrad(biases="yes")
