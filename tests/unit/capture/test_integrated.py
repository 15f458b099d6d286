"""vc.score for the integrated gradient (TAM, Beyond Intuition) and ViT-CX (capture.integrated, capture.vitcx):
what is stored, what is refused, and that the model comes back exactly as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vitcam_testing import assert_rel_close, assert_unchanged, make_input, make_model, snapshot

import vitcam_nb as vc
from vitcam_nb.capture.integrated import value_ratios
from vitcam_nb.capture.vitcx import cluster_labels


def test_the_integrated_gradient_is_the_mean_of_traced_gradients_along_the_path():
    model, x = make_model("vit", depth=2), make_input("vit")
    recipe = vc.presets.transition_attention_maps(start_layer=0)
    tr = vc.score(vc.trace(model, x, targets="top2", sites="F2"), model, recipe, x, steps=3, batch_size=2)
    # Each step alone is an ordinary trace of alpha * x with the same classes; IG is their mean.
    classes = [int(c) for c in tr["target_class"].values if c >= 0]
    steps = [vc.trace(model, x * a, targets=classes, sites="F2", layers=[1]) for a in np.linspace(0, 1, 3)]
    want = np.mean([s["attn_grad"].isel(layer=0).values for s in steps], axis=0)
    assert_rel_close(tr["attn_grad_ig"].values, want, "IG")
    assert tr["attn_grad_ig"].attrs["ig_steps"] == 3 and tr["attn_grad_ig"].attrs["ig_layer"] == 1


def test_a_second_call_reuses_what_the_trace_holds_and_the_model_is_returned_as_it_was():
    model, x = make_model("vit", depth=2), make_input("vit")
    model.train()
    before = snapshot(model)
    tr = vc.trace(model, x, targets="top1")
    recipe = vc.presets.beyond_intuition_token(start_layer=0)
    once = vc.score(tr, model, recipe, x, steps=2)
    assert vc.score(once, model, recipe, x, steps=2) is once
    assert "attn_grad_ig" not in tr  # the input trace is not changed in place
    vc.score(tr, model, vc.presets.vit_cx(), x)
    assert_unchanged(before, model)


def test_requests_that_cannot_be_scored_are_refused_with_their_argument():
    model, x = make_model("vit", depth=2), make_input("vit")
    tr = vc.trace(model, x, targets="top1")
    recipe = vc.presets.transition_attention_maps(start_layer=0)
    with pytest.raises(vc.TraceError, match="steps"):
        vc.score(tr, model, recipe, x, steps=0)
    with pytest.raises(vc.TraceError, match="image"):
        vc.score(tr, model, recipe, x + 1)
    with pytest.raises(vc.TraceError, match="model"):
        vc.score(tr, make_model("vit", seed=1, depth=2), recipe, x)
    with pytest.raises(vc.RecipeError, match="separate vc.score calls"):
        vc.score(tr, model, [recipe, vc.presets.vit_cx()], x)
    with pytest.raises(TypeError, match="ViT-CX"):
        vc.score(tr, model, vc.presets.vit_cx(), x, steps=3)
    with pytest.raises(vc.RecipeError, match="F1 at block"):
        vc.score(vc.trace(model, x, targets="top1", sites="F2"), model, vc.presets.vit_cx(), x)


def test_bt_token_needs_timm_style_attention_modules():
    model, x = make_model("vit", depth=2), make_input("vit")
    model.blocks[0].attn.qkv = torch.nn.Identity()
    with pytest.raises(vc.TraceError, match="attn.qkv"):
        value_ratios(model, x, [0, 1])


def test_clusters_merge_below_the_threshold_and_are_numbered_by_first_channel():
    masks = np.array([[0.0, 1.0], [1.0, 0.0], [0.05, 1.0], [1.0, 1.0]])
    labels = cluster_labels(masks, 0.1)
    assert labels.tolist() == [0, 1, 0, 2]
    assert cluster_labels(masks, 2.0).tolist() == [0, 0, 0, 0]
