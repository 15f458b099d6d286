"""The published attention-gradient presets (issue #20 part A) against references written from each method's
official code (or, for Grad-SAM and AttCAT, the code the comparisons run), in torch autograd with hooks of their
own on the model, never through vitcam_nb: maps on the patch grid (``upsample="none"``, ``normalize="none"``) to
1e-5 relative.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb.core.errors import RecipeError

RTOL = 1e-5
RAW = {"upsample": "none", "normalize": "none"}


def _close(got, ref):
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    assert float(np.abs(np.asarray(got, np.float64) - ref).max()) <= RTOL * max(float(np.abs(ref).max()), 1e-30)


def _vit(**kw):
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3,
                          num_heads=2, embed_dim=16, num_classes=5, **kw).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # unit-scale weights, so attention and its gradients are far from uniform
        for p in m.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p[0].numel()))
    return m


def _image(seed=0):
    return np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)


def _run(model, x):
    """Forward with my own hooks: per block the input h (retained grad), the softmax attention A (retained grad),
    the pre-softmax scores S = scale q k^T (values), the block output."""
    m = copy.deepcopy(model).eval()
    rec = {"h": [], "A": [], "S": [], "out": []}

    def pre(_m, args):
        args[0].retain_grad()
        rec["h"].append(args[0])

    def qkv_hook(mod):
        def hook(_m, _i, out):
            B, N, _ = out.shape
            q, k, _v = out.reshape(B, N, 3, mod.num_heads, mod.head_dim).permute(2, 0, 3, 1, 4)
            rec["S"].append(((q * mod.scale) @ k.transpose(-2, -1)).detach())
        return hook

    def attn_hook(_m, _i, out):
        out.retain_grad()
        rec["A"].append(out)

    for blk in m.blocks:
        blk.attn.fused_attn = False
        blk.register_forward_pre_hook(pre)
        blk.attn.qkv.register_forward_hook(qkv_hook(blk.attn))
        blk.attn.attn_drop.register_forward_hook(attn_hook)
        blk.register_forward_hook(lambda _m, _i, out: rec["out"].append(out))
    logits = m(x)
    return m, logits, rec


def _input(model, image):
    from vitcam_nb.preprocess import prepare_input

    return prepare_input(model, image).tensor


def _grid(v, n_prefix=1):
    return v[n_prefix:].reshape(4, 4)


@pytest.fixture(scope="module")
def vit_case():
    model = _vit()
    image = _image()
    tr = vc.trace(model, image, targets="top1", sites=["F2", "attn_scores", "resid_pre"])
    _, logits, rec = _run(model, _input(model, image))
    c = int(logits[0].argmax())
    logits[0, c].backward()
    return tr, rec


def test_agcam_equals_official_code(vit_case):
    tr, rec = vit_case
    # AGCAM.py: CLS row of the scores and of the attention gradient, relu(grad) * sigmoid(scores), keys [1:],
    # summed over heads, then over layers.
    mask = sum((torch.relu(A.grad[0, :, 0]) * torch.sigmoid(S[0, :, 0])).sum(0) for A, S in zip(rec["A"], rec["S"]))
    _close(vc.cam(tr, vc.presets.agcam().replace(**RAW)).values, _grid(mask.numpy()))


def test_grad_sam_equals_reference(vit_case):
    tr, rec = vit_case
    per_layer = [(A[0, :, 0] * torch.relu(A.grad[0, :, 0])).mean(0) for A in rec["A"]]
    _close(vc.cam(tr, vc.presets.grad_sam().replace(**RAW)).values, _grid((sum(per_layer) / 3).detach().numpy()))
    rows = [(A[0] * torch.relu(A.grad[0])).mean(1).mean(0) for A in rec["A"]]
    _close(vc.cam(tr, vc.presets.grad_sam(attn_rows="mean").replace(**RAW)).values,
           _grid((sum(rows) / 3).detach().numpy()))


def test_attcat_equals_reference(vit_case):
    tr, rec = vit_case
    # hidden_states[l] (the input of block l) times its gradient, summed over channels, times the block's
    # attention averaged over heads and query rows; summed over blocks, signed.
    cams = [(h.grad[0] * h[0]).sum(-1) * A[0].mean(0).mean(0) for h, A in zip(rec["h"], rec["A"])]
    ref = _grid(sum(cams).detach().numpy())
    _close(vc.cam(tr, vc.presets.attcat().replace(**RAW)).values, ref)
    cls_rows = [(h.grad[0] * h[0]).sum(-1) * A[0, :, 0].mean(0) for h, A in zip(rec["h"], rec["A"])]
    _close(vc.cam(tr, vc.presets.attcat(attn_rows="cls").replace(**RAW)).values,
           _grid(sum(cls_rows).detach().numpy()))


@pytest.mark.parametrize("kw", [{}, {"global_pool": "avg", "fc_norm": True}])
def test_legrad_cls_equals_reference(kw):
    # the kit's class-token read-out (vc.presets.legrad_cls; the official read-out is tested in
    # tests/unit/compute/test_parity_legrad.py against the authors' code)
    model = _vit(**kw)
    image = _image(1)
    tr = vc.trace(model, image, targets=vc.targets.layerwise(readout="model"), sites=["F2"])
    m, logits, rec = _run(model, _input(model, image))
    c = int(logits[0].argmax())
    # For each block: its output through the final norm and head, d(score)/d(its attention), relu, mean over
    # heads then over query rows, keys [1:], summed over blocks.
    acc = 0
    for out, A in zip(rec["out"], rec["A"]):
        s = m.forward_head(m.norm(out))[0, c]
        (g,) = torch.autograd.grad(s, [A], retain_graph=True)
        acc = acc + torch.relu(g).mean(1).mean(1)[0]
    _close(vc.cam(tr, vc.presets.legrad_cls().replace(**RAW)).values, _grid(acc.detach().numpy()))
    # the last block's score is the model's own logit
    assert np.isclose(float(tr["logits"][-1]), float(logits[0, c].detach()), rtol=1e-5)


def test_methods_refuse_traces_without_their_sites(vit_case):
    tr, _ = vit_case
    with pytest.raises(RecipeError, match="legrad_mean differentiates each block's own read-out score"):
        vc.cam(tr, vc.presets.legrad())
    plain = vc.trace(_vit(), _image(), targets="top1", sites=["F2"])
    with pytest.raises(RecipeError, match="sites=\\[..., 'attn_scores'\\]"):
        vc.cam(plain, vc.presets.agcam())


def test_checklist_names_the_method(vit_case):
    tr, _ = vit_case
    m = vc.cam(tr, vc.presets.agcam())
    assert "this is AG-CAM (Leem & Seo 2024" in m.attrs["checklist"]
    assert "per layer" not in m.attrs["methods"] and m.attrs["methods"].endswith("(official AGCAM.py)).")
    listed = vc.presets.agcam().checklist(tr)
    assert listed["spatial reconstruction"]["normalisation"] == "minmax once, after upsampling"
    assert set(vc.presets.TAXONOMY) >= {"grad_sam", "attcat", "agcam", "legrad", "grad_eclip", "grad_eclip_paper"}
    for entry in vc.presets.TAXONOMY.values():
        assert {"paper", "code", "site", "target", "tokens", "aggregation", "reconstruction"} <= set(entry)


# -- Grad-ECLIP on CLIP towers -------------------------------------------------------------------------------
def _clip():
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.model.CLIP(
        embed_dim=8, vision_cfg=open_clip.model.CLIPVisionCfg(layers=2, width=16, head_width=8, patch_size=8,
                                                              image_size=32),
        text_cfg=open_clip.model.CLIPTextCfg(context_length=8, vocab_size=49408, width=16, heads=2, layers=1))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.visual.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[0] if name == "proj" else p[0].numel()))
    return model.eval()


def _eclip_reference(model, x, text, heads):
    """generate_emap.py's clip_encode_dense and grad_eclip, with ``heads`` heads in the recomputed last block.
    1: the code (cosine of q and k after out_proj, over all channels); the model's own count: the paper (cosine
    of each head's q and k)."""
    v_ = model.visual
    t = torch.nn.functional.conv2d(x, v_.conv1.weight, stride=8).flatten(2).transpose(1, 2)
    t = torch.cat([v_.class_embedding.view(1, 1, -1), t], 1) + v_.positional_embedding
    t = v_.ln_pre(t)
    for blk in v_.transformer.resblocks[:-1]:
        t = blk(t)
    last = v_.transformer.resblocks[-1]
    q, k, v = torch.nn.functional.linear(last.ln_1(t), last.attn.in_proj_weight, last.attn.in_proj_bias).chunk(3, -1)
    B, N, C = q.shape
    d = C // heads
    split = [z.reshape(B, N, heads, d).transpose(1, 2) for z in (q, k, v)]
    attn = torch.softmax((split[0] * d ** -0.5) @ split[1].transpose(-2, -1), -1)
    attn_output = (attn @ split[2]).transpose(1, 2).reshape(B, N, C)
    t2 = t + last.ls_1(last.attn.out_proj(attn_output))
    t2 = t2 + last.ls_2(last.mlp(last.ln_2(t2)))
    emb = v_.ln_post(t2[:, 0]) @ v_.proj
    c = torch.nn.functional.normalize(emb, dim=-1)[0] @ torch.nn.functional.normalize(text, dim=-1)
    (grad,) = torch.autograd.grad(c, [attn_output])
    g_cls = grad[0, 0]
    if heads == 1:
        q, k = (torch.nn.functional.linear(z, last.attn.out_proj.weight, last.attn.out_proj.bias) for z in (q, k))
    qh = torch.nn.functional.normalize(q[0, 0].reshape(heads, d), dim=-1)
    kh = torch.nn.functional.normalize(k[0, 1:].reshape(N - 1, heads, d), dim=-1)
    cos = (kh * qh).sum(-1)  # (patch, heads)
    cos = (cos - cos.min(0).values) / (cos.max(0).values - cos.min(0).values)
    terms = (g_cls * v[0, 1:]).reshape(N - 1, heads, d).sum(-1)
    return torch.relu((terms * cos).sum(-1)).detach().numpy().reshape(4, 4)


@pytest.mark.parametrize("preset,single", [("grad_eclip", True), ("grad_eclip_paper", False)])
def test_grad_eclip_open_clip(preset, single):
    model = _clip()
    text = torch.randn(8, generator=torch.Generator().manual_seed(5))
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    target = vc.targets.similarity(text[None])
    sites = ["F3", "q_out", "k_out", "v"] if single else ["F3", "q", "k", "v"]
    if single:
        with vc.adapters.single_head_attention(model):
            tr = vc.trace(model, x, targets=target, sites=sites, layers=[-1])
        assert model.visual.transformer.resblocks[-1].attn.num_heads == 2
    else:
        tr = vc.trace(model, x, targets=target, sites=sites, layers=[-1])
    ref = _eclip_reference(model, x, text, 1 if single else 2)
    _close(vc.cam(tr, vc.presets.get(preset).replace(**RAW)).values, ref)


def test_grad_eclip_paper_hf_clip():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, image_size=32, patch_size=8, projection_dim=8)
    torch.manual_seed(0)
    model = transformers.CLIPVisionModelWithProjection(cfg).eval()
    text = torch.randn(8, generator=torch.Generator().manual_seed(5))
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    tr = vc.trace(model, x, targets=vc.targets.similarity(text[None]), sites=["F3", "q", "k", "v"], layers=[-1])
    # reference: my own hooks on the last layer (q/k/v projections, out_proj input), autograd of the cosine
    m = copy.deepcopy(model)
    m.set_attn_implementation("eager")
    attn = m.vision_model.encoder.layers[-1].self_attn
    got = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(attn, name).register_forward_hook(lambda _m, _i, out, n=name: got.__setitem__(n, out))

    def keep_in(_m, args):
        args[0].retain_grad()
        got["o"] = args[0]

    attn.out_proj.register_forward_pre_hook(keep_in)
    emb = m(pixel_values=x).image_embeds[0]
    c = torch.nn.functional.normalize(emb, dim=-1) @ torch.nn.functional.normalize(text, dim=-1)
    c.backward()
    g_cls, q, k, v = got["o"].grad[0, 0], got["q_proj"][0], got["k_proj"][0], got["v_proj"][0]
    qh = torch.nn.functional.normalize(q[0].reshape(2, 8), dim=-1)
    kh = torch.nn.functional.normalize(k[1:].reshape(16, 2, 8), dim=-1)
    cos = (kh * qh).sum(-1)
    cos = (cos - cos.min(0).values) / (cos.max(0).values - cos.min(0).values)
    ref = torch.relu(((g_cls * v[1:]).reshape(16, 2, 8).sum(-1) * cos).sum(-1)).detach().numpy().reshape(4, 4)
    _close(vc.cam(tr, vc.presets.grad_eclip_paper().replace(**RAW)).values, ref)


def test_attention_methods_on_open_clip_match_numpy():
    """AG-CAM, Grad-SAM and AttCAT on an open_clip tower, against the formulas in NumPy on the stored arrays
    (whose values and gradients tests/unit/model/test_qkv_sites.py checks against independent identities)."""
    model = _clip()
    text = torch.randn(2, 8, generator=torch.Generator().manual_seed(5))
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    tr = vc.trace(model, x, targets=vc.targets.similarity(text), sites=["F2", "attn_scores", "resid_pre"])
    c = int(np.argmax(tr["logits"].values))
    t = int(np.flatnonzero(tr["target_class"].values == c)[0])
    A, S = tr["attn"].values.astype(np.float64), tr["attn_scores"].values.astype(np.float64)
    G = tr["attn_grad"].values[t].astype(np.float64)
    h = tr["act"].sel(site="resid_pre").values.astype(np.float64)
    dh = tr["grad"].sel(site="resid_pre").values[t].astype(np.float64)
    sig = 1 / (1 + np.exp(-S))
    _close(vc.cam(tr, vc.presets.agcam().replace(**RAW)).values,
           (sig * np.maximum(G, 0))[:, :, 0, 1:].sum((0, 1)).reshape(4, 4))
    _close(vc.cam(tr, vc.presets.grad_sam().replace(**RAW)).values,
           (A * np.maximum(G, 0))[:, :, 0, 1:].mean((0, 1)).reshape(4, 4))
    _close(vc.cam(tr, vc.presets.attcat().replace(**RAW)).values,
           ((h * dh).sum(-1) * A.mean(1).mean(1)).sum(0)[1:].reshape(4, 4))


def test_legrad_cls_open_clip_equals_reference():
    model = _clip()
    text = torch.randn(3, 8, generator=torch.Generator().manual_seed(6))
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    tr = vc.trace(model, x, targets=vc.targets.layerwise(vectors=text, readout="model"), sites=["F2"])
    # my own forward of the tower with the attention written out, each block read out through ln_post and proj
    v_ = model.visual
    t = torch.nn.functional.conv2d(x, v_.conv1.weight, stride=8).flatten(2).transpose(1, 2)
    t = v_.ln_pre(torch.cat([v_.class_embedding.view(1, 1, -1), t], 1) + v_.positional_embedding)
    attns, outs = [], []
    for blk in v_.transformer.resblocks:
        q, k, v = torch.nn.functional.linear(blk.ln_1(t), blk.attn.in_proj_weight, blk.attn.in_proj_bias).chunk(3, -1)
        split = [z.reshape(1, 17, 2, 8).transpose(1, 2) for z in (q, k, v)]
        A = torch.softmax((split[0] / np.sqrt(8)) @ split[1].transpose(-2, -1), -1)
        attns.append(A)
        o = (A @ split[2]).transpose(1, 2).reshape(1, 17, 16)
        t = t + blk.ls_1(blk.attn.out_proj(o))
        t = t + blk.ls_2(blk.mlp(blk.ln_2(t)))
        outs.append(t)
    tn = torch.nn.functional.normalize(text, dim=-1)
    read = [tn @ torch.nn.functional.normalize(v_.ln_post(o)[0, 0] @ v_.proj, dim=-1) for o in outs]
    c = int(read[-1].argmax())
    acc = 0
    for s, A in zip(read, attns):
        (g,) = torch.autograd.grad(s[c], [A], retain_graph=True)
        acc = acc + torch.relu(g).mean(1).mean(1)[0]
    np.testing.assert_allclose(tr["logits"].values, torch.stack([r[c] for r in read]).detach().numpy(), rtol=1e-5)
    _close(vc.cam(tr, vc.presets.legrad_cls().replace(**RAW)).values, _grid(acc.detach().numpy()))


# -- Grad-ECLIP's code on timm CLIP-style ViTs and Hugging Face CLIP; the single-head record -------------------
def _random(model):
    """Unit-scale random weights, norm weights near one and non-zero biases (a missing bias term would show)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise / np.sqrt(p[0].numel()) if p.ndim >= 2 else noise / 4 + float(name.endswith("weight")))
    return model.eval()


def _timm_clip():
    torch.manual_seed(0)
    return _random(timm.create_model("vit_base_patch16_clip_224", pretrained=False, img_size=32, patch_size=8,
                                     depth=2, embed_dim=16, num_heads=2, num_classes=0))


def _hf_clip():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, image_size=32, patch_size=8, projection_dim=8)
    torch.manual_seed(0)
    return _random(transformers.CLIPVisionModelWithProjection(cfg))


def _last_input(model, last_of, *args, **kwargs):
    """A copy of the model and the residual stream entering its last block (``last_of(copy)``), from my own
    pre-hook during a forward of the unchanged copy (the earlier blocks are the same in the single-head model)."""
    m = copy.deepcopy(model)
    got = {}

    def pre(_m, a, kw):
        got["t"] = (a[0] if a else kw["hidden_states"]).detach()

    last_of(m).register_forward_pre_hook(pre, with_kwargs=True)
    with torch.no_grad():
        m(*args, **kwargs)
    return m, got["t"]


def _eclip_code(t, qkv, out_proj, rest, read, text):
    """generate_emap.py's grad_eclip on a last block recomputed as ONE head: ``qkv(h)`` the block's q, k, v from
    its input ``t``, ``rest(t, o)`` the block output from the attention output ``o``, ``read`` the embedding."""
    q, k, v = qkv(t)
    o = torch.softmax(q @ k.transpose(-2, -1) / np.sqrt(q.shape[-1]), -1) @ v
    emb = read(rest(t, o))
    c = torch.nn.functional.normalize(emb, dim=-1)[0] @ torch.nn.functional.normalize(text, dim=-1)
    (grad,) = torch.autograd.grad(c, [o])
    qo, ko = out_proj(q)[0], out_proj(k)[0]
    cos = torch.nn.functional.normalize(ko[1:], dim=-1) @ torch.nn.functional.normalize(qo[0], dim=-1)
    lam = (cos - cos.min()) / (cos.max() - cos.min())
    return torch.relu((grad[0, 0] * v[0, 1:]).sum(-1) * lam).detach().numpy().reshape(4, 4)


def test_grad_eclip_timm_clip_equals_official_code():
    model = _timm_clip()
    text = torch.randn(16, generator=torch.Generator().manual_seed(5))
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with vc.adapters.single_head_attention(model):
        tr = vc.trace(model, x, targets=vc.targets.similarity(text[None]), sites=["F3", "q_out", "k_out", "v"],
                      layers=[-1])
    m, t = _last_input(model, lambda c: c.blocks[-1], x)
    last = m.blocks[-1]

    def rest(t, o):
        t2 = t + last.ls1(last.attn.proj(o))
        return t2 + last.ls2(last.mlp(last.norm2(t2)))

    ref = _eclip_code(t, lambda t: last.attn.qkv(last.norm1(t)).chunk(3, -1), last.attn.proj, rest,
                      lambda t2: m.forward_head(m.norm(t2)), text)
    _close(vc.cam(tr, vc.presets.grad_eclip().replace(**RAW)).values, ref)


def test_grad_eclip_hf_clip_equals_official_code():
    model = _hf_clip()
    text = torch.randn(8, generator=torch.Generator().manual_seed(5))
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with vc.adapters.single_head_attention(model):
        tr = vc.trace(model, x, targets=vc.targets.similarity(text[None]), sites=["F3", "q_out", "k_out", "v"],
                      layers=[-1])
    m, t = _last_input(model, lambda c: c.vision_model.encoder.layers[-1], pixel_values=x)
    lay = m.vision_model.encoder.layers[-1]
    a = lay.self_attn

    def rest(t, o):
        t2 = t + a.out_proj(o)
        return t2 + lay.mlp(lay.layer_norm2(t2))

    def read(t2):
        return m.visual_projection(m.vision_model.post_layernorm(t2[:, 0]))

    ref = _eclip_code(t, lambda t: (p(lay.layer_norm1(t)) for p in (a.q_proj, a.k_proj, a.v_proj)), a.out_proj,
                      rest, read, text)
    _close(vc.cam(tr, vc.presets.grad_eclip().replace(**RAW)).values, ref)


def test_grad_eclip_refuses_a_trace_not_made_single_head_and_the_checklist_says_which():
    model = _timm_clip()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    target = vc.targets.similarity(torch.randn(1, 16, generator=torch.Generator().manual_seed(5)))
    sites = ["F3", "q", "k", "q_out", "k_out", "v"]
    plain = vc.trace(model, x, targets=target, sites=sites)
    with vc.adapters.single_head_attention(model):
        single = vc.trace(model, x, targets=target, sites=sites)
    code, paper = vc.presets.grad_eclip(), vc.presets.grad_eclip_paper()
    with pytest.raises(RecipeError, match=r"recomputes block\(s\) \[1\] as ONE head.*own 2 heads.*"
                                          r"single_head_attention\(model, layers=\(1,\)\)"):
        vc.cam(plain, code)
    # every block of the recipe must have run as one head: block 0 did not
    with pytest.raises(RecipeError, match=r"block\(s\) \[0\] as ONE head"):
        vc.cam(single, vc.presets.grad_eclip(layer="all"))
    with pytest.warns(UserWarning, match=r"grad_eclip_paper: this trace ran block\(s\) \[1\] as ONE head"):
        vc.cam(single, paper)
    m = vc.cam(single, code)
    heads = json.loads(m.attrs["checklist"])["aggregation"]["heads"]
    assert heads.startswith("one head over all channels: the trace ran block(s) 1 as ONE head")
    assert "block(s) 1 as ONE head" in m.attrs["methods"]
    assert json.loads(m.attrs["checklist"])["model and input"]["single-head attention"].startswith("block(s) 1 ")
    assert code.checklist(plain)["aggregation"]["heads"].startswith("the model's own 2 heads (not a single-head "
                                                                    "trace): NOT the official code's")
    listed = json.loads(vc.cam(plain, paper).attrs["checklist"])
    assert listed["aggregation"]["heads"] == "one cosine per head of the model's own 2 heads (not a single-head trace)"
    assert "single-head attention" not in listed["model and input"]
