"""BLIP image-text matching (issue #9, ``vitcam_nb[vlm]``): the blip adapter, the ``itm`` target and the
cross-attention site ``xattn``, against an independent reference.

The model is a tiny random-init ``BlipForImageTextRetrieval`` built offline (2 vision + 2 text layers, 2 heads,
32x32 input, 4x4 patch grid), weights re-drawn at a scale where attention and gradients are O(1). Token ids
are written by hand; a fake tokenizer names them. The reference never calls vitcam_nb: its own hooks keep the
hooked tensors with ``retain_grad()`` and one fresh forward + ``backward()`` runs per target scalar; the
acceptance maps are recomputed in NumPy from that reference.

The model, its text and the hand computation of a map are defined here for the other ``test_blip_*.py`` files
(and tests/unit/analysis/test_ambiguity_spatial.py); the ``blip`` and ``blip_trace`` fixtures are in
``conftest.py``.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from vitcam_testing import assert_rel_close, traced

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")

CORE = ["F1", "F2", "F3", "F4", "F5", "F6"]
EXTENDED = ["resid_pre", "attn_out", "resid_mid"]
GRID = 4
# "[CLS] a dog on a sofa [SEP] [PAD]": "a" occurs twice, the padding token is masked out.
VOCAB = {0: "[PAD]", 1: "[CLS]", 2: "[SEP]", 5: "a", 6: "dog", 7: "on", 9: "sofa"}
IDS = torch.tensor([[1, 5, 6, 7, 5, 9, 2, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])


class FakeTokenizer:
    """Just what vitcam_nb reads from a Hugging Face tokenizer."""

    all_special_ids = [0, 1, 2]

    def convert_ids_to_tokens(self, ids):
        return [VOCAB.get(int(i), f"tok{int(i)}") for i in ids]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(VOCAB.get(int(i), "?") for i in ids if not (skip_special_tokens and i in (0, 1, 2)))


def make_blip(seed: int = 0, cross_attention: bool = True) -> torch.nn.Module:
    """A tiny BLIP ITM model with O(1) weights (the Hugging Face init gives near-zero gradients)."""
    cfg = transformers.BlipConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
                         sep_token_id=2, is_decoder=cross_attention),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           image_size=32, patch_size=8),
        image_text_hidden_size=16,
    )
    torch.manual_seed(seed)
    model = transformers.BlipForImageTextRetrieval(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name.lower() and leaf == "weight":
                p.copy_(1.0 + 0.2 * noise)
            elif leaf in ("class_embedding", "position_embedding"):
                p.copy_(0.5 * noise)
            elif p.ndim >= 2:
                p.copy_(noise / math.sqrt(p[0].numel()))
            else:
                p.copy_(0.1 * noise)
    return model.eval()


def make_x(seed: int = 0) -> torch.Tensor:
    return torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(1000 + seed))


def itm_target(match: bool = True):
    return vc.targets.itm(IDS, MASK, match=match, tokenizer=FakeTokenizer())


# --------------------------------------------------------------------------------------------------
# The independent reference


@contextlib.contextmanager
def reference_hooks(model):
    """My own hooks on every vision site and every cross-attention; yields {(layer, site): tensor}."""
    store, handles = {}, []

    def keep(key, t):
        if isinstance(t, tuple):
            t = t[0]
        assert key not in store, f"{key} fired twice"
        t.retain_grad()
        store[key] = t

    def out_hook(key):
        return lambda _m, _i, out: keep(key, out)

    def in_hook(key):
        return lambda _m, args: keep(key, args[0])

    try:
        for i, layer in enumerate(model.vision_model.encoder.layers):
            handles += [
                layer.layer_norm1.register_forward_hook(out_hook((i, "F1"))),
                layer.self_attn.dropout.register_forward_hook(out_hook((i, "F2"))),
                layer.self_attn.projection.register_forward_pre_hook(in_hook((i, "F3"))),
                layer.layer_norm2.register_forward_hook(out_hook((i, "F4"))),
                layer.mlp.register_forward_hook(out_hook((i, "F5"))),
                layer.register_forward_hook(out_hook((i, "F6"))),
                layer.register_forward_pre_hook(in_hook((i, "resid_pre"))),
                layer.self_attn.register_forward_hook(out_hook((i, "attn_out"))),
                layer.layer_norm2.register_forward_pre_hook(in_hook((i, "resid_mid"))),
            ]
        for i, layer in enumerate(model.text_encoder.encoder.layer):
            handles.append(layer.crossattention.self.dropout.register_forward_hook(out_hook((i, "xattn"))))
            # the query input of the cross-attention, to recompute its probabilities by hand
            handles.append(layer.crossattention.self.register_forward_pre_hook(in_hook((i, "xattn_query_in"))))
        yield store
    finally:
        for h in handles:
            h.remove()


def expected_logit(z):
    return (torch.softmax(z.detach(), dim=0) * z).sum()


SCALARS = {
    "logit_1": lambda z: z[1],
    "logit_0": lambda z: z[0],
    "expected_logit": expected_logit,
    "prob_1": lambda z: torch.softmax(z, 0)[1],
    "logprob_1": lambda z: torch.log_softmax(z, 0)[1],
}


def reference(model, x, scalar):
    """Fresh forward + backward of ``scalar(itm logits)``: ({(layer, site): (act, grad)}, logits, image embeds)."""
    saved = [(p, p.grad) for p in model.parameters()]
    with reference_hooks(model) as store, torch.enable_grad():
        out = model(pixel_values=x.clone(), input_ids=IDS, attention_mask=MASK, use_itm_head=True)
        z = out.itm_score[0]
        SCALARS[scalar](z).backward()
        ref = {k: (t.detach()[0].double().numpy().copy(),
                   None if t.grad is None else t.grad[0].double().numpy().copy()) for k, t in store.items()}
    for p, g in saved:
        p.grad = g
    return ref, z.detach().double().numpy(), out.last_hidden_state.detach()


@pytest.fixture(scope="module")
def refs(blip):
    return {name: reference(blip, make_x(), name) for name in SCALARS}


# --------------------------------------------------------------------------------------------------
# (a) stored activations and gradients against the reference


@pytest.mark.parametrize("site", CORE, ids=[f"blip-{s}" for s in CORE])
def test_site_reference(blip_trace, refs, site):
    tr = blip_trace
    assert list(tr["target"].values) == ["logit_1", "logit_0", "expected_logit"]
    for target in ("logit_1", "logit_0", "expected_logit"):
        ref = refs[target][0]
        for layer in range(2):
            act, grad = ref[(layer, site)]
            assert_rel_close(traced(tr, site, layer), act, f"act {site}@{layer}")
            assert_rel_close(traced(tr, site, layer, target), grad, f"grad {site}@{layer} {target}")
            assert np.abs(grad).max() > 1e-3, f"{site}@{layer}: reference gradient too small to test anything"


def test_extended_sites_reference(blip_trace, refs):
    for site in EXTENDED:
        for layer in range(2):
            act, grad = refs["logit_1"][0][(layer, site)]
            assert_rel_close(traced(blip_trace, site, layer), act, f"act {site}@{layer}")
            assert_rel_close(traced(blip_trace, site, layer, "logit_1"), grad, f"grad {site}@{layer}")


def test_xattn_reference(blip_trace, refs):
    tr = blip_trace
    assert tr["xattn"].dims == ("xattn_layer", "head", "text_token", "key")
    assert tr["xattn_grad"].dims == ("target", "xattn_layer", "head", "text_token", "key")
    assert tr["xattn"].shape == (2, 2, IDS.shape[1], 1 + GRID * GRID)
    for target in ("logit_1", "logit_0", "expected_logit"):
        for layer in range(2):
            act, grad = refs[target][0][(layer, "xattn")]
            assert_rel_close(tr["xattn"].sel(xattn_layer=layer).values, act, f"xattn@{layer}")
            assert_rel_close(tr["xattn_grad"].sel(xattn_layer=layer, target=target).values, grad,
                             f"xattn_grad@{layer} {target}")


def test_xattn_is_text_queries_over_the_vision_tokens(blip, blip_trace, refs):
    """Recompute each cross-attention by hand from the query input and the vision tower's output tokens."""
    ref, _, image_embeds = refs["logit_1"]
    for layer, text_layer in enumerate(blip.text_encoder.encoder.layer):
        sa = text_layer.crossattention.self
        q_in = torch.from_numpy(ref[(layer, "xattn_query_in")][0]).double()
        heads, d = sa.num_attention_heads, sa.attention_head_size

        def proj(lin, h):
            return torch.nn.functional.linear(h, lin.weight.detach().double(), lin.bias.detach().double())

        q = proj(sa.query, q_in).view(-1, heads, d).transpose(0, 1)
        k = proj(sa.key, image_embeds[0].double()).view(-1, heads, d).transpose(0, 1)
        manual = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1).numpy()
        assert_rel_close(blip_trace["xattn"].sel(xattn_layer=layer).values, manual, f"manual xattn@{layer}")
    np.testing.assert_allclose(blip_trace["xattn"].values.sum(-1), 1.0, rtol=1e-5)


def test_vision_site_meanings_recomputed_from_weights(blip, blip_trace):
    """Each vision site is what docs/architecture.md ("The sites") says, rebuilt from the weights and resid_pre."""
    F = torch.nn.functional

    def t(site, layer):
        return torch.from_numpy(traced(blip_trace, site, layer)).double()

    def w(p):
        return p.detach().double()

    for i, layer in enumerate(blip.vision_model.encoder.layers):
        ln1, ln2, attn = layer.layer_norm1, layer.layer_norm2, layer.self_attn
        r0 = t("resid_pre", i)
        n, c = r0.shape
        heads, d = attn.num_heads, attn.head_dim
        f1 = F.layer_norm(r0, (c,), w(ln1.weight), w(ln1.bias), ln1.eps)
        q, k, v = F.linear(f1, w(attn.qkv.weight), w(attn.qkv.bias)).view(n, 3, heads, d).permute(1, 2, 0, 3)
        f2 = torch.softmax(q @ k.transpose(-1, -2) * d**-0.5, dim=-1)
        f3 = (f2 @ v).transpose(0, 1).reshape(n, c)
        mid = r0 + F.linear(f3, w(attn.projection.weight), w(attn.projection.bias))
        f4 = F.layer_norm(mid, (c,), w(ln2.weight), w(ln2.bias), ln2.eps)
        f5 = F.linear(F.gelu(F.linear(f4, w(layer.mlp.fc1.weight), w(layer.mlp.fc1.bias))),
                      w(layer.mlp.fc2.weight), w(layer.mlp.fc2.bias))
        for site, value in (("F1", f1), ("F3", f3), ("resid_mid", mid), ("F4", f4), ("F5", f5),
                            ("F6", mid + f5)):
            assert_rel_close(t(site, i), value.numpy(), f"{site}@{i} by hand", rel=1e-4)
        assert_rel_close(traced(blip_trace, "F2", i), f2.numpy(), f"F2@{i} by hand", rel=1e-4)


def test_trace_layout_and_coordinates(blip_trace):
    tr = blip_trace
    assert tr.attrs["model_family"] == "blip" and tr.attrs["target_kind"] == "itm"
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"], tr.attrs["num_prefix_tokens"]) == (GRID, GRID, 1)
    assert tr.attrs["hook_F2"] == "vision_model.encoder.layers.{layer}.self_attn.dropout:output"
    assert tr.attrs["hook_F3"] == "vision_model.encoder.layers.{layer}.self_attn.projection:input"
    assert "'a dog on a sofa'" in tr.attrs["target_scores"]
    assert list(tr["class_label"].values) == ["no match", "match"]
    assert list(tr["text_token_str"].values) == ["[CLS]", "a", "dog", "on", "a", "sofa", "[SEP]", "[PAD]"]
    assert list(tr["text_token_mask"].values) == MASK[0].tolist()
    assert list(tr["xattn_layer"].values) == [0, 1]
    # image keys: the class token, then the 4x4 patches in raster order, the same coordinates as F2's keys
    assert list(tr["key_kind"].values) == ["cls"] + ["patch"] * 16
    assert list(tr["key_patch_row"].values) == [-1] + [r for r in range(4) for _ in range(4)]
    assert list(tr["key_patch_col"].values) == [-1] + list(range(4)) * 4
    for k, v in tr.attrs.items():
        assert isinstance(v, (str, int, float)) and not isinstance(v, bool), f"attr {k} is {type(v)}"


def test_xattn_only_trace_writes_its_own_key_coordinates(blip, blip_trace):
    tr = vc.trace(blip, make_x(), targets=itm_target(), sites=["xattn"])
    assert "attn" not in tr and "act" not in tr
    for name in ("key_kind", "key_patch_row", "key_patch_col"):
        assert list(tr[name].values) == list(blip_trace[name].values)
    np.testing.assert_array_equal(tr["xattn_grad"].values, blip_trace["xattn_grad"].values)
    r = vc.Recipe(site="xattn", layer=0, class_=1, text_tokens=2, upsample="none")
    np.testing.assert_array_equal(vc.cam(tr, r).values, vc.cam(blip_trace, r).values)


def test_default_sites_include_xattn_and_tokens_without_tokenizer(blip):
    tr = vc.trace(blip, make_x(), targets=vc.targets.itm(IDS[0, :7]))
    assert {"act", "attn", "xattn", "xattn_grad"} <= set(tr.data_vars)
    assert list(tr["site"].values) == ["F1", "F3", "F4", "F5", "F6"]
    assert list(tr["text_token_str"].values) == [f"[{i}]" for i in IDS[0, :7].tolist()]


def test_adapter_registered_without_importing_transformers():
    code = ("import sys, vitcam_nb\n"
            "assert 'blip' in vitcam_nb.adapters.supported_families()\n"
            "assert 'transformers' not in sys.modules, 'importing vitcam_nb imported transformers'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --------------------------------------------------------------------------------------------------
# (b) acceptance: the xattn map is the grad-weighted attention of the chosen text row, by hand


def hand_map(A, G, weighting, heads, relu):
    """A, G: (head, key) rows of the reference. Map over the 4x4 patch grid, raster order, in NumPy."""
    A, G = A[:, 1:], G[:, 1:]  # drop the CLS key
    if weighting == "layercam":
        per_head = np.maximum(G, 0) * A
    elif weighting == "hirescam":
        per_head = G * A
    elif weighting == "gradcam":
        per_head = G.mean(axis=1, keepdims=True) * A
    else:  # gradient
        per_head = G
    m = per_head.sum(0) if heads == "channels" else per_head.mean(0)
    if relu == "after":
        m = np.maximum(m, 0)
    return m.reshape(GRID, GRID)


CASES = [  # (layer, text_tokens, weighting, heads, relu)
    (-1, 0, "layercam", "mean_then_relu", "after"),  # the ALBEF/BLIP Grad-CAM, on the row the ITM head reads
    (-1, 0, "hirescam", "channels", "none"),
    (0, 2, "layercam", "channels", "none"),
    (0, 3, "gradcam", "channels", "none"),
    (0, 5, "gradient", "mean_then_relu", "none"),
]


@pytest.mark.parametrize("layer,token,weighting,heads,relu", CASES,
                         ids=[f"L{c[0]}-t{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_acceptance_xattn_map_is_grad_weighted_attention_row(blip_trace, refs, layer, token, weighting, heads,
                                                            relu):
    ref = refs["logit_1"][0][(layer % 2, "xattn")]
    expected = hand_map(ref[0][:, token, :], ref[1][:, token, :], weighting, heads, relu)
    assert np.ptp(expected) > 1e-3, "the reference map is flat; the case tests nothing"
    r = vc.Recipe(site="xattn", layer=layer, class_=1, text_tokens=token, weighting=weighting, heads=heads,
                  upsample="none", normalize="none", relu=relu)
    m = vc.cam(blip_trace, r)
    assert m.dims == ("patch_row", "patch_col") and m.attrs["degenerate"] == ""
    assert_rel_close(m.values, expected, f"xattn map {r.id}")


def test_xattn_text_token_selections(blip_trace, refs):
    A, G = refs["logit_1"][0][(0, "xattn")]
    base = dict(site="xattn", layer=0, class_=1, weighting="layercam", upsample="none", normalize="none",
                relu="none")
    # "all": the mean over the 7 unmasked rows (the [PAD] row is left out), then the weighting
    rows = [0, 1, 2, 3, 4, 5, 6]
    expected = hand_map(A[:, rows].mean(1), G[:, rows].mean(1), "layercam", "channels", "none")
    assert_rel_close(vc.cam(blip_trace, vc.Recipe(**base, text_tokens="all")).values, expected, "all")
    # a word occurring twice: the mean of both rows; a word occurring once: its row; "cls": position 0
    expected = hand_map(A[:, [1, 4]].mean(1), G[:, [1, 4]].mean(1), "layercam", "channels", "none")
    assert_rel_close(vc.cam(blip_trace, vc.Recipe(**base, text_tokens="a")).values, expected, "word a")
    assert_rel_close(vc.cam(blip_trace, vc.Recipe(**base, text_tokens="DOG")).values,
                     hand_map(A[:, 2], G[:, 2], "layercam", "channels", "none"), "word dog")
    np.testing.assert_array_equal(vc.cam(blip_trace, vc.Recipe(**base, text_tokens="cls")).values,
                                  vc.cam(blip_trace, vc.Recipe(**base, text_tokens=0)).values)


def test_xattn_layer_fusion_and_upsampling(blip_trace, refs):
    per_layer = []
    for layer in (0, 1):
        A, G = refs["logit_1"][0][(layer, "xattn")]
        m = hand_map(A[:, 0], G[:, 0], "layercam", "mean_then_relu", "after")
        per_layer.append((m - m.min()) / (m.max() - m.min()))
    fused = np.mean(per_layer, axis=0)
    fused = (fused - fused.min()) / (fused.max() - fused.min())
    r = vc.Recipe(site="xattn", layer="all", layer_fusion="mean", class_=1, text_tokens="cls",
                  weighting="layercam", heads="mean_then_relu", upsample="none")
    assert_rel_close(vc.cam(blip_trace, r).values, fused, "mean over xattn layers")
    up = vc.cam(blip_trace, r.replace(upsample="bilinear"))
    assert up.dims == ("y", "x") and up.shape == (32, 32)
    t = torch.nn.functional.interpolate(torch.from_numpy(fused)[None, None], size=(32, 32), mode="bilinear",
                                        align_corners=False)[0, 0].numpy()
    assert_rel_close(up.values, (t - t.min()) / (t.max() - t.min()), "bilinear upsampling", rel=1e-4)


# --------------------------------------------------------------------------------------------------
# (c) the ITM logits and the derived probability target


def test_itm_logits_equal_the_models_itm_score(blip, blip_trace):
    with torch.no_grad():
        own = blip(pixel_values=make_x(), input_ids=IDS, attention_mask=MASK, use_itm_head=True).itm_score[0]
    assert_rel_close(blip_trace["logits"].values, own.numpy(), "itm logits")
    no = vc.trace(blip, make_x(), targets=itm_target(match=False), sites=["xattn"])
    assert list(no["target"].values) == ["logit_0", "logit_1", "expected_logit"]
    assert no.attrs["trace_id"] != blip_trace.attrs["trace_id"]


@pytest.mark.parametrize("target", ["prob", "logprob"])
def test_prob_target_equals_softmax_gradient(blip_trace, refs, target):
    for layer, token in ((0, 2), (1, 0)):
        A, G = refs[f"{target}_1"][0][(layer, "xattn")]
        expected = hand_map(A[:, token], G[:, token], "gradient", "channels", "none")
        r = vc.Recipe(site="xattn", layer=layer, class_=1, target=target, text_tokens=token, weighting="gradient",
                      upsample="none", normalize="none", relu="none")
        assert_rel_close(vc.cam(blip_trace, r).values, expected, f"{target} xattn@{layer}")
    # the vision sites derive it the same way
    act, grad = refs[f"{target}_1"][0][(0, "F1")]
    r = vc.Recipe(site="F1", layer=0, class_=1, target=target, weighting="gradient", upsample="none",
                  normalize="none", relu="none")
    assert_rel_close(vc.cam(blip_trace, r).values, grad[1:].sum(1).reshape(GRID, GRID), f"{target} F1")
