"""Issue #34 in a real browser: the exported one-file Explorer of two traces of one image (``vc.export_html`` of
``{"cp_lrp": rel, "gradient": tr}``) switches trace with its trace picker, and after every switch, applied or
refused, the map in the page, its recipe id, methods paragraph and controls are one recipe of the trace on screen.
The trace picker and the controls are explorer.js, the same code the live Explorer runs (its kernel side is tested
in tests/unit/face/test_explorer_rules.py). Expected values are computed here with ``vc.cam`` on each trace.
Run: ``python -m pytest tests/ui/test_explorer_rules.py -q``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from lab_harness import required_chromium
from test_explorer_presets import READ_CONTROLS, assert_controls_show
from test_export_html import Offline, canvas_png, choose, vc_model

import vitcam_nb as vc
from vitcam_nb.widgets.facts import TraceFacts

pytestmark = pytest.mark.browser

AXES = {"site": ["F1", "resid_pre"], "layer": [0, 1], "weighting": ["gradcam", "cp_lrp"], "target": ["logit"]}
GRID = "() => Array.from(new Float32Array(window.vitcamExplorer.get('grid').slice().buffer))"


def cam(trace, recipe: vc.Recipe, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        return vc.cam(trace, recipe, **kwargs)


@pytest.fixture(scope="module")
def browser():
    yield from required_chromium()


def state(page) -> dict:
    root = page.locator(".vc-explorer")
    return {"data": root.evaluate("(r) => ({ ...r.dataset })"), "controls": root.evaluate(READ_CONTROLS),
            "picker": root.locator("select.vc-trace-picker").input_value(),
            "methods": root.locator(".vc-methods").inner_text(),
            "error": root.locator(".vc-error").evaluate("(e) => e.hidden ? '' : e.textContent"),
            "grid": np.asarray(page.evaluate(GRID), np.float32), "canvas": canvas_png(page)}


def assert_shows(now: dict, trace, name: str, recipe: vc.Recipe) -> None:
    """The page shows ``recipe`` on trace ``name``: its map (float32: exactly), id, methods and controls."""
    assert now["data"]["trace"] == now["picker"] == name
    assert now["data"]["recipeId"] == now["data"]["paintedRecipeId"] == recipe.id
    np.testing.assert_array_equal(now["grid"], cam(trace, recipe, grid=True).values.astype(np.float32).ravel())
    assert now["methods"] == cam(trace, recipe).attrs["methods"]
    assert_controls_show(now["controls"], recipe, TraceFacts.of(trace), name)


def switch(page, name: str, frame: str) -> None:
    page.locator("select.vc-trace-picker").select_option(value=name)
    page.wait_for_function("(f) => window.vitcamExplorer.get('frame') > f", arg=int(frame), timeout=10_000)


def test_the_exported_pages_trace_picker_keeps_the_map_the_recipe_of_the_trace_shown(browser, tmp_path):
    x = torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(1000))
    model = vc_model()
    tr = vc.trace(model, x, targets="top1", sites=["F1", "resid_pre"])
    rel = vc.trace(model, x, targets="top1", sites=["F1", "resid_pre"], rule="cp_lrp")
    preset = vc.presets.cp_lrp()
    path = vc.export_html({"cp_lrp": rel, "gradient": tr}, tmp_path / "rules.html", preset, axes=AXES,
                          quantize="float32", progress=False)
    tab = Offline(browser).open(path)
    try:
        page = tab.page
        frame = lambda: page.evaluate("() => String(window.vitcamExplorer.get('frame'))")  # noqa: E731
        first = state(page)
        assert_shows(first, rel, "cp_lrp", preset)
        assert "backward rule cp_lrp" in first["methods"]

        # The gradient trace cannot give the rule preset: refused, and the page stays at what it shows.
        switch(page, "gradient", frame())
        refused = state(page)
        assert_shows(refused, rel, "cp_lrp", preset)
        assert 'trace "gradient": weighting = "cp_lrp" is not in this file' in refused["error"]
        assert refused["canvas"] == first["canvas"]

        choose(page, "weighting", "gradcam")
        gradcam = preset.replace(weighting="gradcam")
        page.wait_for_function("(id) => document.querySelector('.vc-explorer').dataset.recipeId === id",
                               arg=gradcam.id, timeout=10_000)
        on_rule = state(page)
        assert_shows(on_rule, rel, "cp_lrp", gradcam)

        switch(page, "gradient", frame())  # the same recipe on the gradient trace: its own map and methods
        on_gradient = state(page)
        assert_shows(on_gradient, tr, "gradient", gradcam)
        assert on_gradient["error"] == "" and "backward rule" not in on_gradient["methods"]
        assert not np.array_equal(on_gradient["grid"], on_rule["grid"]) and on_gradient["canvas"] != on_rule["canvas"]
        offered = page.evaluate("() => window.vitcamExplorer.get('options').fields.find((f) => f.name === "
                                "'weighting').values.map(([v]) => v)")
        assert offered == ["gradcam"]  # the gradient trace's table: its controls offer only what it holds

        switch(page, "cp_lrp", frame())
        assert_shows(state(page), rel, "cp_lrp", gradcam)
        assert tab.blocked == [] and tab.dialogs == []
    finally:
        tab.close()
