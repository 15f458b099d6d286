"""The Explorer's answer-token picker (issue 55): on a generative VLM's answer trace (a tiny random LLaVA built in
code) the class control lists the answer tokens by their decoded text and the sequence log-prob, never the
logsumexp entries traced for prob/logprob nor a "topN" rank; the projector and LM-side sites are offered with the
LM's own layers; and the map shown for a picked token is the map of that token, checked against Grad-CAM written
here in NumPy from the stored attention and its gradient (which tests/unit/model/test_vlm_llava.py checks against
torch.autograd)."""

from __future__ import annotations

import base64
import html
import json
import re
import zlib

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb.widgets.controls import coerce_request, controls
from vitcam_nb.widgets.facts import TraceFacts, default_recipe

transformers = pytest.importorskip("transformers")

from vlm_tiny import GRID, HOSTILE, LM_LAYERS, answer_trace, make_llava  # noqa: E402


@pytest.fixture(scope="module")
def trace():
    return answer_trace()


def test_the_class_control_lists_the_answer_tokens_and_the_sequence_score_only(trace):
    # the trace holds 3 tokens, the sequence log-prob and 3 logsumexp entries (7 classes)
    assert trace.sizes["class"] == 7
    facts = TraceFacts.of(trace)
    assert facts.answer and facts.classes == (0, 1, 2, 3) and facts.top_ranks() == []
    field = next(f for f in controls(facts)["fields"] if f["name"] == "class_")
    assert field["values"] == [[0, "answer token 0 · red"], [1, f"answer token 1 · {HOSTILE}"],
                               [2, "answer token 2 · &amp; circle"],
                               [3, "sequence log-prob (sum of the answer tokens' log-probs)"]]
    # the Explorer starts on the first answer token, not on "top1" (which would rank unlike scores)
    assert default_recipe(facts).class_ == 0
    assert all(fields["class_"] == 0 for _, _, fields in controls(facts)["presets"])


def test_the_lm_sites_are_offered_with_the_lm_layers(trace):
    facts = TraceFacts.of(trace)
    assert facts.sites == ("F1", "F6", "projector", "lm_resid", "lm_attn")
    layer = next(f for f in controls(facts)["fields"] if f["name"] == "layer")
    assert layer["layers"] == [0, 1, 2] and layer["num_layers"] == 3  # the tower's blocks
    n_lm = len(make_llava().model.language_model.layers)
    assert n_lm == LM_LAYERS
    assert layer["by_site"] == {"projector": {"layers": [0], "num_layers": 1},
                                "lm_resid": {"layers": list(range(n_lm)), "num_layers": n_lm},
                                "lm_attn": {"layers": list(range(n_lm)), "num_layers": n_lm}}
    # tower block 2 kept across a switch to the 2-layer LM becomes the LM's last layer, not a refusal
    moved = coerce_request({**vc.Recipe(layer=2).to_dict(), "site": "lm_resid"}, ["site"], facts)
    assert moved["layer"] == n_lm - 1
    assert coerce_request({**vc.Recipe(layer=2).to_dict(), "site": "projector"}, ["site"], facts)["layer"] == 0
    assert coerce_request({**vc.Recipe(layer=1).to_dict(), "site": "F6"}, ["site"], facts)["layer"] == 1


def _gradcam_lm_attn(trace, token: int, layer: int) -> np.ndarray:
    """Grad-CAM at lm_attn written here: heads are the channels, alpha_h = mean over the image tokens of the
    gradient of answer token ``token``'s logit at the row predicting it; sum_h alpha_h A_h (no ReLU: on a random
    model it may be negative everywhere), min-max."""
    a = trace["lm_attn"].values[layer, :, token, :].astype(np.float64)  # (head, image token)
    g = trace["lm_attn_grad"].values[token, layer, :, token, :].astype(np.float64)
    m = (g.mean(axis=1)[:, None] * a).sum(axis=0)
    m = (m - m.min()) / (m.max() - m.min())
    rows, cols = trace["image_token_row"].values, trace["image_token_col"].values
    out = np.zeros((GRID, GRID))
    out[rows, cols] = m
    return out


def test_the_picked_answer_token_is_the_map_shown(trace):
    ex = vc.Explorer(trace, vc.Recipe(site="F1", layer=1, relu="none"))
    shown = {}
    for token in (0, 1):
        draft = {**ex.recipe.to_dict(), "site": "lm_attn", "class_": token}
        ex.request = {"id": token + 1, "recipe": draft, "changed": ["site", "class_"]}
        assert ex.error == ""
        assert ex.recipe.site == "lm_attn" and ex.recipe.class_ == token and ex.recipe.layer == 1
        # the kit sums in float32, the reference in float64; after min-max, within 1e-5 of the unit range
        np.testing.assert_allclose(ex.map, _gradcam_lm_attn(trace, token, 1), rtol=0, atol=1e-5)
        shown[token] = ex.map.copy()
    assert not np.allclose(shown[0], shown[1])  # the picker changes the map: two tokens, two maps
    # the sequence score (class 3) at lm_resid: the map vc.cam gives for it, on the LM's last layer
    ex.request = {"id": 9, "recipe": {**ex.recipe.to_dict(), "site": "lm_resid", "class_": 3}, "changed": ["site"]}
    assert ex.error == "" and ex.recipe.class_ == 3 and ex.recipe.layer == 1
    np.testing.assert_array_equal(ex.map, vc.cam(trace, ex.recipe, grid=True).values)


def test_the_exported_page_lists_the_answer_tokens_escaped(trace, tmp_path):
    path = vc.export_html(trace, tmp_path / "vlm.html", axes={"site": ["F1", "lm_attn"], "layer": [0, 1],
                                                               "weighting": ["gradcam"], "target": ["logit"]},
                          progress=False)
    page = path.read_text()
    assert HOSTILE not in page and "<img" not in page  # the token's text is data, never markup
    meta = json.loads(re.search(r"<script type='application/json' id='vc-meta'>(.*?)</script>", page,
                                re.S).group(1))
    field = next(f for f in meta["options"]["fields"] if f["name"] == "class_")
    assert [v for v, _ in field["values"]] == [0, 1, 2, 3]
    assert field["values"][1][1] == f"answer token 1 · {HOSTILE}"
    assert "logsumexp" not in html.unescape(json.dumps(field))


@pytest.mark.parametrize("site, words", [("lm_resid", "token activations x gradients: the LM decoder layer's input "
                                                      "residual stream at the image-token positions (lm_resid)"),
                                         ("projector", "token activations x gradients: the projector's output"),
                                         ("lm_attn", "cross-modal interaction x gradients: the LM's attention")])
def test_the_methods_text_shown_says_what_the_lm_site_map_is_made_of(trace, site, words):
    ex = vc.Explorer(trace, vc.Recipe(site=site, layer=-1, class_=0))
    checklist = json.loads(ex.recipe.checklist(trace).to_json())["feature representation"]
    assert checklist["what the map shows"].startswith(words)
    # the paragraph the Explorer shows says what its checklist says (it once called lm_resid an attention site)
    assert f"What the map shows: {checklist['what the map shows']}." in ex.methods
    assert f"Feature representation: {checklist['site']} at {checklist['layer']}" in ex.methods


def test_a_map_title_names_the_lm_layer_not_a_tower_block():
    from vitcam_nb.plot import recipe_short

    assert recipe_short(vc.Recipe(site="lm_attn", layer=1)) == "gradcam · lm_attn · LM layer 1 · logit"
    assert recipe_short(vc.Recipe(site="projector", layer=0)) == "gradcam · projector · logit"  # one layer
    assert recipe_short(vc.Recipe(site="F6", layer=-1)) == "gradcam · F6 · last block · logit"


def test_a_map_title_on_an_answer_trace_names_the_answer_token(trace):
    from vitcam_nb.plot import _map_title

    assert _map_title(trace, vc.cam(trace, vc.Recipe(site="lm_resid", class_=0))).endswith("\nanswer token red")
    assert _map_title(trace, vc.cam(trace, vc.Recipe(site="lm_resid", class_=3))).endswith("\nsequence log-prob")


def test_an_exported_page_holds_the_layers_of_an_lm_deeper_than_its_tower(tmp_path):
    from vitcam_nb.widgets.bundle import build_bundle
    from vitcam_nb.widgets.standalone import _check_start

    deep = answer_trace(sites=("F1", "lm_resid"), lm_layers=4)  # tower 3 blocks, LM 4 layers
    facts = TraceFacts.of(deep)
    assert facts.layers == (0, 1, 2) and facts.all_layers == (0, 1, 2, 3) and facts.max_layers == 4
    start = vc.Recipe(site="lm_resid", layer=3, class_=0, relu="none")
    _check_start(deep, start, None)  # LM layer 3 exists: not refused as "out of range for 3 blocks"
    bundle = build_bundle(deep, start, axes={"weighting": ["gradcam"], "target": ["logit"], "class_": [0]},
                          progress=False)
    assert dict(bundle.meta["axes"])["layer"] == [0, 1, 2, 3] and bundle.meta["num_layers"] == 4
    layer = next(f for f in bundle.meta["options"]["fields"] if f["name"] == "layer")
    assert layer["by_site"] == {"lm_resid": {"layers": [0, 1, 2, 3], "num_layers": 4}}
    # the page opens on LM layer 3, the map vc.cam gives for it
    entries = json.loads(zlib.decompress(base64.b64decode(bundle.texts)))
    first = entries[bundle.meta["start"]]
    assert vc.Recipe.from_json(first["r"]) == start
    assert first["id"] == start.id
