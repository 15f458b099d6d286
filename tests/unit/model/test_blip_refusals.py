"""BLIP image-text matching (issue #9): the model is left as it was after a trace (its attention implementation
forced to eager, then restored) and after a refusal, and bad ITM inputs, models without cross-attention and
bad ``xattn`` recipes are refused clearly. The model and its text are ``test_blip.py``'s."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_blip import CORE, FakeTokenizer, itm_target, make_blip, make_x

import vitcam_nb as vc

# --------------------------------------------------------------------------------------------------
# (d) the model is left as it was


def attn_settings(model):
    return [(type(c).__name__, c._attn_implementation_internal) for c in
            {id(c): c for c in [model.config, model.config.vision_config, model.config.text_config,
                                model.vision_model.config, model.text_encoder.config]}.values()]


def test_model_unchanged_after_trace(model_snapshot, assert_model_unchanged):
    model = make_blip()
    model.text_encoder.train()  # a mixed train/eval state must come back as it was
    before, settings = model_snapshot(model), attn_settings(model)
    tr = vc.trace(model, make_x(), targets=itm_target(), sites=CORE + ["xattn"])
    assert_model_unchanged(before, model)
    assert attn_settings(model) == settings
    assert tr["xattn"].sizes["xattn_layer"] == 2


def test_attention_implementation_forced_to_eager_and_restored(model_snapshot, assert_model_unchanged, blip_trace):
    model = make_blip()
    model.config.text_config._attn_implementation_internal = "sdpa"
    seen = []
    handle = model.text_encoder.encoder.layer[0].register_forward_pre_hook(
        lambda _m, _a: seen.append(model.text_encoder.config._attn_implementation))
    before = model_snapshot(model)
    try:
        tr = vc.trace(model, make_x(), targets=itm_target(), sites=["xattn"])
        assert_model_unchanged(before, model)
    finally:
        handle.remove()
    assert seen == ["eager"]
    assert model.config.text_config._attn_implementation_internal == "sdpa"
    np.testing.assert_allclose(tr["xattn_grad"].values, blip_trace.sel(target=tr["target"])["xattn_grad"].values,
                               rtol=1e-5, atol=1e-7)


def test_refused_trace_leaves_model_unchanged(model_snapshot, assert_model_unchanged):
    model = make_blip()
    before, settings = model_snapshot(model), attn_settings(model)
    with pytest.raises(vc.TraceError, match="expects 32x32 input, got 24x24"):
        vc.trace(model, torch.randn(1, 3, 24, 24), targets=itm_target())
    assert_model_unchanged(before, model)
    assert attn_settings(model) == settings


# --------------------------------------------------------------------------------------------------
# (e) bad inputs are refused clearly


@pytest.mark.parametrize("ids,mask,match", [
    (torch.tensor([], dtype=torch.long), None, "input_ids: is empty"),
    (torch.zeros((1, 0), dtype=torch.long), None, "input_ids: is empty"),
    (torch.tensor([[1, 5, 2], [1, 6, 2]]), None, r"shape \(L,\) or \(1, L\)"),
    (torch.tensor([1.0, 5.0, 2.0]), None, "integer token ids"),
    (torch.tensor([[1, 5, 2]]), torch.tensor([[1, 1]]), "attention_mask: shape"),
    (torch.tensor([[1, 5, 2]]), torch.tensor([[1, 2, 1]]), "0/1 values"),
    (torch.tensor([[1, 5, 2]]), torch.tensor([[0, 0, 0]]), "masks every token"),
    ("a dog", None, "input_ids"),
])
def test_bad_itm_inputs(ids, mask, match):
    with pytest.raises(vc.TraceError, match=match):
        vc.targets.itm(ids, mask)


def test_itm_refuses_only_special_tokens_and_bad_models(blip, tiny_vit, model_input):
    with pytest.raises(vc.TraceError, match="only special tokens"):
        vc.targets.itm([1, 2, 0], [1, 1, 0], tokenizer=FakeTokenizer())
    with pytest.raises(vc.TraceError, match="only special tokens"):  # no tokenizer: the model config's ids
        vc.trace(blip, make_x(), targets=vc.targets.itm([1, 2]))
    with pytest.raises(vc.TraceError, match=r"0\.\.99"):
        vc.trace(blip, make_x(), targets=vc.targets.itm([1, 150, 2]))
    with pytest.raises(vc.TraceError, match="at most 16"):
        vc.trace(blip, make_x(), targets=vc.targets.itm([5] * 17))
    with pytest.raises(vc.TraceError, match="BlipForImageTextRetrieval"):
        vc.trace(tiny_vit, model_input("vit"), targets=itm_target())
    with pytest.raises(vc.TraceError, match="match: expected True or False"):
        vc.targets.itm([1, 5, 2], match="yes")


def test_xattn_refused_without_cross_attention(tiny_vit, model_input):
    tr = vc.trace(tiny_vit, model_input("vit"), targets=1)
    with pytest.raises(vc.RecipeError, match=r"site: 'xattn' .*no cross-attention"):
        vc.cam(tr, vc.Recipe(site="xattn"))
    with pytest.raises(vc.TraceError, match=r"sites: .*'xattn'.*\['F1'"):
        vc.trace(tiny_vit, model_input("vit"), sites=["xattn"])
    no_xattn = make_blip(cross_attention=False)
    for sites in (["xattn"], ["F1"]):  # the target refuses the model before any site is looked at
        with pytest.raises(vc.TraceError, match="no cross-attention"):
            vc.trace(no_xattn, make_x(), targets=itm_target(), sites=sites)
    assert "xattn" not in vc.adapters.find_adapter(no_xattn).extra_sites(no_xattn)


@pytest.mark.parametrize("fields,match", [
    (dict(text_tokens="cat"), r"no text token equals 'cat'; the tokens are \['\[CLS\]'"),
    (dict(text_tokens=8), "position 8 is out of range; the text has 8 tokens"),
    (dict(layer=2), "out of range for 2 cross-attention layers"),
    (dict(layer="0.1"), "cross-attention layers with ints"),
    (dict(heads=2), "head 2 does not exist"),
])
def test_bad_xattn_recipes(blip_trace, fields, match):
    base = dict(site="xattn", layer=0, class_=1)
    with pytest.raises(vc.RecipeError, match=match):
        vc.cam(blip_trace, vc.Recipe(**{**base, **fields}))


def test_rollouts_refused_for_xattn():
    with pytest.raises(vc.RecipeError, match="layer_fusion"):
        vc.Recipe(site="xattn", layer="all", layer_fusion="rollout")
