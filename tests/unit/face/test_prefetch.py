"""Neighbour prefetch of the Explorer (vitcam_nb/widgets/prefetch.py): after each answer the kernel sends the
views one step away on the layer slider and the site list; each entry is exactly what a request for that draft
would answer (vc.cam's grid, recipe id, report), keyed by the draft the page builds."""

from __future__ import annotations

import json

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb.widgets import Explorer
from vitcam_nb.widgets.encoding import grid_from_bytes

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.core.errors.DegenerateMapWarning")


@pytest.fixture(scope="module")
def tr(model_factory, model_input):
    return vc.trace(model_factory("vit"), model_input("vit"))


def answered(ex: Explorer, tr, draft: dict, field: str) -> Explorer:
    """What a request for ``draft`` answers, from a fresh Explorer (no prefetch involved)."""
    other = Explorer(tr, ex.recipe, prefetch=False)
    other.set_state({"request": {"id": 1, "recipe": draft, "changed": [field]}})
    return other


def captured(ex: Explorer) -> list:
    sent = []
    ex.send = lambda content, buffers=None: sent.append((content, buffers))
    return sent


def test_each_answer_is_followed_by_its_neighbours_equal_to_their_answers(tr):
    ex = Explorer(tr, vc.Recipe(layer=1, site="F3"))
    sent = captured(ex)
    draft = {**json.loads(ex.recipe.to_json()), "layer": 2}
    ex.set_state({"request": {"id": 1, "recipe": draft, "changed": ["layer"]}})
    assert ex.recipe.layer == 2 and len(sent) == 1
    content, buffers = sent[0]
    assert content["kind"] == "prefetch"
    base = json.loads(ex.recipe.to_json())
    drafts = [e["draft"] for e in content["entries"]]
    layers = [int(v) for v in tr["layer"].values]
    i = layers.index(2)
    want_layers = [layers[j] for j in (i - 1, i + 1) if 0 <= j < len(layers)]
    assert [d["layer"] for d in drafts if d["site"] == "F3"] == want_layers
    sites = [v for v, _ in next(f for f in ex.options["fields"] if f["name"] == "site")["values"]]
    assert [d["site"] for d in drafts if d["layer"] == 2 and d["site"] != "F3"] == [sites[sites.index("F3") - 1],
                                                                                   sites[sites.index("F3") + 1]]
    for entry, buf in zip(content["entries"], buffers):
        field = next(k for k in entry["draft"] if entry["draft"][k] != base[k])
        ref = answered(ex, tr, entry["draft"], field)
        assert entry["recipe_id"] == ref.recipe_id and entry["recipe_json"] == ref.recipe_json
        np.testing.assert_array_equal(grid_from_bytes(buf, entry["grid_shape"]), ref.map)
        want = vc.cam(tr, vc.Recipe.from_json(entry["recipe_json"]), grid=True).values
        np.testing.assert_array_equal(grid_from_bytes(buf, entry["grid_shape"]), want)
        assert entry["methods"] == ref.methods and entry["checklist"] == ref.checklist
        assert entry["degenerate"] == ref.degenerate


def test_the_page_asks_and_prefetch_off_sends_nothing(tr):
    ex = Explorer(tr, vc.Recipe(layer=0, site="F1"))
    sent = captured(ex)
    ex._handle_custom_msg({"kind": "prefetch"}, [])
    assert len(sent) == 1 and len(sent[0][0]["entries"]) == len(sent[0][1]) >= 2
    off = Explorer(tr, vc.Recipe(layer=0, site="F1"), prefetch=False)
    sent_off = captured(off)
    off._handle_custom_msg({"kind": "prefetch"}, [])
    off.set_state({"request": {"id": 1, "recipe": {**json.loads(off.recipe.to_json()), "layer": 1},
                               "changed": ["layer"]}})
    assert sent_off == [] and off.recipe.layer == 1
