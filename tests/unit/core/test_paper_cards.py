"""Paper cards: the schema states the kit's allowed values, Checklist.to_json(card=True) is a valid card that
reports every choice of the recipe, from_json rebuilds the checklist, and the validator refuses bad cards naming
the field (and agrees with jsonschema where it is installed)."""

from __future__ import annotations

import copy
import json

import pytest

import vitcam_nb as vc
from vitcam_nb.core import recipe as recipe_module
from vitcam_nb.core.card_schema import (
    CARD_FIELDS,
    CARD_VERSION,
    NOT_REPORTED,
    PaperCardError,
    load_schema,
    template,
    validate_card,
)
from vitcam_nb.core.checklist import CATEGORIES, Checklist
from vitcam_nb.core.schema import SITES
from vitcam_nb.core.weighting import weighting_names

try:
    import jsonschema
except ImportError:  # the kit's own validator is the one under test; jsonschema only cross-checks it
    jsonschema = None

RECIPES = [
    vc.Recipe(),
    vc.Recipe(site="F2", layer=(0, 1), layer_fusion="mean", heads="max", attn_rows="patch_mean"),
    vc.Recipe(site="F4", layer="all", layer_fusion="max", target="prob", class_=3, upsample="none"),
    vc.Recipe(site="F1", weighting="gscorecam", k=8),
    vc.Recipe(site="F3", heads=2, relu="none", normalize="max"),
    vc.Recipe(site="F2", layer=(-2, -1), layer_fusion="rollout"),
]


def _jsonschema_valid(card) -> bool | None:
    if jsonschema is None:
        return None
    return jsonschema.Draft202012Validator(load_schema()).is_valid(card)


def test_the_schema_is_versioned_draft_2020_12():
    schema = load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"].endswith(CARD_VERSION) and schema["version"] == CARD_VERSION == "1.0.0"
    assert schema["properties"]["card_version"] == {"description": "The schema version the card follows.",
                                                    "const": CARD_VERSION}
    assert list(CARD_FIELDS) == list(CATEGORIES)
    if jsonschema is not None:
        jsonschema.Draft202012Validator.check_schema(schema)


def test_every_choice_field_holds_the_kits_allowed_values_or_not_reported():
    defs = load_schema()["$defs"]
    enums = {"site": SITES, "target": recipe_module.TARGETS, "weight_tokens": recipe_module.WEIGHT_TOKENS,
             "attn_rows": recipe_module.ATTN_ROWS, "weighting": weighting_names(), "heads": recipe_module.HEAD_RULES,
             "layer_fusion": recipe_module.LAYER_FUSIONS, "relu": recipe_module.RELUS,
             "reshape": recipe_module.RESHAPES, "upsample": recipe_module.UPSAMPLES,
             "normalize": recipe_module.NORMALIZES}
    for field, allowed in enums.items():
        branches = defs[field]["anyOf"]
        assert [b["enum"] for b in branches if "enum" in b] == [list(allowed)], field
        assert {"const": NOT_REPORTED} in branches, field
    for category, fields in CARD_FIELDS.items():
        assert set(load_schema()["properties"][category]["properties"]) == set(fields)


def test_the_template_is_valid_and_reports_nothing():
    card = template()
    assert validate_card(card) == card
    assert _jsonschema_valid(card) in (True, None)
    assert {v for c in CARD_FIELDS for v in card[c].values()} == {NOT_REPORTED}
    assert set(card["paper"].values()) == {NOT_REPORTED}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.to_string())
def test_a_checklist_as_a_card_is_valid_and_reports_every_choice(recipe):
    checklist = recipe.checklist()
    card = json.loads(checklist.to_json(card=True))
    assert validate_card(card) == card
    assert _jsonschema_valid(card) in (True, None)
    flat = {f: v for c in CARD_FIELDS for f, v in card[c].items()}
    expected = recipe.to_dict()  # the recipe's own JSON-ready fields, independently of the card code
    assert flat == expected
    assert NOT_REPORTED not in flat.values()
    assert card["paper"]["library"] == f"vitcam_nb {vc.__version__}"
    assert card["checklist"] == json.loads(checklist.to_json())


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.to_string())
def test_from_json_rebuilds_the_checklist_from_its_card(recipe):
    checklist = recipe.checklist()
    text = checklist.to_json(card=True, paper={"title": "A paper", "year": 2024, "justification": "partial"})
    again = Checklist.from_json(text)
    assert isinstance(again, Checklist) and again == checklist
    assert Checklist.from_json(json.loads(text)) == checklist
    assert Checklist.from_json(checklist.to_json()) == checklist


def test_a_card_without_the_checklist_text_gives_its_choices_by_category():
    card = json.loads(vc.Recipe(site="F4").checklist().to_json(card=True))
    del card["checklist"]
    card["aggregation"]["relu"] = NOT_REPORTED
    rebuilt = Checklist.from_json(card)
    assert list(rebuilt) == list(CATEGORIES)
    assert rebuilt["aggregation"] == {"weighting": "gradcam", "heads": "channels", "layer_fusion": "none",
                                      "relu": NOT_REPORTED}


def test_from_json_refuses_a_card_whose_checklist_disagrees_with_its_fields():
    card = json.loads(vc.Recipe().checklist().to_json(card=True))
    card["aggregation"]["weighting"] = "layercam"
    with pytest.raises(PaperCardError, match="card.checklist"):
        Checklist.from_json(card)


def test_paper_metadata_is_checked():
    checklist = vc.Recipe().checklist()
    with pytest.raises(PaperCardError, match=r"card\.paper\.justification"):
        checklist.to_json(card=True, paper={"justification": "somewhat"})
    with pytest.raises(TypeError, match="paper"):
        checklist.to_json(card=True, paper=["title"])
    with pytest.raises(TypeError, match="paper"):
        checklist.to_json(paper={"title": "x"})


def _set(path, value):
    def change(card):
        node = card
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return change


_DELETE = object()
BAD = [
    (_set(("aggregation", "weighting"), "gradcamx"), "card.aggregation.weighting: 'gradcamx' is not allowed"),
    (_set(("feature representation", "site"), _DELETE), "card.feature representation.site: missing"),
    (_set(("feature representation", "layer"), [0, 0]), "card.feature representation.layer"),
    (_set(("feature representation", "layer"), []), "card.feature representation.layer"),
    (_set(("gradient target", "class_"), "top0"), "card.gradient target.class_"),
    (_set(("aggregation", "heads"), -1), "card.aggregation.heads"),
    (_set(("aggregation", "heads"), True), "card.aggregation.heads"),
    (_set(("aggregation", "k"), 0), "card.aggregation.k"),
    (_set(("spatial reconstruction", "upsample"), "Bilinear"), "card.spatial reconstruction.upsample"),
    (_set(("spatial reconstruction", "smooth"), "yes"), "card.spatial reconstruction.smooth: unknown field"),
    (_set(("paper", "year"), "2020"), "card.paper.year"),
    (_set(("paper", "justification"), "some"), "card.paper.justification"),
    (_set(("paper",), _DELETE), "card.paper: missing"),
    (_set(("card_version",), "2.0.0"), "card.card_version: expected '1.0.0'"),
    (_set(("notes",), "x"), "card.notes: unknown field"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m for _, m in BAD])
def test_validate_refuses_a_bad_card_naming_the_field(change, message):
    card = copy.deepcopy(template())
    change(card)
    with pytest.raises(PaperCardError) as info:
        validate_card(card)
    assert str(info.value).startswith(message)
    assert isinstance(info.value, ValueError)
    assert _jsonschema_valid(card) in (False, None)


def test_the_refusal_says_what_the_field_allows():
    card = template()
    card["feature representation"]["layer"] = "last"
    with pytest.raises(PaperCardError) as info:
        validate_card(card)
    text = str(info.value)
    assert "'all'" in text and "'not reported'" in text and "a list of" in text


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", 3])
def test_validate_refuses_what_is_not_a_card_object(bad):
    with pytest.raises(PaperCardError, match="card:"):
        validate_card(bad)


def test_validate_accepts_json_text_and_the_values_each_field_allows():
    card = template()
    card["feature representation"] = {"site": "F2", "layer": ["2.-1", 3]}
    card["gradient target"] = {"target": "logprob", "class_": 7}
    card["token handling"] = {"weight_tokens": "not applicable", "attn_rows": "mean", "text_tokens": "cls"}
    card["aggregation"] = {"weighting": "layercam", "heads": 0, "layer_fusion": "sum", "relu": "none", "k": 300}
    card["paper"].update(year=2023, url="https://example.org/paper", note="made up")
    assert validate_card(json.dumps(card)) == card
    assert _jsonschema_valid(card) in (True, None)
