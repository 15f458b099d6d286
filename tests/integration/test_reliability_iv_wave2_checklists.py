"""Issue 52 (Reliability IV), second battery, M5/M12: ``Checklist.from_json`` checks every item its recipe
determines (on the trace facts the checklist states), not only site, weighting, heads and layer fusion; what only
the trace could confirm is listed in the result's ``unchecked``."""

from __future__ import annotations

import json
import warnings

import pytest

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.demo_video import normalise_clips, sample_clip

MODEL = vc.load_model("shapes-vit")
TR = vc.trace(MODEL, vc.sample_image("shapes", 0), targets="top2")


def _checklist(trace: object, recipe: Recipe) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vc.cam(trace, recipe).attrs["checklist"]


BASE = _checklist(TR, Recipe())

# The battery's thirteen edits (final_summary.txt, "F12 edited ..."), each accepted before.
EDITS = [
    ("feature representation", "module", "blocks.0.norm1"),
    ("feature representation", "input or output", "input"),
    ("feature representation", "layer", "block 0 of 0..5 (the first block)"),
    ("gradient target", "scalar", "the softmax probability p_c of the class ranked 1"),
    ("gradient target", "derivation", "chain rule from the logit gradient"),
    ("token handling", "weight tokens", "all tokens (cls included)"),
    ("token handling", "map over", "all tokens"),
    ("aggregation", "relu", "none: no ReLU"),
    ("aggregation", "heads", "the maximum over heads"),
    ("spatial reconstruction", "upsampling", "nearest"),
    ("spatial reconstruction", "normalisation", "max: divided by its maximum"),
    ("feature representation", "site", "the MLP output (F5)"),
    ("feature representation", "what the map shows", "attention weights"),
]


@pytest.mark.parametrize("category, item, text", EDITS, ids=[e[1] for e in EDITS])
def test_an_item_edited_against_its_recipe_is_refused_by_name(category, item, text):
    edited = json.loads(BASE)
    assert edited[category][item] != text  # a real edit of what vc.cam wrote
    edited[category][item] = text
    with pytest.raises(vc.ArgumentError, match=f"^text: the checklist contradicts its own recipe: {category}/{item}"):
        Checklist.from_json(json.dumps(edited))


def test_the_untouched_checklist_round_trips_and_names_what_only_the_trace_confirms():
    back = Checklist.from_json(BASE)
    assert back == json.loads(BASE)
    assert {"feature representation/module", "feature representation/input or output", "gradient target/scores",
            "token handling/prefix tokens present", "model and input/trace id"} <= set(back.unchecked)
    assert "aggregation/relu" not in back.unchecked and "feature representation/layer" not in back.unchecked
    made = Recipe(site="F4", relu="none").checklist()  # made without a trace: every item is the recipe's
    assert Checklist.from_json(made.to_json()) == made and Checklist.from_json(made.to_json()).unchecked == ()


def test_an_edit_of_a_checklist_made_without_a_trace_is_refused():
    made = json.loads(Recipe(site="F4", upsample="bicubic").checklist().to_json())
    made["spatial reconstruction"]["upsampling"] = made["spatial reconstruction"]["upsampling"].replace("bicubic",
                                                                                                          "bilinear")
    with pytest.raises(vc.ArgumentError, match="spatial reconstruction/upsampling"):
        Checklist.from_json(json.dumps(made))


@pytest.mark.parametrize("rule", ["chefer_lrp", "attnlrp"])
def test_checklists_of_rule_traces_round_trip(rule):
    tr = vc.trace(MODEL, vc.sample_image("shapes", 0), targets="top1", rule=rule)
    for recipe in (Recipe(), Recipe(site="F4", layer=(0, 5), layer_fusion="mean")):
        text = _checklist(tr, recipe)
        assert Checklist.from_json(text) == json.loads(text)


def test_checklists_of_a_clip_round_trip_and_an_edited_one_is_refused():
    tr = vc.trace(vc.load_model("shapes-video"), normalise_clips(sample_clip()[0][None])[0], targets="top1")
    for recipe in (Recipe(), Recipe(site="F4", layer=(0, 1), layer_fusion="mean", upsample="none"),
                   Recipe(upsample="nearest", normalize="none")):
        text = _checklist(tr, recipe)
        assert Checklist.from_json(text) == json.loads(text)
    edited = json.loads(_checklist(tr, Recipe()))
    edited["spatial reconstruction"]["normalisation"] = "min-max to [0, 1] per frame"
    with pytest.raises(vc.ArgumentError, match="spatial reconstruction/normalisation"):
        Checklist.from_json(json.dumps(edited))
