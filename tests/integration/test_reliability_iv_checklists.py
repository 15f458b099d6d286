"""Issue 52 (Reliability IV), findings 11 and 12 and the checklist, card, probe and estimate LOWs: bad input is a
kit error naming the argument (never a bare UnicodeDecodeError, JSONDecodeError, RecursionError or numpy error),
and ``Checklist.from_json`` refuses a checklist whose text or id no longer says what its recipe is.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb.core.card_schema import NOT_REPORTED, PaperCardError, template
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.presets import PRESETS
from vitcam_nb.core.presets import get as preset
from vitcam_nb.models import sample_image

DATA = Path(__file__).resolve().parents[1] / "data" / "v0_1"
MODEL = vc.load_model("shapes-vit")
TR = vc.trace(MODEL, sample_image("shapes", 1), targets="top2")


def _checklist(trace: object, recipe: Recipe) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vc.cam(trace, recipe).attrs["checklist"]


# -- finding 11: bare errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [b"\xff", b"\xff\xfe{}", "[" * 100_000 + "]" * 100_000, "{" + '"a":{' * 50_000],
                         ids=["not-utf8", "utf16-bom", "deep-list", "deep-object"])
def test_checklist_from_json_of_no_checklist_text_names_the_argument(text):
    with pytest.raises(vc.ArgumentError, match="^text: not valid checklist JSON"):
        Checklist.from_json(text)


def test_a_broken_recipe_json_inside_a_checklist_names_it():
    c = json.loads(Recipe(site="F4").checklist().to_json())
    c["recipe"]["json"] = '{"site": "F4",'
    with pytest.raises(vc.ArgumentError, match="^text: .*recipe"):
        Checklist.from_json(json.dumps(c))
    with pytest.raises(vc.ArgumentError, match="^text: the checklist's recipe.json is not valid recipe JSON"):
        Checklist(c).to_json(card=True)


def test_validate_of_deeply_nested_json_is_a_card_error():
    deep = '{"card_version": 1, "paper": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001
    with pytest.raises(PaperCardError, match="^card: not valid JSON"):
        vc.audit.validate(deep)
    with pytest.raises(PaperCardError, match="^card: not valid JSON"):
        vc.audit.validate(b"\xff" + json.dumps(template()).encode())


def _csv(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "cards.csv"
    path.write_bytes(data)
    return path


def test_summarise_reads_a_byte_order_mark_and_refuses_latin1_and_empty_files(tmp_path):
    good = (vc.audit.__file__ and Path(vc.evaluate.audit.cards.AUDIT_DIR) / "example_cards.csv").read_bytes()
    want = vc.audit.summarise(_csv(tmp_path, good))
    assert vc.audit.summarise(_csv(tmp_path, b"\xef\xbb\xbf" + good)) == want  # as spreadsheets write it
    with pytest.raises(PaperCardError, match="^cards: .*is not UTF-8 text"):
        vc.audit.summarise(_csv(tmp_path, good.replace(b"none", "n\u00f3ne".encode("latin-1"), 1)))
    with pytest.raises(PaperCardError, match="^cards: .*is empty"):
        vc.audit.summarise(_csv(tmp_path, b""))
    with pytest.raises(PaperCardError, match="^cards: .*no card"):
        vc.audit.summarise(_csv(tmp_path, good.splitlines(keepends=True)[0]))


@pytest.mark.parametrize("labels", [[[1, 2], [3]], [[1, [2]], [3, 4]]])
def test_segmentation_loss_of_ragged_labels_names_them(labels):
    with pytest.raises(vc.TraceError, match="^labels: expected an \\(H, W\\) label map"):
        vc.targets.segmentation_loss(labels)


@pytest.mark.parametrize("kwargs, arg", [({"seed": -1}, "seed"), ({"seed": "x"}, "seed"), ({"seed": 1.5}, "seed"),
                                         ({"seed": True}, "seed"), ({"layers": 1.0}, "layers"),
                                         ({"layers": True}, "layers"), ({"layers": [0, 1.0]}, "layers"),
                                         ({"sites": 3}, "sites")])
def test_position_probe_refuses_seeds_and_layers_of_the_wrong_kind(kwargs, arg):
    with pytest.raises(vc.VitcamError, match=f"^{arg}: "):
        vc.evaluate.position_probe(TR, **kwargs)


def test_a_position_probe_whose_attrs_were_lost_is_not_quoted_as_this_traces():
    probe = vc.evaluate.position_probe(TR, sites="F1", layers=[4, 5])
    quoted = TR.assign(position_r2=probe)
    assert "ridge probe" in json.loads(_checklist(quoted, Recipe(site="F1", layer=4)))["spatial reconstruction"][
        "position probe"]
    stripped = TR.assign(position_r2=probe.copy(data=probe.values))
    stripped["position_r2"].attrs = {}
    text = json.loads(_checklist(stripped, Recipe(site="F1", layer=4)))["spatial reconstruction"]["position probe"]
    assert "not quoted" in text and "states no trace_id" in text


# -- finding 12: a checklist that contradicts its recipe ---------------------------------------------------------------
def _edited(recipe: Recipe, category: str, item: str, text: str) -> str:
    c = json.loads(_checklist(TR, recipe))
    c[category][item] = text
    return json.dumps(c)


@pytest.mark.parametrize("recipe, category, item, text", [
    (Recipe(site="F3", heads="relu_then_mean"), "aggregation", "heads", "max over heads"),
    (Recipe(site="F3", heads="relu_then_mean"), "aggregation", "heads",
     "relu_then_mean: the maximum over heads"),
    (Recipe(site="F4"), "aggregation", "weighting", "layercam: elementwise ReLU(G) * A (Jiang et al. 2021)"),
    (Recipe(site="F4", layer=(1, 2), layer_fusion="mean"), "aggregation", "layer fusion", "max: per-layer maxima"),
    (Recipe(site="F4"), "feature representation", "site", "F1"),
])
def test_from_json_refuses_a_text_edited_against_its_recipe(recipe, category, item, text):
    with pytest.raises(vc.ArgumentError, match="^text: the checklist contradicts its own recipe"):
        Checklist.from_json(_edited(recipe, category, item, text))


def test_from_json_refuses_a_stale_recipe_id():
    c = json.loads(_checklist(TR, Recipe(site="F4")))
    c["recipe"]["id"] = Recipe(site="F1").id
    with pytest.raises(vc.ArgumentError, match="stale id"):
        Checklist.from_json(json.dumps(c))
    card = json.loads(Checklist(json.loads(_checklist(TR, Recipe(site="F4")))).to_json(card=True))
    card["checklist"]["recipe"]["id"] = Recipe(site="F1").id
    with pytest.raises(vc.ArgumentError, match="stale id"):
        Checklist.from_json(card)


def _genuine() -> list[tuple[str, str]]:
    torch.manual_seed(0)  # fixed weights: the same trace on every run
    swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 2), num_heads=(2, 4),
                             embed_dim=16, img_size=56, window_size=7).eval()
    st = vc.trace(swin, np.random.default_rng(7).integers(0, 256, (56, 56, 3), dtype=np.uint8), targets="top1",
                  sites=["F1", "F3", "F4"])
    out = []
    for name in PRESETS:
        try:
            out.append((f"preset {name}", _checklist(TR, preset(name))))
        except vc.VitcamError:  # a preset this trace cannot compute (scores, rules, text): not made here
            pass
    space = {"site": ["F1", "F2", "F3", "F4"], "layer": [-1, (0, 3), "all"], "heads": ["channels", "max", 1],
             "weighting": ["gradcam", "layercam", "gradcampp"], "layer_fusion": ["none", "mean", "rollout"]}
    for r in vc.compute.map_recipes.as_recipes(space):
        for label, trace in (("flat", TR), ("swin", st)):
            try:
                out.append((f"{label} {r.to_string()}", _checklist(trace, r)))
            except vc.VitcamError:
                pass
    expected = json.loads((DATA / "expected.json").read_text())
    for kind in ("flat", "swin"):
        out += [(f"0.1 {kind} {k}", v["checklist"]) for k, v in expected[kind].items() if "checklist" in v]
    return out


def test_from_json_accepts_every_checklist_the_kit_made():
    made = _genuine()
    assert len(made) > 100 and sum(k.startswith("preset") for k, _ in made) >= 10
    assert sum(k.startswith("0.1") for k, _ in made) >= 6
    for label, text in made:
        assert Checklist.from_json(text) == json.loads(text), label


# -- LOWs: cards without a recipe, nested items --------------------------------------------------------------------
def test_a_card_of_a_checklist_that_states_nothing_is_refused():
    with pytest.raises(vc.ArgumentError, match="^card: this checklist states no recipe"):
        Checklist({"notes": {"seen": "yes"}}).to_json(card=True)
    # a card rebuilt from its choices (no checklist text) still makes a card of those choices
    card = json.loads(Recipe(site="F4").checklist().to_json(card=True))
    del card["checklist"]
    again = json.loads(Checklist.from_json(card).to_json(card=True))
    assert again["feature representation"] == {"site": "F4", "layer": -1} != {"site": NOT_REPORTED,
                                                                              "layer": NOT_REPORTED}


def test_a_nested_item_is_refused_and_never_rendered_as_a_python_repr():
    with pytest.raises(vc.ArgumentError, match="^text: item 'a/b' must be text or a number"):
        Checklist.from_json('{"a": {"b": {"c": "<b>x</b>"}}}')
    row = Checklist({"a": {"b": {"c": "<b>x</b>"}}}).to_markdown().splitlines()[-1]
    assert "{'c'" not in row and "&lt;b&gt;" in row and "&quot;c&quot;" in row or '"c"' in row


# -- LOW: vc.estimate takes the rule vc.trace takes --------------------------------------------------------------------
def test_estimate_takes_and_checks_the_rule():
    assert vc.estimate(MODEL, targets="top1")["rule"] == "gradient"
    with pytest.raises(vc.VitcamError) as by_trace:
        vc.trace(MODEL, sample_image("shapes", 1), targets="top1", rule="no_such_rule")
    with pytest.raises(type(by_trace.value)) as by_estimate:
        vc.estimate(MODEL, targets="top1", rule="no_such_rule")
    assert str(by_estimate.value) == str(by_trace.value)
