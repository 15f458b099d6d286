"""``vitcam_nb.adapters.single_head_attention`` and the sites ``q_out``/``k_out`` (issue #20, Grad-ECLIP's code):

- the context changes only the chosen blocks, restores them on every path and says which blocks it holds;
- a trace taken inside records those blocks (attribute ``single_head_attention``) and only then hashes them into
  its id, so every other trace id is what it was;
- ``q_out``/``k_out`` on timm CLIP-style ViTs and Hugging Face CLIP equal q and k (from my own hook on the block's
  LayerNorm output and the block's weights, in NumPy float64) through the attention's output projection.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb.adapters.qkv import single_head_layers
from vitcam_nb.core.errors import TraceError

RTOL = 1e-5


def _close(a, b, rtol=RTOL):
    b = np.asarray(b, np.float64)
    assert np.asarray(a).shape == b.shape
    assert float(np.abs(np.asarray(a, np.float64) - b).max()) <= rtol * max(float(np.abs(b).max()), 1e-30)


def _clip_vit(depth=2, num_classes=0):
    """A tiny random timm CLIP image tower (the architecture of vit_base_patch16_clip_224: pre-norm, class token,
    qkv bias), as an embedding model (num_classes=0)."""
    torch.manual_seed(0)
    return _randomise(timm.create_model("vit_base_patch16_clip_224", pretrained=False, img_size=32, patch_size=8,
                                        depth=depth, embed_dim=16, num_heads=2, num_classes=num_classes).eval())


def _randomise(model):
    """Unit-scale random weights AND biases (timm and transformers start biases at zero, which would hide a
    missing bias term)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim >= 2:
                p.copy_(noise / np.sqrt(p[0].numel()))
            else:  # norm weights near one, every bias (and norm shift) non-zero
                p.copy_(noise / 4 + (1.0 if name.endswith("weight") else 0.0))
    return model


def _x(seed=2):
    return torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _target(dim=16):
    return vc.targets.similarity(torch.randn(2, dim, generator=torch.Generator().manual_seed(5)))


# -- the context ---------------------------------------------------------------------------------------------
def test_context_changes_only_the_chosen_blocks_and_restores_them():
    m = _clip_vit(depth=3)
    before = [(b.attn.num_heads, b.attn.head_dim, b.attn.scale) for b in m.blocks]
    assert single_head_layers(m) == ()
    with vc.adapters.single_head_attention(m, layers=(0, -1, 2)):  # -1 and 2 are the same block
        assert single_head_layers(m) == (0, 2)
        assert [(b.attn.num_heads, b.attn.head_dim) for b in m.blocks] == [(1, 16), (2, 8), (1, 16)]
        assert m.blocks[0].attn.scale == pytest.approx(16 ** -0.5)
        with vc.adapters.single_head_attention(m, layers=(0,)):  # nested: still one head, still held
            assert single_head_layers(m) == (0, 2)
        assert single_head_layers(m) == (0, 2) and m.blocks[0].attn.num_heads == 1
    assert [(b.attn.num_heads, b.attn.head_dim, b.attn.scale) for b in m.blocks] == before
    assert single_head_layers(m) == ()
    with pytest.raises(RuntimeError, match="boom"), vc.adapters.single_head_attention(m):
        raise RuntimeError("boom")
    assert [(b.attn.num_heads, b.attn.head_dim, b.attn.scale) for b in m.blocks] == before
    assert single_head_layers(m) == ()


@pytest.mark.parametrize("layers", [(3,), (-4,), ("last",), ()])
def test_context_refuses_blocks_the_model_does_not_have(layers):
    m = _clip_vit(depth=3)
    with pytest.raises(ValueError, match=r"layers: expected block indices in \[-3, 2\]"), \
            vc.adapters.single_head_attention(m, layers=layers):
        pass
    assert single_head_layers(m) == () and m.blocks[0].attn.num_heads == 2


def test_single_head_forward_is_one_head_attention():
    """Inside the context the last block computes softmax(q k^T / sqrt(C)) v over all C channels at once."""
    m = _clip_vit()
    seen = {}
    m.blocks[-1].register_forward_pre_hook(lambda _m, args: seen.__setitem__("t", args[0]))
    m.blocks[-1].register_forward_hook(lambda _m, _i, out: seen.__setitem__("out", out))
    for b in m.blocks:
        b.attn.fused_attn = False
    with torch.no_grad(), vc.adapters.single_head_attention(m):
        m(_x())
    blk, t = m.blocks[-1], seen["t"].double()
    W, b = blk.attn.qkv.weight.double(), blk.attn.qkv.bias.double()
    h = torch.nn.functional.layer_norm(t, (16,), blk.norm1.weight.double(), blk.norm1.bias.double(), blk.norm1.eps)
    q, k, v = (h @ W.T + b).chunk(3, -1)
    o = torch.softmax(q @ k.transpose(-2, -1) / 4.0, -1) @ v
    t2 = t + o @ blk.attn.proj.weight.double().T + blk.attn.proj.bias.double()
    ref = t2 + copy.deepcopy(blk.mlp).double()(copy.deepcopy(blk.norm2).double()(t2))
    _close(seen["out"].detach().numpy(), ref.detach().numpy())


# -- the trace records it ------------------------------------------------------------------------------------
def test_trace_records_single_head_blocks_and_hashes_them_only_then():
    m = _clip_vit()
    x = _x()

    def trace(**kw):
        return vc.trace(m, x, targets=_target(), sites=["F3"], **kw)

    plain = trace()
    with vc.adapters.single_head_attention(m):
        last, again = trace(), trace()
        attn_last = vc.trace(m, x, targets=_target(), sites=["F2"], layers=[1])
        with pytest.raises(TraceError, match="one trace stores one head count"):
            vc.trace(m, x, targets=_target(), sites=["F2"])
    with vc.adapters.single_head_attention(m, layers=(0, 1)):
        both = trace()
    after = trace()
    assert "single_head_attention" not in plain.attrs and "single_head_attention" not in after.attrs
    assert last.attrs["single_head_attention"] == "1" and both.attrs["single_head_attention"] == "0,1"
    assert len({t.attrs["trace_id"] for t in (plain, last, both)}) == 3
    assert again.attrs["trace_id"] == last.attrs["trace_id"] and after.attrs["trace_id"] == plain.attrs["trace_id"]
    # what was recorded is what ran: block 1 as one head; its output (hence the gradient) differs from the model's
    assert attn_last["attn"].sizes["head"] == 1 and attn_last.attrs["single_head_attention"] == "1"
    assert not np.allclose(last["grad"].values, plain["grad"].values, rtol=1e-3)
    # every map of that trace says so in its checklist
    listed = vc.presets.gradcam().replace(site="F3").checklist(last)["model and input"]
    assert listed["single-head attention"].startswith("block(s) 1 ran as ONE head over all channels")
    assert "single-head attention" not in vc.presets.gradcam().replace(site="F3").checklist(plain)["model and input"]


# -- q_out / k_out -------------------------------------------------------------------------------------------
def _projected_reference(h, w_q, b_q, w_k, b_k, w_o, b_o):
    """q and k from the LayerNorm output h and the block's weights, then through the output projection."""
    q, k = h @ w_q.T + b_q, h @ w_k.T + b_k
    return q @ w_o.T + b_o, k @ w_o.T + b_o


def _np(t):
    return t.detach().double().numpy()


def _check_projected(tr, norms, weights):
    for li in range(tr.sizes["layer"]):
        q_out, k_out = _projected_reference(norms[li], *weights[li])
        _close(tr["act"].sel(site="q_out").values[li], q_out)
        _close(tr["act"].sel(site="k_out").values[li], k_out)
        # values only: not on the path to the output
        assert not np.abs(tr["grad"].sel(site="q_out").values).any()
        assert not np.abs(tr["grad"].sel(site="k_out").values).any()


@pytest.mark.parametrize("single", [False, True])
def test_timm_clip_q_out_k_out(single):
    m = _clip_vit()
    ref = copy.deepcopy(m)
    norms = []
    for blk in ref.blocks:
        blk.norm1.register_forward_hook(lambda _m, _i, out: norms.append(_np(out[0])))
    with torch.no_grad():
        ref(_x())
    sites = ["q", "q_out", "k_out", "k", "F3"]  # q/k (which rebuild the qkv output) and q_out/k_out on one module
    if single:
        with vc.adapters.single_head_attention(m):
            tr = vc.trace(m, _x(), targets=_target(), sites=sites)
    else:
        tr = vc.trace(m, _x(), targets=_target(), sites=sites)
    assert tr.attrs["hook_q_out"] == "blocks.{layer}.attn:projected:q"
    weights = []
    for blk in m.blocks:
        w, b = _np(blk.attn.qkv.weight), _np(blk.attn.qkv.bias)
        weights.append((w[:16], b[:16], w[16:32], b[16:32], _np(blk.attn.proj.weight), _np(blk.attn.proj.bias)))
    _check_projected(tr, norms, weights)
    assert all(not b.attn.qkv._forward_hooks for b in m.blocks)


def test_hf_clip_q_out_k_out():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, image_size=32, patch_size=8, projection_dim=8)
    torch.manual_seed(0)
    model = _randomise(transformers.CLIPVisionModelWithProjection(cfg).eval())
    ref = copy.deepcopy(model)
    norms = []
    for lay in ref.vision_model.encoder.layers:
        lay.layer_norm1.register_forward_hook(lambda _m, _i, out: norms.append(_np(out[0])))
    with torch.no_grad():
        ref(pixel_values=_x(3))
    tr = vc.trace(model, _x(3), targets=_target(8), sites=["q_out", "k_out", "v"])
    assert tr.attrs["hook_k_out"] == "vision_model.encoder.layers.{layer}.self_attn:projected:k"
    weights = [(_np(a.q_proj.weight), _np(a.q_proj.bias), _np(a.k_proj.weight), _np(a.k_proj.bias),
                _np(a.out_proj.weight), _np(a.out_proj.bias))
               for a in (lay.self_attn for lay in model.vision_model.encoder.layers)]
    _check_projected(tr, norms, weights)


def test_trace_many_records_single_head_and_refuses_resuming_outside(tmp_path):
    m = _clip_vit(num_classes=3)  # trace_many traces class targets
    images = [np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8) for i in range(3)]
    kw = {"targets": "top1", "sites": ["F3"], "layers": [-1], "progress": False}
    path = tmp_path / "s.zarr"
    with vc.adapters.single_head_attention(m):
        vc.trace_many(m, images[:2], path, **kw)
        one = vc.trace(m, images[1], targets="top1", sites=["F3"], layers=[-1])
    stored = vc.image_trace(vc.open_traces(path), 1)
    assert stored.attrs["single_head_attention"] == "1" and stored.attrs["trace_id"] == one.attrs["trace_id"]
    _close(stored["grad"].values, one["grad"].values)  # batched with another image: last bits may differ
    with pytest.raises(vc.TraceFileError, match="another model or settings"):
        vc.trace_many(m, images, path, **kw)  # the model as it is: not the single-head model the store holds
