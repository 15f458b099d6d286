"""Issue 54, "nothing that lists the registered things is kept by hand": every generated part of the docs, the README
and the paper-card schema is what ``scripts/generate.py`` makes from the registries now, and a registration shows
up in (and an unregistration leaves) every list that names its kind. Containment and behaviour, never an exact
list of names."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

from vitcam_nb.adapters import VitAdapter, register_adapter, unregister_adapter
from vitcam_nb.core.card_schema import template, validate_card
from vitcam_nb.core.weighting import WEIGHTINGS, Weighting, register_weighting, weighting_names
from vitcam_nb.evaluate.metric_registry import METRICS, on_maps, register_metric

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("vitcam_generate", ROOT / "scripts" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = generate
_spec.loader.exec_module(generate)


def _generated(rel: str) -> str:
    return generate.generated()[ROOT / rel]


def test_every_committed_copy_is_what_the_registries_generate():
    assert generate.stale() == [], "run: python scripts/generate.py"


def test_the_package_and_docs_schema_copies_allow_every_registered_weighting():
    for rel in generate.SCHEMA_COPIES:
        schema = json.loads((ROOT / rel).read_text(encoding="utf-8"))
        enum = next(c["enum"] for c in schema["$defs"]["weighting"]["anyOf"] if "enum" in c)
        assert set(weighting_names()) <= set(enum)
    # and the validator the kit ships reads that enum: a card naming any registered weighting is valid
    card = template()
    for name in weighting_names():
        card["aggregation"]["weighting"] = name
        validate_card(card)


def test_the_paper_cards_page_names_every_weighting_the_schema_allows():
    # the six weightings docs/paper_cards.md once missed are among them
    page = (ROOT / "docs" / "paper_cards.md").read_text(encoding="utf-8")
    schema = json.loads((ROOT / "docs" / "paper_card.schema.json").read_text(encoding="utf-8"))
    enum = next(c["enum"] for c in schema["$defs"]["weighting"]["anyOf"] if "enum" in c)
    assert all(f"`{name}`" in page for name in enum)


def _grad_abs(A, G, wmask, patch, groups):
    terms = np.abs(G[..., patch, :]).reshape(*G[..., patch, :].shape[:-1], groups, -1)
    return terms.sum(-1), terms.sum(-1)


def test_a_new_weighting_reaches_the_schema_the_cards_page_and_the_tables_and_leaves_with_it():
    register_weighting(Weighting("zz_generated_probe", "map[t] = sum_k |G[t,k]| (probe)", _grad_abs))
    try:
        files = generate.generated()
        schema = json.loads(files[ROOT / generate.SCHEMA_COPIES[0]])
        enum = next(c["enum"] for c in schema["$defs"]["weighting"]["anyOf"] if "enum" in c)
        assert "zz_generated_probe" in enum
        assert files[ROOT / generate.SCHEMA_COPIES[1]] == files[ROOT / generate.SCHEMA_COPIES[0]]
        assert "`zz_generated_probe`" in files[ROOT / "docs" / "paper_cards.md"]
        row = "| `zz_generated_probe` | map[t] = sum_k &#124;G[t,k]&#124; (probe) |"
        assert row in files[ROOT / "docs" / "extending.md"]
        assert set(generate.stale()) >= {"docs/paper_cards.md", "docs/extending.md", *generate.SCHEMA_COPIES}
    finally:
        WEIGHTINGS.unregister("zz_generated_probe")
    assert "zz_generated_probe" not in _generated("docs/paper_cards.md")


def test_a_new_metric_reaches_the_evaluation_page():
    register_metric("zz_probe_metric", "complexity", on_maps(lambda m: float(m.max())), higher_is_better=False,
                    description="a | probe")
    try:
        page = _generated("docs/evaluation.md")
        assert "| `zz_probe_metric` | complexity | lower | - | yes | a &#124; probe |" in page
    finally:
        METRICS.unregister("zz_probe_metric")
    assert "zz_probe_metric" not in _generated("docs/evaluation.md")


def test_a_registered_family_without_a_measured_row_is_said_to_have_none():
    class ProbeAdapter(VitAdapter):
        family = "zz_probe_family"

    adapter = ProbeAdapter()
    register_adapter(adapter, first=False)
    try:
        assert "`zz_probe_family`" in _generated("README.md")
        matrix = generate.support_matrix()
        unmeasured = matrix.split("without a measured row:")[1]
        assert "`zz_probe_family`" in unmeasured
        assert "| `zz_probe_family` |" not in matrix  # no cell is claimed for it: no test measured one
    finally:
        unregister_adapter(adapter)
    assert "zz_probe_family" not in generate.support_matrix()


def test_the_matrix_cells_are_the_measured_ones():
    measured = {"rows": {"vit": {"F1": "✓", "F2": "✗"}, "swin_probe": {"F1": "n/a"}}}
    rows = [line for line in generate.support_matrix(measured).splitlines() if line.startswith("| `")]
    assert rows == ["| `vit` | ✓ | ✗ |  |  |  |  |", "| `swin_probe` | n/a |  |  |  |  |  |"]


def test_a_file_without_its_markers_is_refused_by_name(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="notes.md has no <!-- BEGIN generated: rules"):
        generate.replace_between("no markers here", "rules", "x", "notes.md")
