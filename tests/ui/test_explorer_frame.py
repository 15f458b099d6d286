"""The documentation site's Explorer page shows the whole exported Explorer in its frame: the exported page reports
its height to the page holding it (``static/standalone.js``) and the docs page's frame (``docs/_hooks/site.py``)
takes it, at load and when the page grows (the checklist opened). Before, a fixed 820-pixel frame cut the page off
below its class control. Checked in Chromium from ``file://``, as the site is read offline: the frame's markup is
the docs hook's own, around a page exported from a tiny trace. Run:
``python -m pytest tests/ui/test_explorer_frame.py -q``.
"""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest
from lab_harness import new_page, required_chromium

import vitcam_nb as vc

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]


def docs_hook():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("vitcam_docs_site_hook", ROOT / "docs" / "_hooks" / "site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def browser():
    yield from required_chromium()


@pytest.fixture(scope="module")
def host(tmp_path_factory, model_factory, model_input):
    """The docs hook's Explorer page markup (its frame and script) in a page as wide as the site's content column,
    around an Explorer exported from a tiny trace."""
    hook = docs_hook()
    folder = tmp_path_factory.mktemp("frame")
    exported = folder / hook.EXPLORER_FILE
    exported.parent.mkdir(parents=True)
    tr = vc.trace(model_factory("vit"), model_input("vit"), targets="top3")
    vc.export_html(tr, exported, axes={"site": ["F1", "F2"], "class_": ["top1", "top2"]}, progress=False)
    markdown = hook._explorer_page(exported)
    embed = re.search(r"<iframe.*?</iframe>\s*<script>.*?</script>", markdown, flags=re.S)
    assert embed, "the Explorer page has no frame and script"
    page = folder / "explorer.html"
    page.write_text(f"<!doctype html><html><body style='margin:0'><article style='width:690px;margin:20px'>"
                    f"<h1>Explorer</h1>{embed.group(0)}<p id='after'>after the frame</p></article></body></html>")
    return page


def _wait(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def open_page(browser, host):
    """The host page loaded, its exported Explorer running; returns (page, frame element, the frame's document)."""
    page = new_page(browser, 1280, 900)
    page.goto(host.as_uri())
    page.frame_locator("#vc-explorer-frame").locator("body[data-loaded='true']").wait_for(timeout=30_000)
    inner = next(f for f in page.frames if f != page.main_frame and f.url.endswith("explorer.html"))
    return page, page.locator("#vc-explorer-frame"), inner


def fits(box, inner) -> bool:
    """The frame is as tall as its page (its reported height is rounded up; the page's own margin below) and the
    last control of the panel lies inside it."""
    height = box.evaluate("(f) => f.clientHeight")
    content = inner.evaluate("() => Math.ceil(document.body.getBoundingClientRect().bottom)")
    last = inner.evaluate("() => Math.max(...[...document.querySelectorAll('[data-field]')].map((e) =>"
                          " e.getBoundingClientRect().bottom))")
    return content <= height <= content + 40 and last < height


def test_the_docs_frame_shows_every_control_of_the_exported_explorer(host, browser):
    page, box, inner = open_page(browser, host)
    try:
        _wait(lambda: fits(box, inner), "the frame to take its page's height")
        tall = box.evaluate("(f) => f.clientHeight")
        # The checklist opened: the page grows, and the frame with it.
        page.frame_locator("#vc-explorer-frame").locator("details summary", has_text="checklist").first.click()
        _wait(lambda: box.evaluate("(f) => f.clientHeight") > tall + 100 and fits(box, inner), "the frame to grow")
        assert page.dialogs == []
    finally:
        page.close()


def test_a_height_from_another_window_is_ignored(host, browser):
    page, box, inner = open_page(browser, host)
    try:
        _wait(lambda: fits(box, inner), "the frame to take its page's height")
        before = box.evaluate("(f) => f.clientHeight")
        # The page itself (not the frame) posts a height: the frame keeps its own.
        page.evaluate("() => window.postMessage({vitcam: 'explorer-height', height: 99}, '*')")
        page.wait_for_timeout(300)
        assert box.evaluate("(f) => f.clientHeight") == before
    finally:
        page.close()
