"""docs/extending.md (issue 54): one recipe per extension kind, each naming the file to add and the test to write,
with a complete example that runs here; every example undoes its registration, so the registries are as they
were after each block."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import vitcam_nb as vc
from vitcam_nb.adapters.registry import supported_families
from vitcam_nb.core.kinds import TRACE_KINDS
from vitcam_nb.core.rules import rule_names
from vitcam_nb.core.weighting import weighting_names
from vitcam_nb.evaluate.metric_registry import metric_names

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "extending.md"
TEXT = PAGE.read_text(encoding="utf-8")
KINDS = ("A weighting", "A backward rule", "A model family", "A metric", "A preset", "A target", "A trace kind")


def _section(heading: str) -> str:
    return TEXT.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _blocks() -> list[tuple[str, str]]:
    return [(h, b) for h in KINDS for b in re.findall(r"```python\n(.*?)```", _section(h), flags=re.S)]


def _registries() -> dict[str, object]:
    return {"weightings": weighting_names(), "rules": rule_names(), "metrics": metric_names(),
            "families": supported_families(), "presets": vc.presets.names(), "kinds": TRACE_KINDS.names(),
            "targets": vc.targets.target_names()}


def test_every_extension_kind_has_a_recipe_naming_its_file_and_test_with_an_example():
    for heading in KINDS:
        section = _section(heading)
        assert "**Add** one" in section and "**test**" in section, heading
        assert "```python" in section, heading


@pytest.mark.parametrize(("heading", "block"), _blocks(), ids=[h for h, _ in _blocks()])
def test_the_example_runs_and_undoes_its_registration(heading, block):
    before = _registries()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(block, f"extending.md[{heading}]", "exec"), {"__name__": "doc_extending"})  # noqa: S102
    assert _registries() == before, f"{heading}: the example must undo its registration"


def test_the_page_is_in_the_site_nav_and_linked_from_the_readme_and_the_map():
    assert "extending.md" in (ROOT / "mkdocs.yml").read_text()
    assert "(docs/extending.md" in (ROOT / "README.md").read_text()
    assert "](extending.md" in (ROOT / "docs" / "architecture.md").read_text()
