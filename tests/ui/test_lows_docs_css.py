"""The docs site's stylesheet (docs/stylesheets/vitcam.css) under Material's own, in Chromium: an xarray Dataset's
HTML repr keeps its grid and stays in a box of its own height (Material restyles every list and the repr ran
thousands of pixels), and a wide checklist table in a notebook output scrolls within the page's column."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from lab_harness import browser_page, chromium_missing_reason

import vitcam_nb as vc

pytestmark = pytest.mark.browser
material = pytest.importorskip("material")

ROOT = Path(__file__).resolve().parents[2]
SITE_CSS = ROOT / "docs" / "stylesheets" / "vitcam.css"


def _page(tmp_path: Path, ours: bool) -> Path:
    main = sorted((Path(material.__file__).parent / "templates" / "assets" / "stylesheets").glob("main.*.css"))[0]
    ds = xr.Dataset({f"v{i}": (("y", "x"), np.zeros((3, 4))) for i in range(12)},
                    coords={f"c{i}": ("y", np.arange(3)) for i in range(12)}, attrs={f"a{i}": i for i in range(8)})
    table = vc.Recipe().checklist().to_markdown()  # rendered below as a notebook's markdown output would be
    rows = [line.strip("|").split("|") for line in table.splitlines()[2:]]
    html_table = "<table>" + "".join("<tr>" + "".join(f"<td>{c.strip()}</td>" for c in r) + "</tr>" for r in rows)
    html_table += f"<tr><td>recipe</td><td>json</td><td>{'x' * 3000}</td></tr></table>"
    link = f"<link rel='stylesheet' href='{SITE_CSS.as_uri()}'>" if ours else ""
    page = tmp_path / f"page{int(ours)}.html"
    page.write_text(f"<!doctype html><html><head><link rel='stylesheet' href='{main.as_uri()}'>{link}</head><body>"
                    "<div class='md-container'><main class='md-main'><div class='md-content' style='max-width:700px'>"
                    f"<article class='md-typeset'>{ds._repr_html_()}"
                    # a notebook's markdown output as mkdocs-jupyter writes it: a flex row whose child grows to
                    # its content, the table inside Material's scroll wrappers
                    "<div class='jp-OutputArea-child' style='display:flex'><div class='jp-OutputArea-prompt'></div>"
                    "<div class='jp-RenderedHTMLCommon jp-RenderedMarkdown jp-OutputArea-output'>"
                    f"<div class='md-typeset__scrollwrap'><div class='md-typeset__table'>{html_table}</div></div>"
                    "</div></div></article></div></main></div></body></html>")
    return page


def _measure(page: Path) -> dict:
    with browser_page(1280, 900) as p:
        p.goto(page.as_uri())
        return p.evaluate("""() => {
            const wrap = document.querySelector('.xr-wrap');
            const table = document.querySelector('.jp-RenderedMarkdown table');
            const column = document.querySelector('.md-content').getBoundingClientRect();
            return {height: wrap.getBoundingClientRect().height,
                    grid: getComputedStyle(document.querySelector('.xr-sections')).display,
                    tableRight: table.getBoundingClientRect().right, columnRight: column.right,
                    rem: parseFloat(getComputedStyle(wrap).fontSize)};
        }""")


def test_the_xarray_repr_and_a_wide_table_stay_in_the_column(tmp_path):
    if chromium_missing_reason():
        pytest.skip(chromium_missing_reason())
    before, after = _measure(_page(tmp_path, False)), _measure(_page(tmp_path, True))
    assert before["grid"] != "grid" and before["height"] > 1500  # the failure this stylesheet fixes
    assert before["tableRight"] > before["columnRight"] + 100
    assert after["grid"] == "grid"
    assert after["height"] <= 32 * after["rem"] + 1  # max-height: 32em
    assert after["tableRight"] <= after["columnRight"] + 1
