"""The architecture pages stay true: the worked examples of docs/models.md run, the schema table of
docs/reference.md is the one the code defines, and every section the code cites in docs/architecture.md exists
(docs/architecture.md became a short map in issue 54; its detail moved to models.md and reference.md)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from vitcam_nb.core.schema import markdown_table

DOCS = Path(__file__).resolve().parents[2] / "docs"
DOC = DOCS / "architecture.md"
TEXT = DOC.read_text()
MODELS = (DOCS / "models.md").read_text()
REFERENCE = (DOCS / "reference.md").read_text()
# the runnable examples are the family details' (the families overview's sketch names models it does not build)
DETAILS = MODELS.split("\n## Family details\n", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```python\n(.*?)```", DETAILS, flags=re.S)


def test_the_pages_have_their_worked_examples():
    # a family that is a variant of a built-in one and a detector; the recipes for a weighting, a rule, a family,
    # a metric, a preset, a target and a trace kind run in tests/integration/test_extending_doc.py
    assert len(BLOCKS) == 2
    assert "```text" in TEXT, "architecture.md keeps its one diagram"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_worked_example_runs(index):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(BLOCKS[index], f"models.md[python block {index}]", "exec"), {"__name__": f"doc_{index}"})


def test_schema_table_is_the_one_in_core_schema():
    table = REFERENCE.split("<!-- schema:start -->")[1].split("<!-- schema:end -->")[0].strip()
    assert table == markdown_table(), "run: python scripts/schema_table.py"


def test_every_section_the_code_cites_exists():
    cited = set()
    root = DOC.parents[1]
    for path in [*root.glob("vitcam_nb/**/*.py"), *root.glob("tests/**/*.py")]:
        text = re.sub(r"\s+", " ", path.read_text())  # a citation may wrap across lines
        cited |= set(re.findall(r'docs/architecture\.md,? \(?"([^"]+)"\)?', text))
    headings = set(re.findall(r"^#+ (.+)$", TEXT, flags=re.M))
    assert cited and cited <= headings, sorted(cited - headings)


def test_the_architecture_page_is_a_short_map_that_links_its_detail():
    assert len(TEXT.splitlines()) <= 150
    for page in ("models.md", "reference.md", "extending.md"):
        assert f"]({page}" in TEXT
    # the detail it had is on the pages it links to, not lost
    for heading in ("The trace schema", "Recipes and formulas", "The checklist", "Maps on the trace's device"):
        assert f"## {heading}" in REFERENCE
    assert "## The sites" in MODELS and "**Wrapped models.**" in MODELS
