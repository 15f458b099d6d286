"""A generative VLM's answer on a tiny random LLaVA built in code (issue 55): every site's stored gradient equals
torch.autograd's at the image-token positions, Grad-CAM of an answer token at the tower and at ``lm_resid`` equals
a hand-written reference, the tower layer LLaVA never reads gives the zero-gradient verdict, and the generative
VLM families not read yet are refused by name."""

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

IMAGE_ID, GRID = 63, 4  # the placeholder id (inside the 64-token vocabulary); 32 px / patch 8
PROMPT = [1, 5, 6] + [IMAGE_ID] * GRID * GRID + [7, 8]
ANSWER = [9, 10, 11]
TOWER = ("F1", "F2", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid")
LM = ("projector", "lm_resid", "lm_attn")


def make_llava(seed: int = 0, strategy: str = "default", **kw) -> torch.nn.Module:
    """CLIP tower 3 layers width 32 on 32 px (patch 8), Llama 2 layers width 32, 64 tokens; sdpa attention."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    v = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         image_size=32, patch_size=8, projection_dim=32)
    t = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
    cfg = LlavaConfig(vision_config=v, text_config=t, image_token_id=IMAGE_ID, vision_feature_layer=-2,
                      vision_feature_select_strategy=strategy, **kw)
    return LlavaForConditionalGeneration(cfg).eval()


def make_x(seed: int = 1) -> torch.Tensor:
    return torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llava():
    return make_llava()


@pytest.fixture(scope="module")
def trace(llava):
    return vc.trace(llava, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=list(TOWER + LM))


# --------------------------------------------------------------------------------------------------
# the hand-written reference: hooks on an eager copy of the model, torch.autograd per output


def _first(t):
    return t[0] if isinstance(t, (tuple, list)) else t


def reference(model: torch.nn.Module, x: torch.Tensor) -> tuple[dict, dict, torch.Tensor]:
    """Activations and gradients of every site ((layer, site) keys; LM sites over the whole sequence) for the
    outputs the trace differentiates: each answer token's logit at its predicting position, the sequence
    log-prob, each predicting position's logsumexp over the vocabulary, then the expected score
    E = sum softmax(z).detach() * z."""
    ref = copy.deepcopy(model)
    ref.model.language_model.config._attn_implementation = "eager"
    ref.model.vision_tower.config._attn_implementation = "eager"
    kept, handles = {}, []

    def out(key, index=None):
        return lambda _m, _i, o: kept.__setitem__(key, o[index] if index is not None else _first(o))

    def inp(key):
        return lambda _m, args: kept.__setitem__(key, args[0])

    for i, layer in enumerate(ref.model.vision_tower.encoder.layers):
        handles += [layer.layer_norm1.register_forward_hook(out((i, "F1"))),
                    layer.self_attn.register_forward_hook(out((i, "F2"), 1)),
                    layer.self_attn.out_proj.register_forward_pre_hook(inp((i, "F3"))),
                    layer.layer_norm2.register_forward_hook(out((i, "F4"))),
                    layer.mlp.register_forward_hook(out((i, "F5"))),
                    layer.register_forward_hook(out((i, "F6"))),
                    layer.register_forward_pre_hook(inp((i, "resid_pre"))),
                    layer.self_attn.register_forward_hook(out((i, "attn_out"), 0)),
                    layer.layer_norm2.register_forward_pre_hook(inp((i, "resid_mid")))]
    handles.append(ref.model.multi_modal_projector.register_forward_hook(out((0, "projector"))))
    for i, layer in enumerate(ref.model.language_model.layers):
        # the decoder layer's own input, whichever way it is passed (the kit reads its first norm's input)
        handles.append(layer.register_forward_pre_hook(
            lambda _m, args, kwargs, k=(i, "lm_resid"): kept.__setitem__(k, args[0] if args else
                                                                         kwargs["hidden_states"]),
            with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(out((i, "lm_attn"), 1)))
    seq = torch.tensor([PROMPT + ANSWER])
    xg = x.clone().requires_grad_(True)
    logits = ref(input_ids=seq, pixel_values=xg, use_cache=False).logits[0]
    for h in handles:
        h.remove()
    return answer_gradients(logits, len(PROMPT), ANSWER, kept)


@pytest.fixture(scope="module")
def refs(llava):
    return reference(llava, make_x())


# --------------------------------------------------------------------------------------------------
# (a) every stored gradient is torch.autograd's


def test_scores_are_teacher_forced_logits_and_sequence_logprob(trace, refs):
    np.testing.assert_allclose(trace["logits"].values, refs[2].numpy(), rtol=1e-5, atol=1e-6)
    assert list(trace["class_label"].values) == ["[9]", "[10]", "[11]", "sequence log-prob", "logsumexp@[9]",
                                                 "logsumexp@[10]", "logsumexp@[11]"]
    assert trace.attrs["model_family"] == "hf_vlm" and trace.attrs["vlm_family"] == "llava"


@pytest.mark.parametrize("site", TOWER)
def test_tower_site_gradients_equal_autograd(trace, refs, site):
    acts, grads, _ = refs
    for layer in range(3):
        if site == "F2":
            got_a, got_g = trace["attn"].values[layer], trace["attn_grad"].values[:, layer]
        else:
            si = list(trace["site"].values).index(site)
            got_a, got_g = trace["act"].values[layer, si], trace["grad"].values[:, layer, si]
        np.testing.assert_allclose(got_a, acts[(layer, site)], rtol=1e-5, atol=1e-6, err_msg=f"{site}@{layer}")
        np.testing.assert_allclose(got_g, grads[(layer, site)], rtol=0, atol=1e-5, err_msg=f"{site}@{layer} grad")
        assert np.abs(grads[(layer, site)]).max() > 0 or layer == 2  # a real comparison below the unused layer


def test_lm_site_gradients_equal_autograd_at_the_image_tokens(trace, refs):
    acts, grads, _ = refs
    pos = np.arange(3, 3 + GRID * GRID)
    np.testing.assert_array_equal(trace["image_token_pos"].values, pos)
    np.testing.assert_allclose(trace["projector"].values, acts[(0, "projector")], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trace["projector_grad"].values, grads[(0, "projector")], rtol=0, atol=1e-5)
    rows = np.arange(len(PROMPT), len(PROMPT) + len(ANSWER)) - 1
    for layer in range(2):
        np.testing.assert_allclose(trace["lm_resid"].values[layer], acts[(layer, "lm_resid")][pos], rtol=1e-5,
                                   atol=1e-6)
        g = grads[(layer, "lm_resid")][:, pos]
        assert np.abs(g).max() > 1e-3
        np.testing.assert_allclose(trace["lm_resid_grad"].values[:, layer], g, rtol=0, atol=1e-5)
        a = acts[(layer, "lm_attn")][:, rows][:, :, pos]
        np.testing.assert_allclose(trace["lm_attn"].values[layer], a, rtol=1e-5, atol=1e-7)
        g = grads[(layer, "lm_attn")][:, :, rows][:, :, :, pos]
        np.testing.assert_allclose(trace["lm_attn_grad"].values[:, layer], g, rtol=0, atol=1e-5)
    # only image-token positions are stored at the LM sites
    assert trace.sizes["image_token"] == GRID * GRID and trace.sizes["answer_token"] == len(ANSWER)


def test_trace_restores_sdpa_attention_and_leaves_no_hooks(llava, trace):
    assert llava.config.text_config._attn_implementation == "sdpa"
    assert llava.config.vision_config._attn_implementation == "sdpa"
    assert trace.attrs["hf_attn_implementation"] == "sdpa"
    assert not llava.training and all(p.requires_grad for p in llava.parameters())
    # transformers installs its own output-capturing hooks on the first forward that asks for hidden states
    # (LLaVA's vision_feature_layer does): those stay; the trace adds none that stay
    model = make_llava()
    model(input_ids=torch.tensor([PROMPT]), pixel_values=make_x(), use_cache=False)

    def hooks():
        return {n: (list(m._forward_hooks), list(m._forward_pre_hooks)) for n, m in model.named_modules()}

    before = hooks()
    vc.trace(model, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER), sites=list(LM))
    assert hooks() == before


# --------------------------------------------------------------------------------------------------
# (b) Grad-CAM of an answer token equals a hand-written reference


def gradcam(A: np.ndarray, G: np.ndarray) -> np.ndarray:
    """Selvaraju et al.: alpha_k = mean_t G[t, k]; relu(sum_k alpha_k A[t, k]) on the 4x4 raster; min-max."""
    m = np.maximum(A @ G.mean(axis=0), 0).reshape(GRID, GRID)
    return (m - m.min()) / (m.max() - m.min())


@pytest.mark.parametrize("token", [0, 2])
def test_gradcam_at_the_tower_equals_reference(trace, refs, token):
    acts, grads, _ = refs
    # the last layer LLaVA reads (vision_feature_layer=-2), patches only (the class token dropped)
    expected = gradcam(acts[(1, "F1")][1:], grads[(1, "F1")][token, 1:])
    m = vc.cam(trace, vc.Recipe(site="F1", layer=1, class_=token, upsample="none"))
    assert m.attrs["degenerate"] == ""
    assert_rel_close(m.values, expected, f"tower Grad-CAM of answer token {token}")


@pytest.mark.parametrize("layer", [-1, 0])
def test_gradcam_at_lm_resid_equals_reference(trace, refs, layer):
    acts, grads, _ = refs
    pos = np.arange(3, 3 + GRID * GRID)
    expected = gradcam(acts[(layer % 2, "lm_resid")][pos], grads[(layer % 2, "lm_resid")][0, pos])
    m = vc.cam(trace, vc.Recipe(site="lm_resid", layer=layer, class_=0, upsample="none"))
    assert m.dims == ("patch_row", "patch_col") and m.attrs["degenerate"] == ""
    assert_rel_close(m.values, expected, f"lm_resid Grad-CAM at LM layer {layer}")


def test_lm_attn_map_is_the_predicting_row_over_image_keys(trace, refs):
    """Gradient-weighted attention (layercam over heads, mean_then_relu) of the row predicting answer token 1."""
    acts, grads, _ = refs
    pos, row = np.arange(3, 3 + GRID * GRID), len(PROMPT)  # answer token 1 is predicted at position len(PROMPT)
    A, G = acts[(1, "lm_attn")][:, row, pos], grads[(1, "lm_attn")][1][:, row, pos]
    m = np.maximum((np.maximum(G, 0) * A).mean(0), 0).reshape(GRID, GRID)
    expected = (m - m.min()) / (m.max() - m.min())
    got = vc.cam(trace, vc.Recipe(site="lm_attn", layer=-1, class_=1, weighting="layercam", heads="mean_then_relu",
                                  upsample="none"))
    assert_rel_close(got.values, expected, "lm_attn map")


# --------------------------------------------------------------------------------------------------
# (d) the tower layer the LM never reads, (4) the checklist


def test_unused_tower_layer_gives_the_zero_gradient_verdict(trace):
    assert trace.attrs["tower_layers_unused"] == "2"
    sites = list(trace["site"].values)
    # resid_pre of layer 2 is layer 1's output, which the LM reads; everything inside layer 2 it never reads
    inside = [i for i, s in enumerate(sites) if s != "resid_pre"]
    assert not np.any(trace["grad"].values[:, 2, inside]) and not np.any(trace["attn_grad"].values[:, 2])
    assert np.any(trace["grad"].values[:, 2, sites.index("resid_pre")])
    for site in ("F1", "F6", "F2"):
        with pytest.warns(vc.DegenerateMapWarning, match="zero gradient"):
            m = vc.cam(trace, vc.Recipe(site=site, layer=-1, class_=0))
        assert m.attrs["degenerate_cause"] == "zero gradient" and not np.any(m.values)


@pytest.mark.parametrize("site", ["F1", "lm_resid", "lm_attn", "projector"])
def test_checklist_states_the_layout_and_the_answer_token(trace, site):
    layer = 1 if site == "F1" else 0
    m = vc.cam(trace, vc.Recipe(site=site, layer=layer, class_=0, relu="none"))
    text = m.attrs["checklist"]
    c = json.loads(text)
    assert "LLaVA: 4x4 image tokens at sequence positions 3..18" in text
    assert "0: '[9]' (id 9, position 21)" in c["gradient target"]["answer tokens"]
    if site != "F1":
        assert c["token handling"]["image tokens"].startswith("LLaVA: 4x4 image tokens")
        assert c["feature representation"]["module"].startswith(
            {"lm_resid": "model.language_model.layers.0.input_layernorm", "lm_attn": "model.language_model.layers.0"
             ".self_attn", "projector": "model.multi_modal_projector"}[site])


def test_lm_layer_out_of_range_is_refused(trace):
    with pytest.raises(vc.RecipeError, match="site 'lm_resid' has 2 layer"):
        vc.cam(trace, vc.Recipe(site="lm_resid", layer=2))


# --------------------------------------------------------------------------------------------------
# (e) generative VLMs not read yet are refused by name


def test_other_vlm_families_are_refused_by_name():
    """A known generative VLM class without a family row (whichever is still in NOT_YET_SUPPORTED) is refused
    naming its class and family; with none left, an unknown generative class is refused naming the ones read."""
    from vitcam_nb.adapters.hf_vlm import NOT_YET_SUPPORTED, VLM_FAMILIES, vlm_family_of

    name, family = next(iter(sorted(NOT_YET_SUPPORTED.items())), ("FooVlForConditionalGeneration", None))
    # a stand-in of the transformers class: the kit recognises a model by its class name and module only
    fake = type(name, (torch.nn.Module,), {"__module__": "transformers.models.foo.modeling_foo"})()
    assert name not in {c for fam in VLM_FAMILIES.values() for c in fam.classes}
    if family is not None:
        match = rf"model: {name} \(VLM family '{family}'\) is not supported yet: .*; the generative VLM families read"
    else:
        match = rf"model: {name} is not a generative VLM this kit reads; supported: .*llava"
    with pytest.raises(vc.ArgumentTypeError, match=match):
        vlm_family_of(fake)
    with pytest.raises(vc.ArgumentTypeError, match=match):
        vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER).check(fake)


def test_answer_target_on_a_classifier_is_refused():
    import timm

    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
    with pytest.raises(vc.ArgumentTypeError, match="not a generative VLM"):
        vc.trace(m, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER))


# --------------------------------------------------------------------------------------------------
# storage


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_saved_trace_gives_the_same_lm_maps(trace, tmp_path, suffix):
    back = vc.load(vc.save(trace, tmp_path / f"llava{suffix}"))
    assert back["lm_resid"].attrs["layout"] == trace["lm_resid"].attrs["layout"]
    for r in (vc.Recipe(site="lm_resid", layer=-1, class_=0), vc.Recipe(site="projector", class_=2, relu="none"),
              vc.Recipe(site="lm_attn", layer=0, class_=1, relu="none"),
              vc.Recipe(site="lm_attn", layer=1, class_=3, weighting="layercam", heads="mean_then_relu")):
        a, b = vc.cam(trace, r), vc.cam(back, r)
        np.testing.assert_array_equal(b.values, a.values, err_msg=r.id)
        assert a.attrs["checklist"] == b.attrs["checklist"]


def test_float16_trace_gives_close_lm_maps(llava, trace):
    half = vc.trace(llava, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=list(LM), dtype="float16")
    assert half["lm_resid_grad"].dtype == np.float16
    r = vc.Recipe(site="lm_resid", layer=-1, class_=0)
    np.testing.assert_allclose(vc.cam(half, r).values, vc.cam(trace, r).values, atol=2e-2)
