"""The demo's report.html in a real browser (Debian's headless Chromium, 1280 px wide viewport): nothing wider
than the viewport, one provenance block, every checklist folded in a <details>, and a page a fraction of the
old 26,925 px. Run: ``python -m pytest tests/ui/test_report_layout.py -q``."""

from __future__ import annotations

import pytest
from lab_harness import browser_page, chromium_missing_reason

import vitcam_nb as vc
from vitcam_nb.demo import demo_recipes, run_demo

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if chromium_missing_reason():
        pytest.skip(chromium_missing_reason())
    if "shapes-vit" not in vc.models.bundled_names():
        pytest.skip("bundled model shapes-vit is not available")
    return run_demo(tmp_path_factory.mktemp("demo"), progress=False)["report"]


def test_report_fits_a_1280px_viewport(report):
    n_layers = int(vc.load(report.parent / "trace.nc").attrs["num_layers"])
    with browser_page(1280, 900) as page:
        page.goto(report.as_uri())
        width, height = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        assert width <= 1280
        assert height < 12000
        assert page.locator("section.provenance").count() == 1
        cards = page.locator("div.card").count()
        assert cards == len(demo_recipes(n_layers)) == page.locator("table.checklist").count()
        folded = page.evaluate("[...document.querySelectorAll('table.checklist')]"
                               ".every(t => t.parentElement.tagName === 'DETAILS' && !t.parentElement.open)")
        assert folded
        # Opening every checklist keeps the page inside the viewport's width (long strings wrap).
        page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280
        right = page.evaluate("Math.max(...[...document.querySelectorAll('div.card, img')]"
                              ".map(c => c.getBoundingClientRect().right))")
        assert right <= 1280
