"""Real-browser tests of the exported Explorer (``vc.export_html``): Debian's headless Chromium opens the file
from ``file://`` in an offline context whose every non-file request is recorded and aborted.

Checks: the page renders with no request leaving it; every control changes the canvas; the recipe id shown is
Python's for the same choices; the canvas pixels equal those of the kernel Explorer's page for five recipes
(float32 export: equal; uint8: within one colour step). The kernel side is explorer.js rendered from the
traits a Python ``Explorer(tr, recipe)`` syncs to the browser (the Lab round trip itself is covered by
test_browser.py). Run: ``python -m pytest tests/ui/test_export_html.py -q``.
"""

from __future__ import annotations

import base64
import json
import math
import re

import numpy as np
import pytest
import torch
from lab_harness import required_chromium

import vitcam_nb as vc
from vitcam_nb.widgets import Explorer
from vitcam_nb.widgets.assets import css, esm

pytestmark = pytest.mark.browser

AXES = {"site": ["F1", "F2", "F4", "F6"], "weighting": ["gradcam", "hirescam", "layercam"],
        "target": ["logit", "prob"], "upsample": ["bilinear", "nearest"]}
XSS = "<img src=x onerror=alert(1)>"


def vc_model():
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, mlp_ratio=2.0,
                              num_classes=10)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("cls_token", "pos_embed"):
                p.copy_(0.5 * noise)
            elif p.ndim >= 2:
                p.copy_(noise / math.sqrt(p[0].numel()))
            elif "norm" in name and leaf == "weight":
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)
    return model.eval()


@pytest.fixture(scope="module")
def trace():
    # The tiny ViT of tests/ui/conftest.py: O(1) logits, attention and gradients, so maps are not constant.
    x = torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(1000))
    return vc.trace(vc_model(), x, labels=[f"{XSS}#{i}" for i in range(10)], targets="top3")


@pytest.fixture(scope="module")
def files(trace, tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    start = vc.Recipe(layer=1)
    return {q: vc.export_html(trace, root / f"explorer-{q}.html", start, axes=AXES, quantize=q, progress=False)
            for q in ("float32", "uint8")}


@pytest.fixture(scope="module")
def browser():
    yield from required_chromium()


class Offline:
    """A page in an offline context; every request other than file:// is recorded and aborted."""

    def __init__(self, browser):
        self.context = browser.new_context(offline=True, viewport={"width": 1400, "height": 1000},
                                           # Playwright polls wait_for_function predicates through eval, which the
                                           # page's own CSP forbids; requests are still recorded by the route below.
                                           bypass_csp=True)
        self.requests: list[str] = []
        self.blocked: list[str] = []
        self.dialogs: list[str] = []
        self.context.on("request", lambda r: self.requests.append(r.url))
        self.context.route(re.compile(r"^(?!file:).*"), self._block)
        self.page = self.context.new_page()
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))

    def _block(self, route):
        self.blocked.append(route.request.url)
        route.abort()

    def open(self, path) -> Offline:
        self.page.goto(path.as_uri())
        self.page.wait_for_function("document.body.dataset.loaded === 'true'", timeout=30_000)
        return self

    def close(self):
        self.context.close()


@pytest.fixture
def offline(browser):
    tab = Offline(browser)
    yield tab
    tab.close()


def shown(page) -> dict:
    return page.locator(".vc-explorer").evaluate("(r) => ({ ...r.dataset })")


def pixels(page) -> np.ndarray:
    data, h, w = page.locator("canvas.vc-canvas").evaluate(
        "(c) => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let s = '';"
        " for (let i = 0; i < d.length; i += 8192) s += String.fromCharCode(...d.subarray(i, i + 8192));"
        " return [btoa(s), c.height, c.width]; }")
    return np.frombuffer(base64.b64decode(data), np.uint8).reshape(h, w, 4)


def canvas_png(page) -> str:
    return page.locator("canvas.vc-canvas").evaluate("(c) => c.toDataURL()")


def choose(page, field, value) -> None:
    if field == "layer":
        options = page.evaluate("() => window.vitcamExplorer.get('options').fields.find((f) => f.name === 'layer')")
        slider = page.locator("input[data-field='layer']")
        slider.evaluate("(s, i) => { s.value = String(i); s.dispatchEvent(new Event('input')); }",
                        options["layers"].index(value))
    else:
        page.locator(f"select[data-field='{field}']").select_option(value=json.dumps(value))


def wait_recipe(page, recipe: vc.Recipe) -> None:
    page.wait_for_function("(id) => { const r = document.querySelector('.vc-explorer');"
                           " return r.dataset.recipeId === id && r.dataset.state === 'ready'; }",
                           arg=recipe.id, timeout=10_000)


def test_page_renders_offline_and_requests_nothing(offline, files, trace):
    page = offline.open(files["float32"]).page
    data = shown(page)
    assert data["recipeId"] == vc.Recipe(layer=1).id
    assert page.locator(".vc-recipe-id").inner_text() == vc.Recipe(layer=1).id
    assert page.locator("canvas.vc-canvas").evaluate("(c) => [c.width, c.height]") == [384, 384]
    assert len(np.unique(pixels(page)[..., :3].reshape(-1, 3), axis=0)) > 50
    assert vc.Recipe(layer=1).describe(trace) == page.locator(".vc-methods").inner_text()
    assert page.locator(".vc-colorbar canvas").count() == 1
    assert "Reporting checklist" in page.inner_text("body")
    texts = page.locator("select[data-field='class_'] option").all_inner_texts()
    assert sum(XSS in t for t in texts) == 3 and page.locator("img").count() == 0 and offline.dialogs == []
    assert offline.blocked == [] and all(u.startswith("file://") for u in offline.requests)
    assert len(offline.requests) == 1  # the file itself: every script, style and datum is inline


def test_every_control_changes_the_canvas_and_shows_pythons_recipe_id(offline, files):
    page = offline.open(files["float32"]).page
    fields = vc.Recipe(layer=1).to_dict()
    steps = [("site", "F4"), ("layer", 0), ("weighting", "hirescam"), ("target", "prob"), ("class_", "top2"),
             ("upsample", "nearest"), ("site", "F2"), ("weighting", "layercam")]
    for field, value in steps:
        before = canvas_png(page)
        choose(page, field, value)
        fields[field] = value
        want = vc.Recipe(**fields)
        wait_recipe(page, want)
        assert page.locator(".vc-recipe-id").inner_text() == want.id, field
        assert vc.Recipe.from_json(page.evaluate("() => window.vitcamExplorer.get('recipe_json')")) == want
        assert canvas_png(page) != before, f"{field} = {value} did not change the canvas"
    for field, value in (("colormap", "viridis"), ("opacity", "0.9")):
        before = canvas_png(page)
        control = page.locator(f"[data-field='{field}']")
        if field == "colormap":
            control.select_option(value)
        else:
            control.evaluate("(s, v) => { s.value = v; s.dispatchEvent(new Event('input')); }", value)
        assert canvas_png(page) != before, field
    assert offline.blocked == []


FIVE = [vc.Recipe(layer=1), vc.Recipe(site="F4", layer=0, weighting="hirescam"),
        vc.Recipe(site="F6", layer=1, target="prob", class_="top2"),
        vc.Recipe(site="F2", layer=1, weighting="layercam", upsample="nearest"),
        vc.Recipe(site="F1", layer=0, weighting="layercam", target="prob", class_="top3")]


def kernel_page(tmp_path, trace, recipe) -> str:
    """explorer.js rendered from the traits a kernel Explorer syncs for ``recipe`` (binary traits as bytes)."""
    ex = Explorer(trace, recipe)
    state = {k: v for k, v in ex.get_state().items() if not k.startswith("_") and k != "layout"}
    binary = {k: base64.b64encode(bytes(v)).decode() for k, v in state.items() if isinstance(v, (bytes, memoryview))}
    plain = {k: v for k, v in state.items() if k not in binary}
    code = esm("explorer.js") + """
const plain = JSON.parse(document.getElementById("state").textContent);
const binary = JSON.parse(document.getElementById("binary").textContent);
for (const [k, v] of Object.entries(binary)) plain[k] = Uint8Array.from(atob(v), (c) => c.charCodeAt(0));
const model = { get: (k) => plain[k], set: (k, v) => { plain[k] = v; }, save_changes() {}, on() {}, off() {} };
render({ model, el: document.getElementById("app") });
document.body.dataset.loaded = "true";
"""
    path = tmp_path / f"kernel-{recipe.id}.html"
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><style>{css()}</style></head><body>"
                    f"<div id='app'></div><script type='application/json' id='state'>"
                    f"{json.dumps(plain).replace('<', chr(92) + 'u003c')}</script>"
                    f"<script type='application/json' id='binary'>{json.dumps(binary)}</script>"
                    f"<script type='module'>{code}</script></body></html>")
    return path


def go_to(page, recipe: vc.Recipe) -> None:
    for field in ("site", "layer", "weighting", "target", "class_", "upsample"):
        value = getattr(recipe, field)
        if page.evaluate("(f) => JSON.parse(window.vitcamExplorer.get('recipe_json'))[f]", field) != value:
            choose(page, field, value)
    wait_recipe(page, recipe)


@pytest.mark.parametrize("quantize", ["float32", "uint8"])
def test_canvas_pixels_equal_the_kernel_explorers(offline, browser, files, trace, tmp_path, quantize):
    page = offline.open(files[quantize]).page
    for recipe in FIVE:
        go_to(page, recipe)
        exported = pixels(page).astype(int)
        kernel = browser.new_page()
        try:
            kernel.goto(kernel_page(tmp_path, trace, recipe).as_uri())
            kernel.wait_for_function("document.body.dataset.loaded === 'true'", timeout=30_000)
            assert shown(kernel)["recipeId"] == recipe.id
            reference = pixels(kernel).astype(int)
        finally:
            kernel.close()
        assert exported.shape == reference.shape
        if quantize == "float32":
            np.testing.assert_array_equal(exported, reference, err_msg=recipe.id)
        else:  # 1/255 of the map's range: at most one step of the colour table, on few pixels
            diff = np.abs(exported - reference)
            assert diff.max() <= 8 and diff.mean() < 0.5, (recipe.id, diff.max(), diff.mean())
