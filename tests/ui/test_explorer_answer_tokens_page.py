"""The answer-token picker in a real browser (issue 55): the exported Explorer of a tiny LLaVA's answer trace,
opened from ``file://`` in headless Chromium. Its class control lists the answer tokens by their decoded text (a
token holding markup shows as text, nothing runs) and the sequence log-prob, no logsumexp helper; the layer slider
follows the site (the tower's 3 blocks, the LM's 2 layers, the projector's one); each choice shows Python's recipe
id for the same fields. Run: ``python -m pytest tests/ui/test_explorer_answer_tokens_page.py -q``.
"""

from __future__ import annotations

import json

import pytest
from lab_harness import required_chromium

import vitcam_nb as vc

pytest.importorskip("transformers")

from vlm_tiny import HOSTILE, LM_LAYERS, answer_trace  # noqa: E402

pytestmark = pytest.mark.browser

AXES = {"site": ["F1", "projector", "lm_resid", "lm_attn"], "layer": [0, 1, 2], "weighting": ["gradcam"],
        "target": ["logit"]}


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm") / "explorer.html"
    return vc.export_html(answer_trace(), path, vc.Recipe(site="F1", layer=1, class_=0), axes=AXES, progress=False)


@pytest.fixture(scope="module")
def browser():
    yield from required_chromium()


@pytest.fixture
def page(browser, page_file):
    context = browser.new_context(offline=True, viewport={"width": 1400, "height": 1000}, bypass_csp=True)
    tab = context.new_page()
    tab.dialogs = []
    tab.on("dialog", lambda d: (tab.dialogs.append(d.message), d.dismiss()))
    tab.goto(page_file.as_uri())
    tab.wait_for_function("document.body.dataset.loaded === 'true'", timeout=30_000)
    yield tab
    context.close()


def _slider(page) -> dict:
    return page.locator("input[data-field='layer']").evaluate(
        "(s) => ({max: s.max, value: s.value, disabled: s.disabled, readout: s.parentElement.querySelector("
        "'output').textContent})")


def _wait(page, recipe: vc.Recipe) -> None:
    page.wait_for_function("(id) => { const r = document.querySelector('.vc-explorer');"
                           " return r.dataset.recipeId === id && r.dataset.state === 'ready'; }",
                           arg=recipe.id, timeout=10_000)


def test_the_class_control_lists_the_answer_tokens_as_text(page):
    texts = page.locator("select[data-field='class_'] option").all_inner_texts()
    assert texts == ["answer token 0 · red", f"answer token 1 · {HOSTILE}", "answer token 2 · &amp; circle",
                     "sequence log-prob (sum of the answer tokens' log-probs)"]
    assert page.locator("img").count() == 0 and page.dialogs == []
    assert page.evaluate("() => window.__pwned") is None


def test_the_layer_slider_follows_the_site_and_the_page_shows_pythons_recipe(page):
    fields = vc.Recipe(site="F1", layer=1, class_=0).to_dict()
    assert _slider(page)["max"] == "2"  # the tower's blocks 0..2
    for site, layers in (("lm_resid", LM_LAYERS), ("projector", 1), ("lm_attn", LM_LAYERS)):
        page.locator("select[data-field='site']").select_option(value=json.dumps(site))
        fields.update(site=site, layer=min(fields["layer"], layers - 1))
        _wait(page, vc.Recipe(**fields))
        slider = _slider(page)
        assert slider["max"] == str(layers - 1) and slider["disabled"] == (layers < 2), site
    # on the LM, the slider's first position is LM layer 0, and class 3 is the sequence log-prob
    page.locator("input[data-field='layer']").evaluate("(s) => { s.value = '0'; s.dispatchEvent(new Event('input')); }")
    fields["layer"] = 0
    _wait(page, vc.Recipe(**fields))
    assert _slider(page)["readout"] == "0"
    page.locator("select[data-field='class_']").select_option(value="3")
    fields["class_"] = 3
    want = vc.Recipe(**fields)
    _wait(page, want)
    assert vc.Recipe.from_json(page.evaluate("() => window.vitcamExplorer.get('recipe_json')")) == want
