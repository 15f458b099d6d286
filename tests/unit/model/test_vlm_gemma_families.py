"""PaliGemma and Gemma 3 traced on tiny random configs built in code (issue 55): every site's stored gradient
(SigLIP tower F1..F6, projector, lm_resid, lm_attn) equals torch.autograd's at the image-token positions, and a
Grad-CAM map of an answer token at ``lm_resid`` (and at the tower) equals a hand-written hook-and-autograd
reference placed by the family's layout (PaliGemma: one token per patch, image first; Gemma 3: 2x2-pooled
tokens between begin/end-of-image)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from vitcam_testing import assert_rel_close
from vlm_marks import answer_gradients

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")

IMG, BOI, EOI, W, PATCH = 5, 3, 4, 32, 8
ANSWER = [9, 10, 11]
TOWER = ("F1", "F2", "F3", "F4", "F5", "F6")
# family -> (pixels, tokens grid side, prompt)
SETUP = {"paligemma": (32, 4, [IMG] * 16 + [2, 7, 8]),
         "gemma3": (64, 4, [2, BOI] + [IMG] * 16 + [EOI, 7, 8])}


def make(family: str) -> torch.nn.Module:
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        SiglipVisionConfig,
    )

    torch.manual_seed(0)
    px = SETUP[family][0]
    v = SiglipVisionConfig(hidden_size=W, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                           image_size=px, patch_size=PATCH)
    text = dict(vocab_size=64, hidden_size=W, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16)
    if family == "paligemma":
        cfg = PaliGemmaConfig(vision_config=v, text_config=GemmaConfig(**text), image_token_index=IMG,
                              projection_dim=W)
        return PaliGemmaForConditionalGeneration(cfg).eval()
    cfg = Gemma3Config(vision_config=v, text_config=Gemma3TextConfig(**text), image_token_index=IMG,
                       boi_token_index=BOI, eoi_token_index=EOI, mm_tokens_per_image=16)  # 8x8 patches -> 4x4
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random init leaves the projector's matrix at zero: no gradient would reach the tower
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    return model


def make_x(family: str) -> torch.Tensor:
    px = SETUP[family][0]
    return torch.randn(1, 3, px, px, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=["paligemma", "gemma3"])
def case(request):
    family = request.param
    model = make(family)
    t = vc.targets.answer(input_ids=SETUP[family][2], answer_ids=ANSWER)
    tr = vc.trace(model, make_x(family), targets=t, sites=[*TOWER, "projector", "lm_resid", "lm_attn"])
    return family, model, tr, reference(model, family)


def token_types(family: str) -> torch.Tensor:
    """What the family's processor gives: PaliGemma 0 over image + prompt, 1 over the answer (suffix);
    Gemma 3 1 at the image tokens."""
    prompt = SETUP[family][2]
    if family == "paligemma":
        return torch.tensor([[0] * len(prompt) + [1] * len(ANSWER)])
    return torch.tensor([[int(i == IMG) for i in prompt + ANSWER]])


def test_the_forward_gets_the_familys_token_types(case):
    """The traced scores are the forward with the processor's token types, which differs from plain causal."""
    family, model, tr, _ = case
    prompt = SETUP[family][2]
    seq = torch.tensor([prompt + ANSWER])
    rows = np.arange(len(prompt), len(prompt) + len(ANSWER)) - 1
    with torch.no_grad():
        typed = model(input_ids=seq, pixel_values=make_x(family), token_type_ids=token_types(family),
                      use_cache=False).logits[0, rows, ANSWER].numpy()
        plain = model(input_ids=seq, pixel_values=make_x(family), use_cache=False).logits[0, rows, ANSWER].numpy()
    np.testing.assert_allclose(tr["logits"].values[:len(ANSWER)], typed, rtol=1e-5, atol=1e-6)
    assert np.abs(typed - plain).max() > 1e-4  # the token types change the answer: they were needed
    assert "token_type_ids" in json.loads(tr.attrs["target_checklist"])["token types"]


def _first(t):
    return t[0] if isinstance(t, (tuple, list)) else t


def reference(model: torch.nn.Module, family: str) -> tuple[dict, dict]:
    """Activations and gradients ((layer, site) keys) on an eager copy, for each traced entry: the answer
    tokens' logits, the sequence log-prob, each answer position's vocabulary logsumexp, then E = sum p z."""
    ref = copy.deepcopy(model)
    ref.config.text_config._attn_implementation = "eager"
    ref.config.vision_config._attn_implementation = "eager"
    kept, handles = {}, []

    def out(key, index=None):
        return lambda _m, _i, o: kept.__setitem__(key, o[index] if index is not None else _first(o))

    tower = ref.model.vision_tower
    layers = tower.vision_model.encoder.layers if hasattr(tower, "vision_model") else tower.encoder.layers
    for i, layer in enumerate(layers):
        handles += [layer.layer_norm1.register_forward_hook(out((i, "F1"))),
                    layer.self_attn.register_forward_hook(out((i, "F2"), 1)),
                    layer.self_attn.out_proj.register_forward_pre_hook(
                        lambda _m, a, k=(i, "F3"): kept.__setitem__(k, a[0])),
                    layer.layer_norm2.register_forward_hook(out((i, "F4"))),
                    layer.mlp.register_forward_hook(out((i, "F5"))),
                    layer.register_forward_hook(out((i, "F6")))]
    handles.append(ref.model.multi_modal_projector.register_forward_hook(out((0, "projector"))))
    for i, layer in enumerate(ref.model.language_model.layers):
        handles.append(layer.input_layernorm.register_forward_pre_hook(
            lambda _m, a, k=(i, "lm_resid"): kept.__setitem__(k, a[0])))
        handles.append(layer.self_attn.register_forward_hook(out((i, "lm_attn"), 1)))
    prompt = SETUP[family][2]
    logits = ref(input_ids=torch.tensor([prompt + ANSWER]), pixel_values=make_x(family), use_cache=False,
                 token_type_ids=token_types(family)).logits[0]
    for h in handles:
        h.remove()
    acts, grads, _ = answer_gradients(logits, len(prompt), ANSWER, kept)
    return acts, grads


def image_pos(family: str) -> np.ndarray:
    return np.flatnonzero(np.array(SETUP[family][2]) == IMG)


def test_scores_and_tower_site_gradients_equal_autograd(case):
    family, _, tr, (acts, grads) = case
    assert tr.attrs["vlm_family"] == family and tr.attrs["tower_layers_unused"] == ""
    assert list(tr["token_kind"].values) == ["patch"] * (SETUP[family][0] // PATCH) ** 2  # SigLIP: no class token
    for site in TOWER:
        for layer in range(3):
            if site == "F2":
                got_a, got_g = tr["attn"].values[layer], tr["attn_grad"].values[:, layer]
            else:
                si = list(tr["site"].values).index(site)
                got_a, got_g = tr["act"].values[layer, si], tr["grad"].values[:, layer, si]
            np.testing.assert_allclose(got_a, acts[(layer, site)], rtol=1e-5, atol=1e-6, err_msg=f"{site}@{layer}")
            assert np.abs(grads[(layer, site)]).max() > 0, f"{site}@{layer}: the reference gradient is zero"
            np.testing.assert_allclose(got_g, grads[(layer, site)], rtol=0, atol=1e-5, err_msg=f"{site}@{layer}")


def test_lm_site_gradients_equal_autograd_at_the_image_tokens(case):
    family, _, tr, (acts, grads) = case
    pos, prompt = image_pos(family), SETUP[family][2]
    np.testing.assert_array_equal(tr["image_token_pos"].values, pos)
    np.testing.assert_allclose(tr["projector"].values, acts[(0, "projector")], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tr["projector_grad"].values, grads[(0, "projector")], rtol=0, atol=1e-5)
    rows = np.arange(len(prompt), len(prompt) + len(ANSWER)) - 1
    for layer in range(2):
        np.testing.assert_allclose(tr["lm_resid"].values[layer], acts[(layer, "lm_resid")][pos], rtol=1e-5,
                                   atol=1e-6)
        g = grads[(layer, "lm_resid")][:, pos]
        assert np.abs(g).max() > 1e-4
        np.testing.assert_allclose(tr["lm_resid_grad"].values[:, layer], g, rtol=0, atol=1e-5)
        np.testing.assert_allclose(tr["lm_attn"].values[layer], acts[(layer, "lm_attn")][:, rows][:, :, pos],
                                   rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(tr["lm_attn_grad"].values[:, layer],
                                   grads[(layer, "lm_attn")][:, :, rows][:, :, :, pos], rtol=0, atol=1e-5)


def gradcam(A: np.ndarray, G: np.ndarray, side: int) -> np.ndarray:
    m = np.maximum(A @ G.mean(axis=0), 0).reshape(side, side)
    return (m - m.min()) / (m.max() - m.min())


@pytest.mark.parametrize("token", [0, 2])
def test_gradcam_at_lm_resid_and_the_tower_equals_reference(case, token):
    family, _, tr, (acts, grads) = case
    pos, side = image_pos(family), SETUP[family][1]
    expected = gradcam(acts[(1, "lm_resid")][pos], grads[(1, "lm_resid")][token, pos], side)
    m = vc.cam(tr, vc.Recipe(site="lm_resid", layer=-1, class_=token, upsample="none"))
    assert m.dims == ("patch_row", "patch_col") and m.shape == (side, side) and m.attrs["degenerate"] == ""
    assert_rel_close(m.values, expected, f"{family} lm_resid Grad-CAM of answer token {token}")
    patches = SETUP[family][0] // PATCH
    expected = gradcam(acts[(2, "F1")], grads[(2, "F1")][token], patches)  # the last layer: the LM reads it
    m = vc.cam(tr, vc.Recipe(site="F1", layer=-1, class_=token, upsample="none"))
    assert_rel_close(m.values, expected, f"{family} tower Grad-CAM of answer token {token}")


def test_checklist_states_the_familys_layout(case):
    family, _, tr, _ = case
    m = vc.cam(tr, vc.Recipe(site="lm_resid", layer=0, class_=1, relu="none"))
    text = json.loads(m.attrs["checklist"])["token handling"]["image tokens"]
    assert text.startswith({"paligemma": "PaliGemma: 4x4 SigLIP patches of 8 px, one token each, raster order, "
                                         "before the prompt (positions 0..15)",
                            "gemma3": "Gemma 3: 8x8 SigLIP patches average-pooled 2x2 into 4x4 tokens, raster "
                                      "order, between begin/end-of-image tokens (positions 2..17)"}[family]), text
    assert "CLS" not in tr.attrs["global_pool"] and family in tr.attrs["global_pool"]


def test_a_prompt_without_the_familys_image_tokens_is_refused(case):
    family, model, _, _ = case
    with pytest.raises(vc.TraceError, match="input_ids"):
        vc.trace(model, make_x(family), targets=vc.targets.answer(input_ids=[2, 7, 8], answer_ids=ANSWER),
                 sites=["lm_resid"])
