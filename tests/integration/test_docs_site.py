"""The documentation site: ``mkdocs build --strict`` passes with the notebooks executed, every tutorial page shows
its figures (widgets as their static pictures, no live view waiting for a widget manager), and the built site
fetches nothing from the network — checked twice: no script, stylesheet, font, image or frame from another host
in the HTML and CSS, and every page loaded in Chromium makes no request to another host, including the ones a
script would build at run time."""

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
sys.path.insert(0, str(ROOT / "tests" / "ui"))
from lab_harness import browser_page, chromium_missing_reason  # noqa: E402

# Attributes and calls that make a browser fetch something (an <a href> is a link a reader may follow).
FETCHES = re.compile(r"""<(?:script|link|img|iframe|source|video|audio)\b[^>]*?\b(?:src|href)\s*=\s*["']?(https?:)?//"""
                     r"""|import\(\s*["']https?://|@import\s+(?:url\()?["']?https?://|url\(\s*["']?https?://""",
                     flags=re.I)
WIDGET_MANAGER = re.compile(r"html-manager|embed-amd|unpkg\.com|jsdelivr", flags=re.I)


@pytest.fixture(scope="module")
def site(tmp_path_factory, executed_notebooks) -> Path:
    out = tmp_path_factory.mktemp("site")
    # The notebooks are executed once per session (the notebook tests read the same run); a notebook that failed
    # there is executed again by the build, and fails it.
    env = {**os.environ, "VITCAM_DOCS_EXECUTE": "true", "VITCAM_DOCS_EXECUTED": str(executed_notebooks.folder),
           "NO_MKDOCS_2_WARNING": "1", "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_pages_are_built(site):
    assert (site / "index.html").is_file() and (site / "architecture.html").is_file()
    assert (site / "evaluation.html").is_file() and (site / "images" / "vit_block_sites.svg").is_file()
    api = (site / "api.html").read_text()
    assert "vitcam_nb.api.cam" in api or "cam(" in api
    for name in ("export_html", "ambiguity", "score", "estimate", "scorecard", "from_pytorch_grad_cam",
                 "register_adapter", "register_weighting", "prompts"):
        assert re.search(rf'id="vitcam_nb\.[\w.]*\b{name}"', api), name
    # Doctests render as code (the "Example:" sections), not as prose.
    assert "<p>&gt;&gt;&gt;" not in api and "<p>>>>" not in api
    notebooks = sorted(p.stem for p in (site / "notebooks").glob("*.html"))
    assert notebooks == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


def test_tutorial_pages_show_their_executed_figures(site, executed_notebooks):
    import nbformat
    from vitcam_notebooks import notebook_runner

    runner = notebook_runner()
    for page in sorted((site / "notebooks").glob("*.html")):
        html = page.read_text()
        executed = executed_notebooks.folder / "notebooks" / f"{page.stem}.ipynb"
        book = nbformat.read(executed if executed.is_file() else ROOT / "notebooks" / executed.name, as_version=4)
        outputs = [o for c in book.cells for o in c.get("outputs", [])]
        skipped = any(str(o.get("text", "")).startswith(runner.SKIPPED) for o in outputs)  # no weights on disk
        # Pictures on the page (the theme's CSS carries small PNG data URLs of its own).
        shown = len(re.findall(r"""<img\b[^>]*\bsrc=["']data:image/png;base64,""", html))
        if not skipped and any(c.cell_type == "code" and runner.DRAWS.search(c.source) for c in book.cells):
            assert shown, f"{page.name}: no figure"
        # Every PNG the run stored is on the page.
        assert shown >= sum("image/png" in o.get("data", {}) for o in outputs), page.name
        assert "application/vnd.jupyter.widget-view+json" not in html, f"{page.name}: a live widget view"
        assert not WIDGET_MANAGER.search(html), f"{page.name}: loads a widget manager"
    quick = (site / "notebooks" / "01_quickstart.html").read_text()
    assert len(re.findall(r"<img\b[^>]*\bsrc=\"data:image/png;base64,", quick)) >= 3  # overlay, Explorer, gallery


def test_nothing_is_fetched_from_the_network(site):
    offending = []
    for path in site.rglob("*"):
        if path.suffix in (".html", ".css") and path.is_file():
            for m in FETCHES.finditer(path.read_text(errors="replace")):
                offending.append(f"{path.relative_to(site)}: {m.group(0)[:120]}")
    assert not offending, offending[:10]


def test_no_page_requests_another_host_in_a_browser(site):
    reason = chromium_missing_reason()
    if reason:
        if os.environ.get("VITCAM_REQUIRE_BROWSER"):
            pytest.fail(reason)
        pytest.skip(reason)
    pages = sorted(site.glob("*.html")) + sorted((site / "notebooks").glob("*.html"))
    pages += [site / "assets" / "explorer.html"] if (site / "assets" / "explorer.html").is_file() else []
    requested = []
    with browser_page() as page:
        page.on("request", lambda req: requested.append((page.url, req.url)))
        for path in pages:
            page.goto(path.as_uri(), wait_until="load")
            page.wait_for_timeout(300)  # let scripts that build URLs after load run
    foreign = [(p, u) for p, u in requested if not u.startswith(("file:", "data:", "blob:", "about:"))]
    assert len({p for p, _ in requested}) >= len(pages) - 1
    assert not foreign, foreign[:10]


def test_the_explorer_page_exists_only_with_export_html(site):
    import vitcam_nb

    has_export = hasattr(vitcam_nb, "export_html")
    assert (site / "explorer.html").is_file() == has_export
    if has_export:
        assert (site / "assets" / "explorer.html").stat().st_size > 0


# --------------------------------------------------------------------------------------------------
# the build's notebook step, in-process: stored outputs by default; an executed notebook that fails is named


def _hooks(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("vitcam_docs_site_hooks", ROOT / "docs" / "_hooks" / "site.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    monkeypatch.setattr(hooks, "_export_html", lambda: None)  # the Explorer page is not what these tests check
    return hooks


def test_the_default_build_shows_the_stored_notebooks_and_executes_none(monkeypatch, tmp_path):
    from mkdocs.structure.files import Files

    hooks = _hooks(monkeypatch)
    monkeypatch.delenv("VITCAM_DOCS_EXECUTE", raising=False)
    runner = hooks._notebook_runner()

    def refuse(*args, **kwargs):
        raise AssertionError("the default docs build executed a notebook")

    monkeypatch.setattr(runner, "execute", refuse)
    monkeypatch.setattr(hooks, "_notebook_runner", lambda: runner)
    files = hooks.on_files(Files([]), {"site_dir": str(tmp_path), "use_directory_urls": False})
    pages = [f for f in files if f.src_uri.startswith("notebooks/")]
    assert [Path(f.abs_src_path) for f in pages] == [ROOT / "notebooks" / p.name for p in hooks.NOTEBOOKS]


def test_an_executed_notebook_that_fails_stops_the_build_naming_it(monkeypatch, tmp_path):
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import Files

    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    hooks = _hooks(monkeypatch)
    book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Video"),
                                           nbformat.v4.new_code_cell("1 / 0")])
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "15_video.ipynb"
    nbformat.write(book, path)
    monkeypatch.setattr(hooks, "NOTEBOOKS", [path])
    monkeypatch.setenv("VITCAM_DOCS_EXECUTE", "true")
    monkeypatch.delenv("VITCAM_DOCS_EXECUTED", raising=False)
    with pytest.raises(PluginError, match=r"notebook 15_video\.ipynb failed in cell 1: ZeroDivisionError"):
        hooks.on_files(Files([]), {"site_dir": str(tmp_path / "site"), "use_directory_urls": False})
