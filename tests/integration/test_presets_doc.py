"""Every preset is placed in the taxonomy, and docs/presets.md (linked from the site's nav and the README) is the
table generated from it (issue #20)."""

from __future__ import annotations

import re
from pathlib import Path

import vitcam_nb as vc
from vitcam_nb.core.preset_taxonomy import TAXONOMY
from vitcam_nb.presets import COLUMNS, markdown_table

ROOT = Path(__file__).resolve().parents[2]


def test_every_preset_has_a_full_taxonomy_entry_and_a_citation():
    assert set(TAXONOMY) == set(vc.presets.names())
    for name in vc.presets.names():
        entry = TAXONOMY[name]
        assert set(entry) == set(COLUMNS), name
        assert all(isinstance(v, str) and v.strip() for v in entry.values()), name
        assert entry["code"] == "none" or entry["code"].startswith("https://"), name
        assert vc.presets.CITATIONS[name] and vc.presets.citation(vc.presets.get(name)), name


def test_the_preset_page_is_the_generated_table():
    text = (ROOT / "docs" / "presets.md").read_text()
    table = text.split("<!-- presets:start -->")[1].split("<!-- presets:end -->")[0].strip()
    assert table == markdown_table(), "run: python scripts/presets_table.py"
    rows = [line for line in table.splitlines()[2:]]
    assert [re.match(r"\| `(\w+)` \|", r).group(1) for r in rows] == vc.presets.names()


def test_the_preset_page_is_linked_from_the_site_and_the_readme():
    assert "presets.md" in (ROOT / "mkdocs.yml").read_text()
    assert "(docs/presets.md)" in (ROOT / "README.md").read_text()
