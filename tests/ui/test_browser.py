"""Real-browser tests: JupyterLab on localhost, Debian's headless Chromium driven by Playwright.

The notebook (tests/ui/conftest.py) traces a tiny ViT and displays an Explorer, a Gallery and a Compare;
cells are run with Shift+Enter in the Lab UI. Checks: the widgets render; a control change in the page
repaints the canvas and changes the recipe in the kernel; setting the recipe from Python updates the
page; a refused combination is a message, not a traceback; a stale answer is never painted; labels are
text, never HTML. The Explorer is also driven once in Notebook 7 (skipped if it is not installed). An
Explorer on a three-image store (a second notebook): the page's image picker switches image in the kernel,
keeping the recipe, and ``ex.index`` set from Python moves the picker.
Run: ``python -m pytest tests/ui -q -m browser``.
"""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pytest
from lab_harness import new_page, notebook7_missing_reason, open_notebook, output_text, run_cell

import vitcam_nb as vc

pytestmark = pytest.mark.browser

EX = ".vc-explorer"


def explorer(page):
    return page.locator(EX).first  # the Gallery's own Explorer (opened later) comes after it in the page


def dataset(page) -> dict:
    return explorer(page).evaluate("(root) => ({ ...root.dataset })")


def canvas_png(page) -> str:
    return explorer(page).locator("canvas.vc-canvas").evaluate("(c) => c.toDataURL()")


def wait_recipe(page, recipe: vc.Recipe, timeout_ms: int = 30_000) -> None:
    page.wait_for_function(
        "(id) => { const r = document.querySelector('.vc-explorer');"
        " return r && r.dataset.recipeId === id && r.dataset.state === 'ready'; }",
        arg=recipe.id, timeout=timeout_ms)


def select(page, field: str, value) -> None:
    explorer(page).locator(f"select[data-field='{field}']").select_option(value=json.dumps(value))


def python_recipe(lab, want: vc.Recipe, timeout_s: float = 15.0) -> vc.Recipe:
    """The kernel's ``ex.recipe`` as logged by the notebook's observer (waits for ``want`` to appear)."""
    log = lab.root / "recipes.jsonl"
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if log.exists():
            lines = log.read_text().split()
            last = vc.Recipe.from_json(lines[-1]) if lines else None
            if last == want:
                return last
        time.sleep(0.1)
    return last


def test_widgets_render(page):
    data = dataset(page)
    assert data["recipeId"] == vc.Recipe(layer=1).id and int(data["paintCount"]) >= 1
    assert explorer(page).locator(".vc-recipe-id").inner_text() == vc.Recipe(layer=1).id
    size = explorer(page).locator("canvas.vc-canvas").evaluate("(c) => [c.width, c.height]")
    assert size == [384, 384]
    colours = explorer(page).locator("canvas.vc-canvas").evaluate(
        "(c) => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; const s = new Set();"
        " for (let i = 0; i < d.length; i += 4) s.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]); return s.size; }")
    assert colours > 50
    sites = explorer(page).locator("select[data-field='site'] option").evaluate_all("(o) => o.map((x) => x.value)")
    assert sites == [json.dumps(s) for s in ("F1", "F2", "F3", "F4", "F5", "F6")]
    for hidden in ("heads", "attn_rows"):  # they apply at F2/F3 only
        assert explorer(page).locator(f".vc-row[data-field='{hidden}']").is_hidden()
    assert "Methods paragraph" in explorer(page).inner_text()
    assert page.locator(".vc-gallery button.vc-cell").count() == 3 * 6
    assert page.locator(".vc-compare").get_attribute("data-spearman") != ""
    assert "Traceback" not in output_text(page)


def test_labels_are_shown_as_text(page):
    texts = explorer(page).locator("select[data-field='class_'] option").all_inner_texts()
    assert sum("<img src=x onerror=alert(" in t for t in texts) >= 5
    assert page.locator(".vc-widget img").count() == 0
    assert page.dialogs == []


def test_control_change_repaints_and_reaches_python(page, lab):
    before = canvas_png(page)
    paints = int(dataset(page)["paintCount"])
    select(page, "site", "F4")
    want = vc.Recipe(site="F4", layer=1)
    wait_recipe(page, want)
    assert canvas_png(page) != before and int(dataset(page)["paintCount"]) > paints
    assert python_recipe(lab, want) == want

    before = canvas_png(page)
    slider = explorer(page).locator("input[data-field='layer']")
    slider.focus()
    page.keyboard.press("ArrowLeft")
    want = vc.Recipe(site="F4", layer=0)
    wait_recipe(page, want)
    assert canvas_png(page) != before
    assert python_recipe(lab, want) == want
    assert explorer(page).locator(".vc-row[data-field='layer'] output").inner_text() == "0"
    assert float(dataset(page)["lastPaintLatencyMs"]) > 0

    select(page, "site", "F3")  # heads apply at F3: the control appears
    wait_recipe(page, vc.Recipe(site="F3", layer=0))
    assert explorer(page).locator(".vc-row[data-field='heads']").is_visible()


def test_refused_combination_is_a_message_not_a_traceback(page, lab):
    select(page, "site", "F3")
    select(page, "weighting", "eigencam")
    want = vc.Recipe(site="F3", layer=0, weighting="eigencam")
    wait_recipe(page, want)
    select(page, "heads", "max")
    page.wait_for_function("() => document.querySelector('.vc-explorer').dataset.error === 'true'", timeout=30_000)
    box = explorer(page).locator(".vc-error")
    assert box.is_visible() and "eigencam" in box.inner_text() and "heads" in box.inner_text()
    assert "Traceback" not in output_text(page)
    assert python_recipe(lab, want) == want  # the kernel keeps the last valid recipe
    # ... and so do the controls: the heads control is back at the shown recipe's value
    assert explorer(page).locator("select[data-field='heads']").input_value() == json.dumps("channels")
    select(page, "heads", "channels")
    page.wait_for_function("() => document.querySelector('.vc-explorer').dataset.error === 'false'", timeout=30_000)
    assert box.is_hidden()


def test_python_sets_the_recipe_and_the_page_follows(page, cells):
    before = canvas_png(page)
    run_cell(page, cells["set_recipe"])
    want = vc.Recipe(site="F6", layer=0)
    wait_recipe(page, want)
    assert explorer(page).locator("select[data-field='site']").input_value() == json.dumps("F6")
    assert explorer(page).locator("select[data-field='weighting']").input_value() == json.dumps("gradcam")
    assert explorer(page).locator(".vc-recipe-id").inner_text() == want.id
    assert canvas_png(page) != before


def test_stale_answers_are_never_painted(page, lab, cells):
    run_cell(page, cells["sleep"])  # the kernel is busy: both requests queue behind the sleep
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='busy']", timeout=10_000)
    dropped = int(dataset(page).get("staleDropped", "0"))
    select(page, "site", "F1")
    page.wait_for_timeout(200)  # longer than the debounce: two separate requests
    select(page, "site", "F5")
    want = vc.Recipe(site="F5", layer=0)
    wait_recipe(page, want, timeout_ms=30_000)
    page.wait_for_timeout(300)
    data = dataset(page)
    assert int(data["staleDropped"]) == dropped + 1  # the F1 answer arrived after F5 was asked for
    assert data["recipeId"] == want.id and data["requestId"] == data["lastPaintRequest"]
    assert explorer(page).locator("select[data-field='site']").input_value() == json.dumps("F5")
    assert python_recipe(lab, want) == want


def test_degenerate_variant_shows_a_notice(page):
    notice = explorer(page).locator(".vc-degenerate")
    assert notice.is_hidden()
    slider = explorer(page).locator("input[data-field='layer']")
    slider.focus()
    page.keyboard.press("End")  # the last block: with CLS pooling its patch tokens get no gradient at F5
    wait_recipe(page, vc.Recipe(site="F5", layer=2))
    assert notice.is_visible() and "Degenerate variant" in notice.inner_text() and "zero" in notice.inner_text()
    assert notice.locator(".vc-cause").inner_text() == "zero gradient"
    assert dataset(page)["degenerate"] == "true"


def test_a_slider_step_is_sent_at_once_and_steps_while_it_is_in_flight_wait(page):
    # Steps made in one task and read back after the page's microtasks, so no timing is involved: an idle page
    # sends a step at the end of the task (no 30 ms debounce); a step made while that request is unanswered
    # waits for the debounce, and only the last such step is sent.
    page.wait_for_function("() => document.querySelector('.vc-explorer').dataset.state === 'ready'")
    page.wait_for_timeout(100)  # longer than the debounce since the last send
    before, first, second = explorer(page).evaluate("""async (root) => {
      const slider = root.querySelector("input[data-field='layer']");
      const step = (v) => { slider.value = String(v); slider.dispatchEvent(new Event("input", { bubbles: true })); };
      const settle = async () => { for (let i = 0; i < 3; i++) await Promise.resolve(); };
      const before = Number(root.dataset.requestId || 0);
      step(0);
      await settle();
      const first = Number(root.dataset.requestId);
      step(1);
      step(2);
      await settle();
      return [before, first, Number(root.dataset.requestId)];
    }""")
    assert first == before + 1 and second == first
    page.wait_for_function("() => { const r = document.querySelector('.vc-explorer');"
                           " return r.dataset.state === 'ready' && r.dataset.lastPaintRequest === r.dataset.requestId"
                           " && r.querySelector(\"input[data-field='layer']\").value === '2'; }", timeout=30_000)
    assert int(dataset(page)["requestId"]) == first + 1  # the two steps in flight travelled as one request


def test_gallery_click_opens_an_explorer(page):
    cell = page.locator(".vc-gallery button.vc-cell[data-row='1'][data-col='2']")
    want = vc.Recipe(layer=1, site="F4")
    assert cell.get_attribute("data-recipe-id") == want.id
    cell.click()
    page.wait_for_function(
        "(id) => [...document.querySelectorAll('.vc-explorer')].some((e) => e.dataset.recipeId === id"
        " && e.dataset.ready === 'true' && e !== document.querySelector('.vc-explorer'))",
        arg=want.id, timeout=30_000)
    # the kernel's "active" change and the new explorer's first paint travel as separate messages, in either order:
    # the cell is marked once its message arrives
    page.wait_for_function(
        "() => document.querySelector(\".vc-gallery button.vc-cell[data-row='1'][data-col='2']\")"
        ".classList.contains('vc-active')", timeout=30_000)
    assert "vc-active" in (cell.get_attribute("class") or "")


def test_compare_highlights_the_differing_fields(page):
    cmp = page.locator(".vc-compare")
    assert cmp.locator("tr.vc-diff").evaluate_all("(rows) => rows.map((r) => r.dataset.field)") == ["site"]
    assert -1 <= float(cmp.get_attribute("data-spearman")) <= 1
    ids = cmp.locator(".vc-recipe-id").all_inner_texts()
    assert ids == [vc.Recipe(layer=1).id, vc.Recipe(site="F2", layer=1).id]


def test_notebook7_renders_and_round_trips(lab, browser):
    reason = notebook7_missing_reason()
    if reason:
        pytest.skip(reason)
    page = new_page(browser)
    try:
        open_notebook(page, lab, "notebook7.ipynb", app="notebook")
        run_cell(page, 0)
        page.wait_for_selector(".vc-explorer[data-ready='true']", timeout=90_000)
        wait_recipe(page, vc.Recipe(layer=1))
        before = canvas_png(page)
        select(page, "site", "F4")
        want = vc.Recipe(site="F4", layer=1)
        wait_recipe(page, want)
        assert canvas_png(page) != before
        log = lab.root / "recipes-nb7.jsonl"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (log.exists() and want.to_json() in log.read_text()):
            time.sleep(0.1)
        assert vc.Recipe.from_json(log.read_text().split()[-1]) == want
        assert page.dialogs == []
    finally:
        page.close()


STORE_RECIPE = vc.Recipe(site="F1", layer=0)  # the recipe of the store notebook's Explorer (conftest.py)


def store_frames(lab) -> list[dict]:
    """Every frame the store notebook's Explorer showed, as its kernel logged them (oldest first)."""
    log = lab.root / "store-frames.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def wait_store_frame(lab, index: int, after: int, timeout_s: float = 30.0) -> dict:
    """The first frame logged after the first ``after`` ones that shows image ``index``."""
    deadline = time.monotonic() + timeout_s
    while True:
        frames = store_frames(lab)
        for frame in frames[after:]:
            if frame["index"] == index:
                return frame
        if time.monotonic() > deadline:
            raise AssertionError(f"the kernel never showed image {index}; frames logged: {frames}")
        time.sleep(0.1)


def wait_repainted(page, paints: int, settle_ms: int = 500, timeout_s: float = 30.0) -> int:
    """Wait until the Explorer has painted since it had ``paints`` paints, is ready, and has not painted again
    for ``settle_ms`` (a switch of image paints the new image, then its map: two messages from the kernel)."""
    deadline = time.monotonic() + timeout_s
    last, since = None, 0.0
    while time.monotonic() < deadline:
        data = dataset(page)
        count = int(data["paintCount"])
        if count > paints and data.get("state") == "ready":
            if count != last:
                last, since = count, time.monotonic()
            elif time.monotonic() - since >= settle_ms / 1000:
                return count
        page.wait_for_timeout(50)
    raise AssertionError(f"the Explorer did not repaint and settle: {dataset(page)}")


def store_reference(lab, index: int) -> tuple[str, int]:
    """Computed here, from the store the kernel wrote: the sha256 of the float32 token-grid map of
    ``vc.cam(vc.image_trace(ds, index), STORE_RECIPE, grid=True)``, and the image's top-1 class."""
    ds = vc.open_traces(lab.root / "store.zarr")
    tr = vc.image_trace(ds, index)
    grid = vc.cam(tr, STORE_RECIPE, grid=True)
    sha = hashlib.sha256(np.ascontiguousarray(grid.values, dtype="<f4").tobytes()).hexdigest()
    return sha, int(tr["logits"].values.argmax())


def class_values(page) -> list[str]:
    return explorer(page).locator("select[data-field='class_'] option").evaluate_all("(o) => o.map((x) => x.value)")


def test_store_image_picker_switches_image_keeps_recipe_and_follows_python(lab, browser, store_cells):
    page = new_page(browser)
    try:
        open_notebook(page, lab, "store.ipynb", workspace="store")  # alone: not with the widgets notebook
        run_cell(page, store_cells["explorer"])
        page.wait_for_selector(".vc-explorer[data-ready='true']", timeout=90_000)
        wait_recipe(page, STORE_RECIPE)
        (sha0, top0), (sha2, top2) = store_reference(lab, 0), store_reference(lab, 2)
        assert sha0 != sha2 and top0 != top2  # the switch must change the map and rebuild the class control

        picker = explorer(page).locator("select.vc-image-picker")
        assert picker.get_attribute("aria-label") == "image"
        assert picker.locator("option").evaluate_all("(o) => o.map((x) => x.value)") == ["0", "1", "2"]
        assert picker.locator("option").all_inner_texts() == ["image 0", "image 1", "image 2"]
        assert picker.input_value() == "0"
        first = store_frames(lab)[-1]
        assert (first["index"], first["recipe_id"], first["map_sha256"]) == (0, STORE_RECIPE.id, sha0)
        assert class_values(page) == [json.dumps("top1"), json.dumps(top0)]
        initial = canvas_png(page)

        # The page picks image 2: the kernel shows image 2's map of the same recipe, and the page repaints.
        n, paints = len(store_frames(lab)), int(dataset(page)["paintCount"])
        picker.select_option("2")
        shown = wait_store_frame(lab, 2, after=n)
        wait_repainted(page, paints)
        assert shown["error"] == "" and shown["recipe_id"] == STORE_RECIPE.id
        assert shown["map_sha256"] == sha2
        assert store_frames(lab)[-1] == shown  # nothing shown after it
        data = dataset(page)
        assert data["recipeId"] == STORE_RECIPE.id and data["error"] == "false" and data["state"] == "ready"
        assert picker.input_value() == "2"
        assert explorer(page).locator(".vc-status").inner_text() == ""  # "loading image…" is gone
        assert canvas_png(page) != initial
        assert class_values(page) == [json.dumps("top1"), json.dumps(top2)]  # the controls were rebuilt
        assert explorer(page).locator("select[data-field='site']").input_value() == json.dumps("F1")
        assert explorer(page).locator("input[data-field='layer']").input_value() == "0"

        # Python sets the image: the picker follows and the page paints image 0 again, as at the start.
        n, paints = len(store_frames(lab)), int(dataset(page)["paintCount"])
        run_cell(page, store_cells["set_index"])
        back = wait_store_frame(lab, 0, after=n)
        wait_repainted(page, paints)
        assert (back["error"], back["recipe_id"], back["map_sha256"]) == ("", STORE_RECIPE.id, sha0)
        assert store_frames(lab)[-1] == back
        assert picker.input_value() == "0"
        assert dataset(page)["recipeId"] == STORE_RECIPE.id
        assert canvas_png(page) == initial
        assert class_values(page) == [json.dumps("top1"), json.dumps(top0)]
        assert "Traceback" not in output_text(page)
        assert page.dialogs == []
    finally:
        page.close()
