"""The documentation site (issue #23): ``mkdocs build --strict`` passes, and the built site fetches nothing
from the network — no script, stylesheet, font, image or frame from another host, no dynamic import of one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("material")
pytest.importorskip("mkdocs_jupyter")
pytest.importorskip("mkdocstrings_handlers.python")

ROOT = Path(__file__).resolve().parents[2]
# Attributes and calls that make a browser fetch something (an <a href> is a link a reader may follow).
FETCHES = re.compile(r"""<(?:script|link|img|iframe|source|video|audio)\b[^>]*?\b(?:src|href)\s*=\s*["']?(https?:)?//"""
                     r"""|import\(\s*["']https?://|@import\s+(?:url\()?["']?https?://|url\(\s*["']?https?://""",
                     flags=re.I)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "VITCAM_DOCS_EXECUTE": "false", "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_pages_are_built(site):
    assert (site / "index.html").is_file() and (site / "architecture.html").is_file()
    api = (site / "api.html").read_text()
    assert "vitcam_nb.api.cam" in api or "cam(" in api
    # Doctests render as code (the "Example:" sections), not as prose.
    assert "<p>&gt;&gt;&gt;" not in api and "<p>>>>" not in api
    notebooks = sorted(p.stem for p in (site / "notebooks").glob("*.html"))
    assert notebooks == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


def test_nothing_is_fetched_from_the_network(site):
    offending = []
    for path in site.rglob("*"):
        if path.suffix in (".html", ".css") and path.is_file():
            for m in FETCHES.finditer(path.read_text(errors="replace")):
                offending.append(f"{path.relative_to(site)}: {m.group(0)[:120]}")
    assert not offending, offending[:10]


def test_the_explorer_page_exists_only_with_export_html(site):
    import vitcam_nb

    has_export = hasattr(vitcam_nb, "export_html")
    assert (site / "explorer.html").is_file() == has_export
    if has_export:
        assert (site / "assets" / "explorer.html").stat().st_size > 0
