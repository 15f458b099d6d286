"""The API reference renders the docstrings' Sphinx roles (``:func:`x```) as cross-references, not as raw text;
its headings are the names users call (``vc.trace``), each naming the object of its entry; ``to_pixels`` and
``run_figure`` have entries."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

import vitcam_nb as vc

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
RAW_ROLE = re.compile(r":(?:py:)?(?:func|mod|class|meth|data|attr|exc|obj|const):`")
sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
from griffe_examples import ExampleSections  # noqa: E402
from griffe_roles import SphinxRoles, rewrite  # noqa: E402


def _docstrings(obj, seen):
    if obj.path in seen or obj.is_alias:
        return
    seen.add(obj.path)
    if obj.docstring is not None:
        yield obj.path, obj.docstring.value
    for member in obj.members.values():
        if not member.is_alias:
            yield from _docstrings(member, seen)


def test_the_rendered_docstrings_hold_no_raw_roles():
    raw = [path for path, text in _docstrings(griffe.load("vitcam_nb", search_paths=[str(ROOT)]), set())
           if RAW_ROLE.search(text)]
    assert len(raw) > 100  # the package's docstrings do use roles: the extension has work to do
    loaded = griffe.load("vitcam_nb", search_paths=[str(ROOT)],
                         extensions=griffe.load_extensions(ExampleSections, SphinxRoles))
    left = [path for path, text in _docstrings(loaded, set()) if RAW_ROLE.search(text)]
    assert left == []


def test_a_role_becomes_an_optional_cross_reference_with_its_title():
    text = rewrite("see :func:`~vitcam_nb.api.cam`, :mod:`vitcam_nb.evaluate` and :meth:`to_json`",
                   "vitcam_nb.core.checklist", {"to_json": "vitcam_nb.core.checklist.Checklist"})
    assert text == ('see <autoref identifier="vitcam_nb.api.cam" optional><code>cam</code></autoref>, '
                    '<autoref identifier="vitcam_nb.evaluate" optional><code>vitcam_nb.evaluate</code></autoref> '
                    'and <autoref identifier="vitcam_nb.core.checklist.Checklist.to_json" optional>'
                    '<code>to_json</code></autoref>')


def _resolve(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_every_heading_is_the_public_name_of_its_entry():
    entries = re.findall(r'^::: ([\w.]+)\n    options:\n(?:      .*\n)*?      heading: "([\w.]+)"', API.read_text(),
                         flags=re.M)
    assert len(entries) == len(re.findall(r"^::: ", API.read_text(), flags=re.M))
    for path, heading in entries:
        assert heading.startswith("vc."), heading
        obj = vc
        for name in heading.split(".")[1:]:
            obj = getattr(obj, name) if hasattr(obj, name) else importlib.import_module(f"{obj.__name__}.{name}")
        assert obj is _resolve(path), (path, heading)
    assert ("vitcam_nb.capture.trace.trace", "vc.trace") in entries


def test_to_pixels_and_run_figure_have_entries():
    paths = re.findall(r"^::: ([\w.]+)$", API.read_text(), flags=re.M)
    assert "vitcam_nb.preprocess.to_pixels" in paths and "vitcam_nb.audit_figure.run_figure" in paths
