"""The audit as data: its published figures with their source, vc.audit.summarise on the illustrative cards (hand-
computed shares), CSV and JSON cards read alike, each card's ambiguity on the bundled model's trace against
vc.ambiguity itself, a map's checklist as a card, and the kit's CITATION.cff."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import tomllib
import yaml

import vitcam_nb as vc
from vitcam_nb.core.card_schema import AUDIT_DIR, CARD_FIELDS, NOT_REPORTED, PaperCardError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_JSON = AUDIT_DIR / "example_cards.json"
EXAMPLES_CSV = AUDIT_DIR / "example_cards.csv"


def test_vc_audit_is_the_paper_card_namespace():
    assert vc.audit is __import__("vitcam_nb.audit").audit
    for name in ("validate", "summarise", "schema", "template", "figures", "load_cards", "PaperCardError"):
        assert callable(getattr(vc.audit, name)), name
    assert vc.audit.schema()["version"] == "1.0.0"


def test_the_audit_figures_are_stored_exactly_with_their_source():
    fig = vc.audit.figures()
    assert fig["screened"] == {"count": 550, "approximate": True}
    assert fig["included"] == {"count": 175}
    assert fig["no_justification"] == {"count": 101, "share_percent": 58}
    assert fig["justified"] == {"count": 26, "share_percent": 15}
    assert fig["pytorch_grad_cam_only"] == {"count": 17, "share_percent": 10}
    assert fig["distinct_adaptations"] == {"count": 13}
    for key in ("no_justification", "justified", "pytorch_grad_cam_only"):  # the published rounding of n / 175
        assert round(100 * fig[key]["count"] / 175) == fig[key]["share_percent"], key
    source = fig["source"]
    assert source["authors"] == ["Wall", "Wang", "Rizk", "Santosh"] and source["year"] == 2026
    assert source["title"] == ("Grad-CAM for Vision Transformers: a systematic taxonomy and audit of "
                               "methodological ambiguity")
    assert source["title"] in source["citation"] and "Wall, Wang, Rizk & Santosh (2026)" in source["citation"]


def test_the_example_cards_are_labelled_illustrative():
    doc = json.loads(EXAMPLES_JSON.read_text())
    assert doc["illustrative"] is True and "NOT the audit's data" in doc["note"]
    for card in vc.audit.load_cards(EXAMPLES_JSON) + vc.audit.load_cards(EXAMPLES_CSV):
        assert card["paper"]["title"].startswith("Illustrative card")
        assert "illustrative" in card["paper"]["note"] and "not the audit's data" in card["paper"]["note"]


def test_csv_and_json_cards_read_alike():
    from_json = vc.audit.load_cards(EXAMPLES_JSON)
    assert vc.audit.load_cards(EXAMPLES_CSV) == from_json
    assert vc.audit.load_cards(json.loads(EXAMPLES_JSON.read_text())["cards"]) == from_json
    assert vc.audit.load_cards([json.dumps(c) for c in from_json]) == from_json
    assert vc.audit.summarise(EXAMPLES_CSV) == vc.audit.summarise(EXAMPLES_JSON) == vc.audit.summarise(from_json)


def test_summarise_the_illustrative_cards_gives_the_hand_computed_statistics():
    s = vc.audit.summarise(EXAMPLES_JSON)
    # By hand from example_cards.json: justification none on cards 1-4, partial on 5 and 8, justified on 6, 7;
    # cards 1 and 2 say only pytorch-grad-cam; 3 and 4 report the same (site F1, layer -1); 6, 7 report all.
    assert s["cards"] == 8
    assert s["no_justification"] == {"count": 4, "share": 0.5}
    assert s["justified"] == {"count": 2, "share": 0.25}
    assert s["justification"]["partial"] == {"count": 2, "share": 0.25}
    assert s["justification"][NOT_REPORTED] == {"count": 0, "share": 0.0}
    assert s["pytorch_grad_cam_only"] == {"count": 2, "share": 0.25}
    adaptations = s["distinct_adaptations"]
    assert adaptations["count"] == 5
    assert sorted(a["cards"] for a in adaptations["adaptations"]) == [[2, 3], [4], [5], [6], [7]]
    assert {"reported": {"layer": -1, "site": "F1"}, "cards": [2, 3]} in adaptations["adaptations"]
    full = s["fully_specified"]
    assert full["count"] == 2 and full["cards"] == [5, 6] and full["errors"] == {}
    six = vc.Recipe(site="F2", layer=-1)  # card 6: the kit's defaults at F2
    seven = vc.Recipe(site="F1", layer="all", layer_fusion="mean")  # card 7: heads and attn_rows moot at F1
    assert full["recipe_ids"] == sorted([six.id, seven.id]) and full["distinct_recipes"] == 2
    assert "ambiguity" not in s


def test_a_card_that_is_no_recipe_is_counted_with_its_error():
    card = vc.audit.load_cards(EXAMPLES_JSON)[5]
    card["feature representation"]["site"] = "F1"
    card["aggregation"]["heads"] = "max"  # a head rule at a site without heads: no recipe
    full = vc.audit.summarise([card])["fully_specified"]
    assert full["count"] == 1 and full["distinct_recipes"] == 0
    assert full["errors"][0].startswith("heads:")


def test_bad_card_sets_are_refused_naming_the_card_and_field(tmp_path):
    cards = vc.audit.load_cards(EXAMPLES_JSON)
    cards[3]["paper"]["justification"] = "maybe"
    with pytest.raises(PaperCardError, match=r"^cards\[3\]: card\.paper\.justification"):
        vc.audit.summarise(cards)
    rows = EXAMPLES_CSV.read_text().splitlines()
    header = rows[0].split(",")
    cells = rows[3].split(",")
    cells[6 + header[6:].index("site") + 1] = ""  # the note cell holds a comma: one extra split
    empty = tmp_path / "empty.csv"
    empty.write_text("\n".join([rows[0], ",".join(cells)]) + "\n")
    with pytest.raises(PaperCardError, match="row 2, column 'site' is empty"):
        vc.audit.load_cards(empty)
    unknown = tmp_path / "unknown.csv"
    unknown.write_text(rows[0] + ",smoothing\n")
    with pytest.raises(PaperCardError, match="column 'smoothing' is unknown"):
        vc.audit.load_cards(unknown)
    with pytest.raises(PaperCardError, match="is not a file"):
        vc.audit.summarise(tmp_path / "missing.json")
    with pytest.raises(PaperCardError, match=r"\.json or \.csv"):
        vc.audit.summarise(empty.rename(tmp_path / "cards.txt"))


@pytest.fixture(scope="module")
def shapes():
    model = vc.load_model("shapes-vit")
    return [vc.trace(model, vc.sample_image("shapes", i)) for i in range(2)]


OPTIONS = {"n_boot": 10}


def _median(amb) -> float | None:
    rho = amb.spread.median_spearman
    return float(rho) if math.isfinite(rho) else None


def test_each_cards_ambiguity_on_the_bundled_models_trace(shapes):
    cards = [vc.audit.load_cards(EXAMPLES_JSON)[i] for i in (2, 4, 5)]
    s = vc.audit.summarise(cards, shapes[0], **OPTIONS)
    direct = [vc.ambiguity(shapes[0], {"site": "F1", "layer": -1}, **OPTIONS),
              vc.ambiguity(shapes[0], {"site": "F1", "layer": -1, "weighting": "gradcam", "weight_tokens": "patch"},
                           **OPTIONS)]
    for got, amb in zip(s["ambiguity"][:2], direct, strict=True):
        assert got["recipes"] == len(amb.recipes) and got["images"] == 1
        assert got["median_spearman"] == pytest.approx(_median(amb))
    assert len(direct[0].recipes) > len(direct[1].recipes) > 1  # reporting more leaves fewer recipes
    assert s["ambiguity"][2]["recipes"] == 1 and s["ambiguity"][2]["median_spearman"] is None  # fully specified
    assert [a["card"] for a in s["ambiguity"]] == [0, 1, 2]


def test_a_cards_ambiguity_over_several_images(shapes):
    card = vc.audit.load_cards(EXAMPLES_JSON)[4]
    got = vc.audit.summarise([card], shapes, **OPTIONS)["ambiguity"][0]
    reported = {"site": "F1", "layer": -1, "weighting": "gradcam", "weight_tokens": "patch"}
    per_image = [vc.ambiguity(t, reported, **OPTIONS) for t in shapes]
    assert got["images"] == 2 and got["recipes"] == len(per_image[0].recipes)
    assert got["median_spearman"] == pytest.approx(float(np.median([_median(a) for a in per_image])))


def test_a_card_no_recipe_on_the_trace_fits_gets_its_error(shapes):
    card = vc.audit.template()
    card["feature representation"]["layer"] = 40  # the bundled model has 6 blocks
    got = vc.audit.summarise([card], shapes[0], **OPTIONS)["ambiguity"][0]
    assert set(got) == {"reported", "error", "card"} and got["reported"] == {"layer": 40}


def test_bad_ambiguity_options_raise_rather_than_mark_every_card(shapes):
    with pytest.raises(ValueError, match="n_samples"):
        vc.audit.summarise(EXAMPLES_JSON, shapes[0], n_samples=0)


def test_a_maps_checklist_is_a_valid_card_and_comes_back(shapes):
    m = vc.cam(shapes[0], vc.Recipe(site="F2", layer=-1, heads="relu_then_mean"))
    checklist = vc.Checklist.from_json(m.attrs["checklist"])
    assert "model and input" in checklist
    card = vc.audit.validate(checklist.to_json(card=True))
    assert card["aggregation"]["heads"] == "relu_then_mean" and card["feature representation"]["site"] == "F2"
    assert vc.Checklist.from_json(card) == checklist
    assert vc.Checklist.from_json(card).to_json() == m.attrs["checklist"]


def test_the_audit_files_ship_with_the_package():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vitcam_nb"]
    assert "data/audit/*" in data
    names = {p.name for p in AUDIT_DIR.iterdir()}
    assert {"paper_card.schema.json", "paper_card_template.json", "audit_figures.json", "example_cards.json",
            "example_cards.csv"} <= names


def test_citation_cff_cites_the_kit_and_the_audit():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software" and cff["license"] == "MIT"
    assert cff["title"] == "vitcam_nb" and cff["version"] == vc.__version__
    assert cff["authors"] == [{"name": "vitcam_nb developers"}] and cff["message"]
    (audit,) = cff["references"]
    assert audit["title"] == vc.audit.figures()["source"]["title"] and audit["year"] == 2026
    assert [a["family-names"] for a in audit["authors"]] == ["Wall", "Wang", "Rizk", "Santosh"]


def test_the_docs_page_serves_the_schema_and_lists_every_field():
    page = (ROOT / "docs" / "paper_cards.md").read_text()
    served = (ROOT / "docs" / "paper_card.schema.json").read_bytes()
    assert served == (AUDIT_DIR / "paper_card.schema.json").read_bytes()  # the site's copy is the package's
    assert "](paper_card.schema.json)" in page
    schema = vc.audit.schema()
    for category, fields in CARD_FIELDS.items():
        for field in fields:
            assert f"| {category} | `{field}`" in page, field
    for field in schema["properties"]["paper"]["properties"]:
        assert f"| `{field}`" in page, field
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:")[1]
    assert "paper_cards.md" in nav
