"""The Explorer in marimo (``mo.ui.anywidget``): ``marimo run notebooks/explorer_marimo.py`` on 127.0.0.1, opened
in Debian's headless Chromium. The Explorer's module loads from the kernel with no request leaving the machine; a
control change goes to the kernel and back: the canvas changes, the recipe shown is Python's for the choice, and
the app's next cell, which reads ``explorer.value``, shows the same recipe id (traitlets synced both ways).

marimo's model applies a kernel update one trait at a time and emits each change at once, so the page must not
paint from "frame" before "grid" of the same answer has arrived (``listen`` in ``static/core.js``): with the
handlers run at once, the canvas kept the previous map under the new recipe's id. Run:
``python -m pytest tests/ui/test_marimo_explorer.py -q``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from lab_harness import free_port, new_page, required_chromium

import vitcam_nb as vc

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "notebooks" / "explorer_marimo.py"
# The example's first recipe, and the control change made here (the class control: a round trip, not prefetched).
START = vc.Recipe(site="F1", layer=-1)
CHANGED = START.replace(class_="top2")


def _marimo_missing() -> str | None:
    try:
        import marimo  # noqa: F401
    except ImportError:
        return "marimo is not installed (pip install -e '.[test]')"
    return None


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """``marimo run`` of the example app on a free loopback port (stopped by its process id at the end)."""
    reason = _marimo_missing()
    if reason:
        if os.environ.get("VITCAM_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser tests are required here but cannot run: {reason}")
        pytest.skip(reason)
    port = free_port()
    home = tmp_path_factory.mktemp("marimo-home")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "MARIMO_SKIP_UPDATE_CHECK": "1", "HOME": str(home), "XDG_CONFIG_HOME": str(home / "config"),
           "XDG_CACHE_HOME": str(home / "cache"), "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    log = open(home / "marimo.log", "w")  # noqa: SIM115 (kept open for the server's lifetime)
    proc = subprocess.Popen([sys.executable, "-m", "marimo", "run", str(APP), "--headless", "--host", "127.0.0.1",
                             "--port", str(port), "--no-token"], cwd=home, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"marimo run exited with {proc.returncode}:\n{(home / 'marimo.log').read_text()}")
            try:
                with urllib.request.urlopen(url, timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"marimo run did not answer in 60 s:\n{(home / 'marimo.log').read_text()}")
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def browser(app):
    yield from required_chromium()


def _picture(canvas) -> str:
    """A hash of the canvas's pixels (as a PNG data URL)."""
    return hashlib.sha256(canvas.evaluate("(c) => c.toDataURL()").encode()).hexdigest()


def _wait(check, what: str, timeout: float = 30.0) -> None:
    # marimo renders an anywidget in a shadow root: polled through Playwright locators, which pierce it.
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_the_explorer_runs_in_marimo_offline_and_a_control_changes_the_map(app, browser):
    page = new_page(browser, 1200, 1400)
    elsewhere: list[str] = []

    def route(r):
        # Only the marimo server on loopback may be asked for anything; every other request is recorded and refused.
        if r.request.url.startswith(app) or r.request.url.startswith(("data:", "blob:")):
            r.continue_()
        else:
            elsewhere.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    try:
        page.goto(app)
        root = page.locator(".vc-explorer")
        root.wait_for(state="attached", timeout=90_000)
        _wait(lambda: root.get_attribute("data-ready") == "true" and root.get_attribute("data-state") == "ready",
              "the Explorer to be ready", 90)
        assert root.get_attribute("data-recipe-id") == START.id
        assert root.get_attribute("data-painted-recipe-id") == START.id
        shown = page.get_by_text("Recipe shown:")
        _wait(lambda: START.id in shown.inner_text(), "the app's cell to show the first recipe")
        canvas = page.locator("canvas.vc-canvas")
        before = _picture(canvas)
        page.locator("select[data-field='class_']").select_option(value='"top2"')
        _wait(lambda: root.get_attribute("data-state") == "ready"
              and root.get_attribute("data-painted-recipe-id") == CHANGED.id, "the kernel's answer to be painted")
        assert root.get_attribute("data-recipe-id") == CHANGED.id and root.get_attribute("data-error") == "false"
        assert _picture(canvas) != before, "the canvas still shows the previous map"
        # The kernel's new state reached marimo: the cell reading explorer.value ran again with the new recipe.
        _wait(lambda: CHANGED.id in shown.inner_text(), "the app's cell to show the new recipe")
        # Back to the first class: the same picture as at the start (the first map, not a stale one).
        page.locator("select[data-field='class_']").select_option(value='"top1"')
        _wait(lambda: root.get_attribute("data-painted-recipe-id") == START.id
              and root.get_attribute("data-state") == "ready", "the first recipe to be painted again")
        assert _picture(canvas) == before
        assert elsewhere == [], f"requests left the machine: {elsewhere}"
        assert page.dialogs == []
    finally:
        page.close()
