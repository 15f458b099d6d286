"""open_clip image towers and text-prompt targets (issue #9, CLIP part), against an independent reference.

The reference never calls vitcam_nb nor open_clip's attention: :func:`manual_tower` recomputes the whole vision
tower from the weights (conv patch embedding, class token, positional embedding, ln_pre, per block LayerNorm,
in_proj, per-head softmax(q k^T / sqrt(d)), out_proj, layer scale, MLP, ln_post, proj), keeps every site
with ``retain_grad()`` and runs one backward pass per target scalar. The model is tiny and random (built
offline; open_clip ships its BPE vocabulary), with weights redrawn so attention and gradients are O(1).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from vitcam_testing import assert_rel_close, assert_unchanged, plain_presets, snapshot, traced

import vitcam_nb as vc
from vitcam_nb import presets
from vitcam_nb.adapters import find_adapter

open_clip = pytest.importorskip("open_clip")

CORE = ["F1", "F2", "F3", "F4", "F5", "F6"]
EXTENDED = ["resid_pre", "attn_out", "resid_mid"]
ALL_SITES = CORE + EXTENDED
PROMPTS = ["a photo of a dog", "a photo of a cat", "a red car"]
IMG, PATCH, WIDTH, HEADS, DEPTH, EMBED, CTX = 32, 8, 64, 4, 2, 32, 16


def make_clip(seed: int = 0, embed_dim: int = EMBED) -> torch.nn.Module:
    """Tiny open_clip CLIP (2 blocks, layer scale on), weights redrawn at unit scale, eval mode."""
    torch.manual_seed(seed)
    model = open_clip.model.CLIP(
        embed_dim=embed_dim,
        vision_cfg=open_clip.model.CLIPVisionCfg(layers=DEPTH, width=WIDTH, head_width=WIDTH // HEADS,
                                                 patch_size=PATCH, image_size=IMG, ls_init_value=0.5),
        text_cfg=open_clip.model.CLIPTextCfg(context_length=CTX, vocab_size=49408, width=32, heads=2, layers=1),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.visual.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("class_embedding", "positional_embedding"):
                p.copy_(0.5 * noise)
            elif leaf == "proj" or p.ndim >= 2:
                p.copy_(noise / math.sqrt(p.shape[0] if leaf == "proj" else p[0].numel()))
            elif leaf in ("weight", "gamma"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)
    return model.eval()


@pytest.fixture(scope="module")
def clip_model():
    return make_clip()


@pytest.fixture(scope="module")
def tokenizer():
    return open_clip.tokenizer.SimpleTokenizer(context_length=CTX)


@pytest.fixture(scope="module")
def x():
    return torch.randn((1, 3, IMG, IMG), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def text_emb(clip_model, tokenizer):
    with torch.no_grad():
        return clip_model.encode_text(tokenizer(PROMPTS))


@pytest.fixture(scope="module")
def target(clip_model, tokenizer):
    return vc.targets.prompts(PROMPTS, tokenizer=tokenizer, text_model=clip_model)


@pytest.fixture(scope="module")
def full_trace(clip_model, x, target):
    return vc.trace(clip_model, x, targets=target, sites=ALL_SITES)


# --------------------------------------------------------------------------------------------------
# The independent reference


def manual_tower(v: torch.nn.Module, x: torch.Tensor, store: dict) -> torch.Tensor:
    """open_clip's VisionTransformer forward written out from its weights; sites go to ``store``."""
    assert isinstance(v.transformer.resblocks[0].mlp.gelu, torch.nn.GELU)

    def keep(layer, site, t):
        if t.requires_grad:
            t.retain_grad()
        store[(layer, site)] = t

    def ln(mod, t):
        return F.layer_norm(t, (t.shape[-1],), mod.weight, mod.bias, mod.eps)

    t = F.conv2d(x, v.conv1.weight, stride=PATCH).flatten(2).transpose(1, 2)
    t = torch.cat([v.class_embedding.view(1, 1, -1), t], dim=1) + v.positional_embedding
    t = ln(v.ln_pre, t)
    for layer, blk in enumerate(v.transformer.resblocks):
        keep(layer, "resid_pre", t)
        h = ln(blk.ln_1, t)
        keep(layer, "F1", h)
        n, length, d = h.shape
        q, k, val = F.linear(h, blk.attn.in_proj_weight, blk.attn.in_proj_bias).chunk(3, dim=-1)
        q, k, val = (u.reshape(n, length, HEADS, d // HEADS).permute(0, 2, 1, 3) for u in (q, k, val))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // HEADS), dim=-1)
        keep(layer, "F2", a)
        o = (a @ val).permute(0, 2, 1, 3).reshape(n, length, d)
        keep(layer, "F3", o)
        o = F.linear(o, blk.attn.out_proj.weight, blk.attn.out_proj.bias)
        keep(layer, "attn_out", o)
        t = t + o * blk.ls_1.gamma
        keep(layer, "resid_mid", t)
        h = ln(blk.ln_2, t)
        keep(layer, "F4", h)
        m = F.linear(F.gelu(F.linear(h, blk.mlp.c_fc.weight, blk.mlp.c_fc.bias)),
                     blk.mlp.c_proj.weight, blk.mlp.c_proj.bias)
        keep(layer, "F5", m)
        t = t + m * blk.ls_2.gamma
        keep(layer, "F6", t)
    return ln(v.ln_post, t)[:, 0] @ v.proj


def reference_scores(emb: torch.Tensor, text: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * F.cosine_similarity(emb, text, dim=-1)


def reference(model, x, text, scale, target_class):
    """{(layer, site): (act, grad)} of one target scalar (-1: the expected score) and the scores."""
    store: dict = {}
    with torch.enable_grad():
        xx = x.detach().clone().requires_grad_(True)
        z = reference_scores(manual_tower(model.visual, xx, store), text, scale)
        scalar = (torch.softmax(z.detach(), 0) * z).sum() if target_class < 0 else z[target_class]
        grads = torch.autograd.grad(scalar, [store[k] for k in store], allow_unused=True)
    out = {}
    for key, g in zip(store, grads, strict=True):
        act = store[key].detach()[0].double().numpy()
        out[key] = (act, np.zeros_like(act) if g is None else g[0].double().numpy())
    return out, z.detach().double().numpy()


@pytest.fixture(scope="module")
def references(clip_model, x, text_emb):
    scale = float(clip_model.logit_scale.detach().exp())
    return {c: reference(clip_model, x, text_emb, scale, c) for c in [0, 1, 2, -1]}






def check_site(tr, references, site):
    for target, c in zip(tr["target"].values, tr["target_class"].values, strict=True):
        ref, _ = references[int(c)]
        for layer in range(DEPTH):
            act, grad = ref[(layer, site)]
            assert_rel_close(traced(tr, site, layer), act, f"act {site}@{layer}")
            assert_rel_close(traced(tr, site, layer, target), grad, f"grad {site}@{layer} {target}")
            if site != "F2" and not (site in ("F3", "F4", "F5", "F6", "attn_out", "resid_mid") and layer == DEPTH - 1):
                # a non-trivial comparison: patch tokens do carry gradient here
                assert np.abs(grad[1:]).max() > 1e-6, f"{site}@{layer}: reference gradient is all zero"


# --------------------------------------------------------------------------------------------------
# (a) the patched attention is the original one, and everything is restored


def test_reference_forward_is_open_clip(clip_model, x):
    with torch.no_grad():
        ours = manual_tower(clip_model.visual, x, {})
        theirs = clip_model.encode_image(x)
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


@pytest.mark.parametrize("whole", [True, False], ids=["clip", "visual"])
def test_patched_forward_matches_and_restores(clip_model, x, whole):
    model = clip_model if whole else clip_model.visual
    before = snapshot(model)
    mha_class_forward = type(clip_model.visual.transformer.resblocks[0].attn).forward
    with torch.enable_grad():
        original = model.encode_image(x) if whole else model(x)
        with find_adapter(model).patched(model):
            for blk in clip_model.visual.transformer.resblocks:
                assert isinstance(blk.attn.attn_probs, torch.nn.Identity)
                assert "forward" in blk.attn.__dict__
            patched = model.encode_image(x) if whole else model(x)
    assert patched.requires_grad
    assert float((patched - original).detach().abs().max()) <= 1e-6
    assert_unchanged(before, model)
    for blk in clip_model.visual.transformer.resblocks:
        assert "attn_probs" not in blk.attn._modules and not hasattr(blk.attn, "attn_probs")
        assert "forward" not in blk.attn.__dict__ and type(blk.attn).forward is mha_class_forward


def test_patch_restored_on_exception(clip_model, x):
    before = snapshot(clip_model)
    with pytest.raises(RuntimeError, match="boom"), find_adapter(clip_model).patched(clip_model):
        raise RuntimeError("boom")
    assert_unchanged(before, clip_model)
    assert not any(hasattr(b.attn, "attn_probs") for b in clip_model.visual.transformer.resblocks)


def test_trace_leaves_model_unchanged(clip_model, x, target):
    clip_model.visual.transformer.resblocks[0].train()  # a mixed train/eval state must come back as it was
    try:
        before = snapshot(clip_model)
        vc.trace(clip_model, x, targets=target, sites=ALL_SITES)
        assert_unchanged(before, clip_model)
        with pytest.raises(vc.TraceError, match="image: the model expects 32x32"):
            vc.trace(clip_model, torch.zeros(1, 3, 40, 40), targets=target)
        assert_unchanged(before, clip_model)
    finally:
        clip_model.visual.transformer.resblocks[0].eval()


# --------------------------------------------------------------------------------------------------
# (b) every site against the reference


@pytest.mark.parametrize("site", CORE, ids=[f"open_clip-{s}" for s in CORE])
def test_site_reference(full_trace, references, site):
    check_site(full_trace, references, site)


@pytest.mark.parametrize("site", EXTENDED)
def test_extended_site_reference(full_trace, references, site):
    check_site(full_trace, references, site)


def test_layout_and_attrs(full_trace):
    tr = full_trace
    grid = IMG // PATCH
    assert list(tr["token_kind"].values) == ["cls"] + ["patch"] * grid * grid
    assert list(tr["patch_row"].values[1:]) == [r for r in range(grid) for _ in range(grid)]
    assert list(tr["patch_col"].values[1:]) == list(range(grid)) * grid
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"], tr.attrs["num_prefix_tokens"]) == (grid, grid, 1)
    assert (tr.attrs["num_heads"], tr.attrs["head_dim"], tr.attrs["num_layers"]) == (HEADS, WIDTH // HEADS, DEPTH)
    assert tr.attrs["model_family"] == "open_clip" and tr.attrs["global_pool"] == "tok"
    assert tr.attrs["hook_F2"] == "visual.transformer.resblocks.{layer}.attn.attn_probs:output"
    assert tr.attrs["hook_F3"] == "visual.transformer.resblocks.{layer}.attn.out_proj:input"
    assert list(tr["target_label"].values) == PROMPTS + ["expected logit"]
    assert list(tr["class_label"].values) == PROMPTS
    np.testing.assert_allclose(tr["attn"].sum("key").values, 1.0, atol=1e-5)


def test_bare_tower_trace_equals_whole_model(clip_model, x, target, full_trace):
    tr = vc.trace(clip_model.visual, x, targets=target, sites=ALL_SITES)
    for var in ("act", "grad", "attn", "attn_grad", "logits"):
        np.testing.assert_allclose(tr[var].values, full_trace[var].values, rtol=1e-5, atol=1e-6)
    assert tr.attrs["hook_F1"] == "transformer.resblocks.{layer}.ln_1:output"
    assert tr.attrs["embedding_output"] == "VisionTransformer.forward"
    assert full_trace.attrs["embedding_output"] == "CLIP.encode_image"


def test_sequence_first_blocks(x, target, full_trace):
    """Older open_clip ran its blocks on (L, N, D); the same weights traced that way give the same trace."""
    model = make_clip()
    model.visual.transformer.batch_first = False
    for blk in model.visual.transformer.resblocks:
        blk.attn.batch_first = False
    tr = vc.trace(model, x, targets=target, sites=ALL_SITES)
    for var in ("act", "grad", "attn", "attn_grad", "logits"):
        np.testing.assert_allclose(tr[var].values, full_trace[var].values, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# (c) the scores are scaled cosine similarities


@pytest.mark.parametrize("logit_scale", [True, False, 2.5], ids=["model", "none", "given"])
def test_logits_are_scaled_cosine(clip_model, tokenizer, x, text_emb, logit_scale):
    t = vc.targets.prompts(PROMPTS, tokenizer=tokenizer, text_model=clip_model, logit_scale=logit_scale)
    tr = vc.trace(clip_model, x, targets=t, sites=["F1"])
    scale = {True: float(clip_model.logit_scale.detach().exp()), False: 1.0, 2.5: 2.5}[logit_scale]
    with torch.no_grad():
        img = clip_model.encode_image(x)
    expected = (scale * F.cosine_similarity(img, text_emb, dim=-1)).numpy()
    np.testing.assert_allclose(tr["logits"].values, expected, rtol=1e-5, atol=1e-6)
    assert tr.attrs["similarity_scale"] == pytest.approx(scale)
    assert f"times {scale:g}" in tr.attrs["target_scores"]
    assert "cosine similarity" in tr.attrs["target_scores"] and "3 open_clip text embeddings" in tr.attrs[
        "target_scores"]
    m = vc.cam(tr, presets.gradcam())
    assert json.loads(m.attrs["checklist"])["gradient target"]["scores"] == tr.attrs["target_scores"]


def test_prob_target_is_zero_shot_softmax(full_trace, clip_model, x, text_emb):
    with torch.no_grad():
        z = reference_scores(clip_model.encode_image(x), text_emb, float(clip_model.logit_scale.detach().exp()))
    np.testing.assert_allclose(np.exp(full_trace["logits"].values) / np.exp(full_trace["logits"].values).sum(),
                               torch.softmax(z, 0).numpy(), rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# (d) every preset


@pytest.mark.parametrize("name", plain_presets())
def test_every_preset_finite(full_trace, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a degenerate map (e.g. last-block F3-F6) is zeros with a warning
        m = vc.cam(full_trace, presets.get(name))
    assert m.shape == (IMG, IMG)
    assert np.isfinite(m.values).all()


# --------------------------------------------------------------------------------------------------
# preprocessing and the lazy import


def test_preprocessing_is_open_clip_eval_transform(clip_model):
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (45, 60, 3), dtype=np.uint8)
    ours = vc.preprocess.prepare_input(clip_model, pixels)
    theirs = open_clip.transform.image_transform(IMG, is_train=False)(Image.fromarray(pixels))
    np.testing.assert_allclose(ours.tensor[0].numpy(), theirs.numpy(), atol=1e-6)
    cfg = vc.preprocess.data_config(clip_model.visual)
    assert cfg["input_size"] == (3, IMG, IMG) and cfg["interpolation"] == "bicubic" and cfg["crop_pct"] == 1.0
    assert cfg["mean"] == pytest.approx(open_clip.constants.OPENAI_DATASET_MEAN)


def test_preprocess_cfg_is_honoured():
    model = make_clip()
    open_clip.model.set_model_preprocess_cfg(model, {"size": IMG, "mean": (0.5, 0.5, 0.5), "std": (0.25,) * 3,
                                                     "interpolation": "bilinear", "resize_mode": "squash"})
    cfg = vc.preprocess.data_config(model)
    assert cfg["mean"] == (0.5, 0.5, 0.5) and cfg["std"] == (0.25, 0.25, 0.25)
    assert cfg["interpolation"] == "bilinear" and cfg["crop_mode"] == "squash"


def test_open_clip_not_imported_by_vitcam_nb():
    code = "import sys, vitcam_nb, vitcam_nb.adapters as a; assert 'open_clip' in a.supported_families(); " \
           "assert 'open_clip' not in sys.modules, 'open_clip imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------------
# (e) bad input


def test_empty_prompt_list(clip_model, tokenizer):
    with pytest.raises(vc.TraceError, match="texts: expected at least one prompt"):
        vc.targets.prompts([], tokenizer=tokenizer, text_model=clip_model)


@pytest.mark.parametrize("bad", ["", "   "], ids=["empty", "spaces"])
def test_prompt_without_tokens(clip_model, tokenizer, bad):
    with pytest.raises(vc.TraceError, match="texts: .*tokenise to nothing"):
        vc.targets.prompts(["a dog", bad], tokenizer=tokenizer, text_model=clip_model)


@pytest.mark.parametrize("texts,match", [("a dog", "texts: expected a list.*wrap a single prompt"),
                                         (["a dog", 3], "texts: prompt 1 is a int")], ids=["str", "not-str"])
def test_prompts_of_wrong_type(clip_model, tokenizer, texts, match):
    with pytest.raises(TypeError, match=match):
        vc.targets.prompts(texts, tokenizer=tokenizer, text_model=clip_model)


def test_text_embedding_size_mismatch(clip_model, tokenizer, x):
    other = make_clip(embed_dim=16)
    t = vc.targets.prompts(PROMPTS, tokenizer=tokenizer, text_model=other)
    assert t.vectors.shape == (3, 16)
    before = snapshot(clip_model)
    for model in (clip_model, clip_model.visual):
        with pytest.raises(vc.TraceError, match="text_model: its text embeddings have 16 dimensions.* 32"):
            vc.trace(model, x, targets=t)
    assert_unchanged(before, clip_model)


@pytest.mark.parametrize("tok", ["not a tokenizer", lambda texts: [[1, 2]] * len(texts), lambda texts: 1 / 0],
                         ids=["str", "returns-list", "raises"])
def test_wrong_tokenizer(clip_model, tok):
    with pytest.raises(TypeError, match="tokenizer: "):
        vc.targets.prompts(PROMPTS, tokenizer=tok, text_model=clip_model)


def test_wrong_text_model(clip_model, tokenizer):
    with pytest.raises(TypeError, match="text_model: expected an open_clip model with encode_text"):
        vc.targets.prompts(PROMPTS, tokenizer=tokenizer, text_model=clip_model.visual)
    with pytest.raises(TypeError, match="text_model: expected an open_clip model"):
        vc.targets.prompts(PROMPTS, tokenizer=tokenizer, text_model="ViT-B-32")


def test_tokenizer_of_another_model(clip_model):
    # ids beyond the text tower's vocabulary: the embedding lookup fails, and the message names text_model
    big = open_clip.tokenizer.SimpleTokenizer(context_length=CTX)
    small = open_clip.model.CLIP(embed_dim=EMBED, vision_cfg=open_clip.model.CLIPVisionCfg(
        layers=1, width=32, head_width=16, patch_size=8, image_size=16),
        text_cfg=open_clip.model.CLIPTextCfg(context_length=CTX, vocab_size=100, width=32, heads=2, layers=1))
    with pytest.raises(TypeError, match="text_model: encode_text failed"):
        vc.targets.prompts(PROMPTS, tokenizer=big, text_model=small)


@pytest.mark.parametrize("scale", [-1.0, float("nan"), "100"], ids=["negative", "nan", "str"])
def test_bad_logit_scale(clip_model, tokenizer, scale):
    with pytest.raises(vc.TraceError, match="logit_scale: expected True, False or a finite number"):
        vc.targets.prompts(PROMPTS, tokenizer=tokenizer, text_model=clip_model, logit_scale=scale)


def test_duplicate_prompts(clip_model, tokenizer):
    with pytest.raises(vc.TraceError, match="texts: duplicate prompts"):
        vc.targets.prompts(["a dog", "a dog"], tokenizer=tokenizer, text_model=clip_model)


def test_custom_attention_blocks_refused(x):
    torch.manual_seed(0)
    model = open_clip.model.CLIP(embed_dim=EMBED, vision_cfg=open_clip.model.CLIPVisionCfg(
        layers=1, width=32, head_width=16, patch_size=8, image_size=IMG, qk_norm=True),
        text_cfg=open_clip.model.CLIPTextCfg(context_length=CTX, vocab_size=49408, width=32, heads=2, layers=1))
    t = vc.targets.similarity(torch.ones(1, EMBED), ["one"])
    before = snapshot(model)
    with pytest.raises(vc.TraceError, match="custom attention"):
        vc.trace(model, x, targets=t)
    assert_unchanged(before, model)
