"""docs/architecture.md stays true: its worked examples run, and its schema table is the one the code defines."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from vitcam_nb.core.schema import markdown_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
TEXT = DOC.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)


def test_the_document_has_its_worked_examples():
    # a model family, a detector, a weighting, a target, a trace kind (a site is a list of steps: it edits the
    # package)
    assert len(BLOCKS) == 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_worked_example_runs(index):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(BLOCKS[index], f"{DOC.name}[python block {index}]", "exec"), {"__name__": f"doc_{index}"})


def test_schema_table_is_the_one_in_core_schema():
    table = TEXT.split("<!-- schema:start -->")[1].split("<!-- schema:end -->")[0].strip()
    assert table == markdown_table(), "run: python scripts/schema_table.py"


def test_every_section_the_code_cites_exists():
    cited = set()
    root = DOC.parents[1]
    for path in [*root.glob("vitcam_nb/**/*.py"), *root.glob("tests/**/*.py")]:
        text = re.sub(r"\s+", " ", path.read_text())  # a citation may wrap across lines
        cited |= set(re.findall(r'docs/architecture\.md,? \(?"([^"]+)"\)?', text))
    headings = set(re.findall(r"^#+ (.+)$", TEXT, flags=re.M))
    assert cited and cited <= headings, sorted(cited - headings)
