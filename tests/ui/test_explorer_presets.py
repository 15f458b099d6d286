"""Issue #36 in real browsers: after every preset choice the Explorer's controls, the recipe id it shows and the
map on its canvas are one recipe, in both kinds of Explorer: the exported one-file page (``vc.export_html``,
opened from ``file://``) and the live anywidget Explorer in JupyterLab (the notebook of tests/ui/conftest.py).

Every preset of ``vc.presets`` is chosen in turn in one page session. What should then be shown is worked out
here in Python, independently of the page: the kernel's answer (``coerce_request`` and ``compute_grid`` on the
same trace) or the file's (the preset's recipe is in the file when the recipe of its varied fields, with the
file's start for every other field, is that very recipe). A refused preset leaves the shown recipe, its map and
the controls as they were and says why; an applied one moves all three. A degenerate map's notice names its
cause as the kernel does (``vc.cam(...).attrs["degenerate_cause"]``), and so do the Gallery's badges.
Run: ``python -m pytest tests/ui/test_explorer_presets.py -q``.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from lab_harness import required_chromium
from test_export_html import Offline, vc_model

import vitcam_nb as vc
from vitcam_nb.compute.maps import degenerate_cause
from vitcam_nb.core.presets import PRESETS
from vitcam_nb.widgets.controls import applies, coerce_request
from vitcam_nb.widgets.facts import TraceFacts
from vitcam_nb.widgets.results import compute_grid

pytestmark = pytest.mark.browser

START = vc.Recipe(layer=1)
# The control rows, read back from the page: a select's value (JSON) or the layer slider's position and readout.
READ_CONTROLS = """(root) => Object.fromEntries([...root.querySelectorAll('.vc-controls .vc-row')].map((row) => {
  const c = row.querySelector('[data-field]');
  const value = c.tagName === 'SELECT' ? JSON.parse(c.value)
    : { index: Number(c.value), readout: row.querySelector('output').textContent };
  return [row.dataset.field, { applies: row.dataset.applies === 'true', value }];
}))"""


def quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        return fn(*args)


def kernel_answer(trace, facts: TraceFacts, shown: vc.Recipe, fields: dict) -> vc.Recipe | None:
    """The recipe the kernel shows after the page asks for ``fields`` on top of ``shown``; None if refused."""
    try:
        recipe = vc.Recipe.from_dict(coerce_request({**shown.to_dict(), **fields}, list(fields), facts))
        return quiet(compute_grid, trace, recipe).recipe
    except Exception:  # noqa: BLE001 - the kernel refuses whatever raises, and says why
        return None


def file_answer(trace, facts: TraceFacts, axes: dict, fields: dict) -> vc.Recipe | None:
    """The recipe the exported file shows for the page's draft ``fields``; None if the file does not hold it."""
    draft = vc.Recipe.from_dict(coerce_request(dict(fields), [], facts)).to_dict()
    if isinstance(draft["layer"], int):
        draft["layer"] %= facts.num_layers
    if any(draft[name] not in values for name, values in axes.items()):
        return None
    start = {**START.to_dict(), "layer": START.layer % facts.num_layers}
    stored = vc.Recipe.from_dict(coerce_request({**start, **{n: draft[n] for n in axes}}, [], facts))
    if stored.to_dict() != draft:
        return None
    try:
        return quiet(compute_grid, trace, stored).recipe
    except ValueError:
        return None


def layer_text(value, num_layers: int) -> str:
    if isinstance(value, int):
        i = value % num_layers
        return f"{i} (last)" if i == num_layers - 1 else str(i)
    return "all traced layers" if value == "all" else f"layers {', '.join(map(str, value))}"


def assert_controls_show(controls: dict, recipe: vc.Recipe, facts: TraceFacts, what: str) -> None:
    """Every control row holds ``recipe``'s value, and is shown exactly where that field applies."""
    want = json.loads(recipe.to_json())
    rules = applies()
    for name, row in controls.items():
        holds = all((want[r["field"]] in r["in"]) if "in" in r else (want[r["field"]] not in r["not_in"])
                    for r in rules.get(name, []))
        assert row["applies"] == holds, (what, name)
        if name == "layer":
            assert row["value"]["readout"] == layer_text(recipe.layer, facts.num_layers), what
            if isinstance(recipe.layer, int):
                assert facts.layers[row["value"]["index"]] == recipe.layer % facts.num_layers, what
        else:
            assert row["value"] == want[name], (what, name, row["value"], want[name])
    assert set(controls) >= {"site", "layer", "weighting", "target", "class_", "relu", "layer_fusion"}


def page_state(page, root: str) -> dict:
    loc = page.locator(root).first
    data = loc.evaluate("(r) => ({ ...r.dataset })")
    return {"data": data, "controls": loc.evaluate(READ_CONTROLS),
            "id_text": loc.locator(".vc-recipe-id").inner_text(),
            "error": loc.locator(".vc-error").evaluate("(e) => e.hidden ? '' : e.textContent"),
            "canvas": loc.locator("canvas.vc-canvas").evaluate("(c) => c.toDataURL()"),
            "cause": loc.locator(".vc-degenerate").evaluate(
                "(e) => e.hidden ? null : (e.querySelector('.vc-cause') || {}).textContent")}


def check_outcome(before: dict, after: dict, shown: vc.Recipe, refused: bool, trace, facts, what: str) -> None:
    data = after["data"]
    assert data["recipeId"] == after["id_text"] == shown.id, (what, data["recipeId"], shown.id)
    assert data["paintedRecipeId"] == shown.id, what  # the canvas holds the shown recipe's map
    assert_controls_show(after["controls"], shown, facts, what)
    assert (data["error"] == "true") == refused and bool(after["error"]) == refused, (what, after["error"])
    if refused:
        assert after["canvas"] == before["canvas"], f"{what}: a refused preset changed the map"
        assert f"back at recipe {shown.id}" in after["error"]
    cause = quiet(vc.cam, trace, shown).attrs["degenerate_cause"]
    assert after["cause"] == (cause or None), (what, after["cause"], cause)


# -- the exported page ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    yield from required_chromium()


@pytest.fixture(scope="module")
def small_trace():
    x = torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(1000))
    return vc.trace(vc_model(), x, targets="top1")


def test_every_preset_in_the_exported_page_shows_one_recipe(browser, small_trace, tmp_path):
    from vitcam_nb.widgets.bundle import export_axes

    facts = TraceFacts.of(small_trace)
    path = vc.export_html(small_trace, tmp_path / "default.html", START, progress=False)  # the default axes
    axes = export_axes(facts, None)
    tab = Offline(browser).open(path)
    try:
        page = tab.page
        menu = page.evaluate("() => window.vitcamExplorer.get('options').presets")
        assert {name for name, _, _ in menu} <= set(PRESETS)
        shown, outcomes = START, {}
        for name, _, fields in menu:
            before = page_state(page, ".vc-explorer")
            page.locator("select.vc-preset-picker").select_option(value=name)
            page.wait_for_function("() => document.querySelector('.vc-explorer').dataset.state !== 'pending'")
            answer = file_answer(small_trace, facts, axes, fields)
            shown = answer or shown
            after = page_state(page, ".vc-explorer")
            check_outcome(before, after, shown, answer is None, small_trace, facts, name)
            assert vc.Recipe.from_json(page.evaluate("() => window.vitcamExplorer.get('recipe_json')")) == shown
            outcomes[name] = answer is not None
        # attention_rollout fuses all layers, which a default export does not hold (where the menu still offers it)
        assert outcomes.get("attention_rollout", False) is False and outcomes.get("gradcam") is True, outcomes
        assert tab.blocked == [] and tab.dialogs == []
    finally:
        tab.close()


def test_the_exported_pages_degenerate_notice_names_its_cause(browser, small_trace, tmp_path):
    path = vc.export_html(small_trace, tmp_path / "sites.html", START, axes={"site": ["F1", "F6"]}, progress=False)
    tab = Offline(browser).open(path)
    try:
        page = tab.page
        page.locator("select[data-field='site']").select_option(value=json.dumps("F6"))
        slider = page.locator("input[data-field='layer']")
        slider.evaluate("(s) => { s.value = '2'; s.dispatchEvent(new Event('input')); }")
        want = vc.Recipe(site="F6", layer=2)
        page.wait_for_function("(id) => document.querySelector('.vc-explorer').dataset.recipeId === id",
                               arg=want.id, timeout=10_000)
        cause = quiet(vc.cam, small_trace, want).attrs["degenerate_cause"]
        assert cause == "zero gradient"  # CLS pooling: the last block's patch tokens get no gradient
        notice = page.locator(".vc-degenerate")
        assert notice.locator(".vc-cause").inner_text() == cause and f"({cause})" in notice.inner_text()
        assert page.locator(".vc-explorer").get_attribute("data-degenerate-cause") == cause
    finally:
        tab.close()


# -- the live Explorer in JupyterLab (the notebook of conftest.py) -------------------------------------------
@pytest.fixture(scope="module")
def lab_trace():
    x = torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(1000))
    return vc.trace(vc_model(), x)  # the notebook's trace (its labels aside, which change no map)


def wait_answered(page, before: str) -> None:
    page.wait_for_function(
        "(before) => { const r = document.querySelector('.vc-explorer'); return r.dataset.requestId !== before"
        " && r.dataset.lastPaintRequest === r.dataset.requestId && r.dataset.state !== 'pending'; }",
        arg=before, timeout=30_000)


def test_every_preset_in_the_live_explorer_shows_one_recipe(page, lab, lab_trace):
    facts = TraceFacts.of(lab_trace)
    root = page.locator(".vc-explorer").first
    assert root.get_attribute("data-recipe-id") == START.id
    menu = root.evaluate("(r) => [...r.querySelectorAll('select.vc-preset-picker option')].map((o) => o.value)")
    menu = [name for name in menu if name]
    assert set(menu) == {name for name, make in PRESETS.items() if make().site in facts.sites}  # every preset
    shown, outcomes = START, {}
    for name in menu:
        fields = PRESETS[name]().to_dict()
        before = page_state(page, ".vc-explorer")
        root.locator("select.vc-preset-picker").select_option(value=name)
        wait_answered(page, before["data"].get("requestId", ""))
        answer = kernel_answer(lab_trace, facts, shown, fields)
        shown = answer or shown
        check_outcome(before, page_state(page, ".vc-explorer"), shown, answer is None, lab_trace, facts, name)
        outcomes[name] = answer is not None
    assert outcomes["grad_eclip"] is False and outcomes["gradcam"] is True, outcomes
    log = (lab.root / "recipes.jsonl").read_text().split()
    assert vc.Recipe.from_json(log[-1]) == shown  # the kernel's recipe is the one the page shows
    assert page.dialogs == []


def test_the_gallerys_badges_name_their_causes(page, lab_trace):
    g = quiet(vc.gallery, lab_trace, vc.Recipe(), ("layer", "site"))  # the notebook's Gallery
    badges = page.locator(".vc-gallery button.vc-cell").evaluate_all(
        "(cells) => cells.map((c) => [c.dataset.recipeId, (c.querySelector('.vc-badge') || {}).textContent || ''])")
    causes = {str(i): degenerate_cause(str(r))
              for i, r in zip(g["recipe_id"].values.ravel(), g["degenerate"].values.ravel())}
    assert len(badges) == len(causes) == 18
    assert {rid: text for rid, text in badges} == causes
    assert "zero gradient" in causes.values()  # the last block's F3..F6 maps
