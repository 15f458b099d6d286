"""The Explorer's preset menu (issue #20): every preset whose site the trace has, with the recipe it sets."""

from __future__ import annotations

import numpy as np
from vitcam_testing import make_input, make_model

import vitcam_nb as vc
from vitcam_nb.widgets.controls import as_recipe, coerce_request, controls, preset_menu
from vitcam_nb.widgets.facts import TraceFacts


def test_the_menu_lists_the_presets_of_the_trace_sites_and_each_sets_its_recipe():
    model = make_model("vit", depth=2)
    facts = TraceFacts.of(vc.trace(model, make_input("vit"), targets="top1"))
    menu = preset_menu(facts)
    names = [row[0] for row in menu]
    # every preset but the vision-language ones (xattn, lm_attn, lm_logit) and the backward-rule read-outs
    # (site resid_pre, not traced here)
    assert names == [n for n in vc.presets.names()
                     if vc.presets.get(n).site not in ("xattn", "resid_pre", "lm_attn", "lm_logit")]
    assert controls(facts)["presets"] == menu
    for name, label, fields in menu:
        assert label.startswith(name)
        # What the browser sends back (every field changed) is the preset's recipe again.
        recipe = as_recipe(coerce_request(fields, list(fields), facts))
        assert recipe == vc.presets.get(name), name


def test_a_trace_without_attention_offers_no_attention_preset():
    model = make_model("vit", depth=2)
    facts = TraceFacts.of(vc.trace(model, np.zeros((32, 32, 3), np.uint8), targets="top1", sites=["F1"]))
    names = [row[0] for row in preset_menu(facts)]
    assert "attention_rollout" not in names and "gradcam" in names and "vit_cx" in names
