"""Backward rule chefer_lrp (Chefer, Gur & Wolf, CVPR 2021): the relevance a rule trace stores at F2 equals an
independent re-implementation of the official code's relprop (hila-chefer/Transformer-Explainability,
baselines/ViT/ViT_LRP.py and layers_ours.py), written here as that code does it: a forward pass that keeps every
layer's input, then one explicit relprop function per layer applied from the one-hot of the class down, with no
autograd at all (NumPy, float64). Transformer Attribution's map then follows from R_A and the plain gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import erf
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb.core.errors import TraceError

IMG = 32


def _model(seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    model = VisionTransformer(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def _image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (IMG, IMG, 3), dtype=np.uint8)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


# --- the official code's layers, each a forward that keeps its input and a relprop ------------------------------

def safe_divide(a, b):
    den = np.clip(b, 1e-9, None) + np.clip(b, None, 1e-9)
    den = den + (den == 0) * 1e-9
    return a / den * (b != 0)


def linear_relprop(R, x, w):
    """Linear.relprop with alpha=1 (beta=0): the activator term only, bias left out."""
    pw, nw = np.clip(w, 0, None), np.clip(w, None, 0)
    px, nx = np.clip(x, 0, None), np.clip(x, None, 0)
    S = safe_divide(R, px @ pw.T + nx @ nw.T)
    return px * (S @ pw) + nx * (S @ nw)


def add_relprop(R, x0, x1):
    """Add.relprop: shares x_i R / (x0 + x1), each rescaled so that the two keep R's sum."""
    S = safe_divide(R, x0 + x1)
    a, b = x0 * S, x1 * S
    a_sum, b_sum = a.sum(), b.sum()
    a_fact = safe_divide(np.abs(a_sum), np.abs(a_sum) + np.abs(b_sum)) * R.sum()
    b_fact = safe_divide(np.abs(b_sum), np.abs(a_sum) + np.abs(b_sum)) * R.sum()
    return a * safe_divide(a_fact, a_sum), b * safe_divide(b_fact, b_sum)


def clone_relprop(Rs, x):
    """Clone.relprop: x * sum_i R_i / x."""
    return x * sum(safe_divide(r, x) for r in Rs)


def matmul_relprop(R, a, b):
    """einsum.relprop (RelPropSimple) for Z = a @ b: a * (S @ b^T), b * (a^T @ S), S = R / Z."""
    S = safe_divide(R, a @ b)
    return a * (S @ np.swapaxes(b, -1, -2)), b * (np.swapaxes(a, -1, -2) @ S)


def layer_norm(x, mod):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + mod.eps) * _np(mod.weight) + _np(mod.bias)


def softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def chefer_reference(model: VisionTransformer, h0: np.ndarray, cls: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits from the hidden state entering block 0, and the relevance of each block's attention map (heads,
    N, N) from ``relprop(one_hot(cls))`` as ViT_LRP.VisionTransformer.relprop computes it."""
    saved, h = [], h0
    for blk in model.blocks:
        at = blk.attn
        x_in = h
        a = layer_norm(h, blk.norm1)
        N, C = a.shape
        H, d = at.num_heads, C // at.num_heads
        qkv = a @ _np(at.qkv.weight).T + _np(at.qkv.bias)
        q, k, v = qkv.reshape(N, 3, H, d).transpose(1, 2, 0, 3)
        A = softmax((q @ np.swapaxes(k, -1, -2)) * at.scale)
        o = (A @ v).transpose(1, 0, 2).reshape(N, C)
        attn_out = o @ _np(at.proj.weight).T + _np(at.proj.bias)
        mid = h = x_in + attn_out
        a2 = layer_norm(h, blk.norm2)
        u = a2 @ _np(blk.mlp.fc1.weight).T + _np(blk.mlp.fc1.bias)
        g = 0.5 * u * (1 + erf(u / np.sqrt(2)))
        mlp_out = g @ _np(blk.mlp.fc2.weight).T + _np(blk.mlp.fc2.bias)
        h = mid + mlp_out
        saved.append(dict(x_in=x_in, a=a, q=q, k=k, v=v, A=A, o=o, attn_out=attn_out, mid=mid, a2=a2, g=g,
                          mlp_out=mlp_out))
    pooled = layer_norm(h, model.norm)[0]
    logits = pooled @ _np(model.head.weight).T + _np(model.head.bias)
    # relprop: head (Linear), pool (index_select of token 0), norm (passes), then each block in reverse
    R_tok = linear_relprop(np.eye(len(logits))[cls], pooled, _np(model.head.weight))
    R = np.zeros_like(h)
    R[0] = safe_divide(R_tok, pooled) * pooled  # IndexSelect.relprop: X * (R / Z) at the selected row
    R_attn = [None] * len(model.blocks)
    for i in reversed(range(len(model.blocks))):
        blk, s = model.blocks[i], saved[i]
        at = blk.attn
        N, C = s["a"].shape
        H = at.num_heads
        r_mid, r_mlp = add_relprop(R, s["mid"], s["mlp_out"])
        r = linear_relprop(r_mlp, s["g"], _np(blk.mlp.fc2.weight))
        r = linear_relprop(r, s["a2"], _np(blk.mlp.fc1.weight))  # GELU and norm2 pass relevance unchanged
        R = clone_relprop([r_mid, r], s["mid"])
        r_in, r_att = add_relprop(R, s["x_in"], s["attn_out"])
        r = linear_relprop(r_att, s["o"], _np(at.proj.weight)).reshape(N, H, -1).transpose(1, 0, 2)
        r_A, r_v = matmul_relprop(r, s["A"], s["v"])
        r_A, r_v = r_A / 2, r_v / 2
        R_attn[i] = r_A  # saved after halving, as Attention.relprop does; softmax passes it unchanged
        r_q, r_k = matmul_relprop(r_A, s["q"], np.swapaxes(s["k"], -1, -2))
        r_q, r_k = r_q / 2, np.swapaxes(r_k, -1, -2) / 2
        r_qkv = np.stack([r_q, r_k, r_v]).transpose(2, 0, 1, 3).reshape(N, 3 * C)
        r = linear_relprop(r_qkv, s["a"], _np(at.qkv.weight))  # norm1 passes it unchanged
        R = clone_relprop([r_in, r], s["x_in"])
    return logits, R_attn


def _rule_trace(model, img, **kw):
    return vc.trace(model, img, targets="top2", sites=["resid_pre", "F2"], rule="chefer_lrp", **kw)


def test_the_stored_attention_relevance_equals_the_official_relprop():
    model, img = _model(), _image()
    tr = _rule_trace(model, img)
    h0 = tr["act"].sel(site="resid_pre").isel(layer=0).values.astype(np.float64)
    for t, cls in enumerate(tr["target_class"].values[:2]):
        logits, R_attn = chefer_reference(model, h0, int(cls))
        np.testing.assert_allclose(logits, tr["logits"].values, rtol=1e-5, atol=1e-5)
        for layer, want in enumerate(R_attn):
            got = tr["attn_grad"].isel(target=t, layer=layer).values
            # float32 relevance carried down through the blocks against a float64 reference: the rounding depends
            # on the CPU's kernels (1.4e-5 of the largest value at layer 0 on a CPU without AVX-512); a wrong rule
            # is off by the values' own size
            assert np.abs(got - want).max() <= 5e-5 * np.abs(want).max(), (t, layer)
            assert np.abs(want).max() > 1e-3  # the comparison is not between zeros
    assert tr.attrs["backward_rule"] == "chefer_lrp"


def _snapshot(model):
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks), m.training) for m in model.modules()]
    return hooks, {k: v.clone() for k, v in model.state_dict().items()}, [p.requires_grad for p in model.parameters()]


def test_the_model_is_restored_exactly():
    model = _model().train()
    before = _snapshot(model)
    _rule_trace(model, _image())
    after = _snapshot(model)
    assert before[0] == after[0] and before[2] == after[2]
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])


def test_the_model_is_restored_after_an_error_in_the_pass():
    model = _model().train()
    before = _snapshot(model)

    def fail(*_args):
        raise RuntimeError("boom")

    handle = model.head.register_forward_hook(fail)  # raises after every rule hook has fired
    with pytest.raises(RuntimeError, match="boom"):
        _rule_trace(model, _image())
    handle.remove()
    assert _snapshot(model)[0] == before[0] and model.training


def test_models_outside_chefers_vit_are_refused_before_any_model_call():
    import timm
    from timm.models.beit import Beit
    from timm.models.deit import VisionTransformerDistilled

    calls = []
    small = dict(img_size=IMG, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    for m, match in ((VisionTransformer(**small, global_pool="avg"), "pools with 'avg'"),
                     (VisionTransformer(**small, init_values=0.5), "layer scale"),
                     (VisionTransformerDistilled(**small), "distillation head"),
                     (Beit(**small), r"chefer_lrp'? is defined for vit .*the beit family"),
                     (timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=IMG, patch_size=8,
                                        depth=1), "the eva family")):
        m.eval().register_forward_pre_hook(lambda *_: calls.append(1))
        with pytest.raises(TraceError, match=match):
            _rule_trace(m, _image())
    assert calls == []


def _official_map(R_attn: list[np.ndarray], grads: list[np.ndarray], start_layer: int = 0) -> np.ndarray:
    """ViT_LRP.relprop(method='transformer_attribution'): per block mean_h clamp(grad * cam, 0), then
    compute_rollout_attention (each + I, multiplied from start_layer up), row 0, columns 1:."""
    cams = [np.clip(g * r, 0, None).mean(0) for g, r in zip(grads, R_attn)]
    mats = [c + np.eye(len(c)) for c in cams]
    joint = mats[start_layer]
    for m in mats[start_layer + 1:]:
        joint = m @ joint
    return joint[0, 1:]


def test_the_stored_plain_gradient_is_a_plain_traces_gradient():
    model, img = _model(), _image()
    tr, plain = _rule_trace(model, img), vc.trace(model, img, targets="top2", sites=["F2"])
    np.testing.assert_allclose(tr["attn_plain_grad"].values, plain["attn_grad"].values, rtol=1e-5, atol=1e-7)
    assert not np.allclose(tr["attn_grad"].values, plain["attn_grad"].values)


@pytest.mark.parametrize("start_layer", [0, 1])
def test_the_preset_map_equals_the_official_transformer_attribution(start_layer):
    model, img = _model(), _image()
    tr, plain = _rule_trace(model, img), vc.trace(model, img, targets="top2", sites=["F2"])
    h0 = tr["act"].sel(site="resid_pre").isel(layer=0).values.astype(np.float64)
    layer = "all" if start_layer == 0 else (1,)
    for rank, t in (("top1", 0), ("top2", 1)):
        _, R_attn = chefer_reference(model, h0, int(tr["target_class"].values[t]))
        grads = [plain["attn_grad"].isel(target=t, layer=i).values.astype(np.float64) for i in range(2)]
        want = _official_map(R_attn, grads, start_layer).reshape(4, 4)
        recipe = vc.presets.transformer_attribution(layer)
        raw = vc.cam(tr, recipe.replace(class_=rank, normalize="none"), grid=True).values
        assert np.abs(raw - want).max() <= 1e-5 * np.abs(want).max(), rank
        got = vc.cam(tr, recipe.replace(class_=rank), grid=True).values
        np.testing.assert_allclose(got, (want - want.min()) / np.ptp(want), atol=1e-5)


def test_the_preset_refuses_other_traces_naming_its_rule():
    model, img = _model(), _image()
    for rule in ("gradient", "attnlrp"):
        tr = vc.trace(model, img, targets="top1", sites=["F2"], rule=rule)
        with pytest.raises(vc.RecipeError, match=r"chefer_lrp"):
            vc.cam(tr, vc.presets.transformer_attribution())
    tr = _rule_trace(model, img)
    with pytest.raises(vc.RecipeError, match="target='logit'"):
        vc.cam(tr, vc.presets.transformer_attribution().replace(target="prob"))


def test_each_image_of_a_batch_gets_its_own_relevance(tmp_path):
    """The residual split sums per image (the official code traces one image): a batch of two equals two traces."""
    model = _model()
    imgs = [_image(0), _image(1)]
    many = vc.open_traces(vc.trace_many(model, imgs, tmp_path / "s.zarr", targets="top1", sites=["F2"],
                                        rule="chefer_lrp", batch_size=2, progress=False))
    for i, img in enumerate(imgs):
        one = vc.trace(model, img, targets="top1", sites=["F2"], rule="chefer_lrp")["attn_grad"].values
        got = many["attn_grad"].isel(image=i).values
        assert np.abs(got - one).max() <= 1e-5 * np.abs(one).max(), i


def test_the_memory_estimate_counts_the_plain_gradient():
    from vitcam_nb.capture.budget import estimate_plan
    from vitcam_nb.capture.plan import TracePlan

    model = _model()
    tr = _rule_trace(model, _image())
    est = estimate_plan(TracePlan.for_trace(model, "top2", sites=["resid_pre", "F2"], rule="chefer_lrp"), (IMG, IMG))
    assert est["parts"]["attn_plain_grad"] == tr["attn_plain_grad"].nbytes
    assert est["dataset_bytes"] == pytest.approx(tr.nbytes, rel=0.01)
