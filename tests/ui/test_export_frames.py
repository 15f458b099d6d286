"""Real-browser test of the exported Explorer of a video trace (issue #37 item 3): Debian's headless Chromium opens
the page from ``file://`` offline; moving its frame slider shows frame f of the clip under exactly
``vc.cam(trace, recipe).values[f]`` (float32 export: the grid the page holds is equal), coloured on the whole
clip's range (the canvas pixel of each map cell is the gray colour table's entry of ``(v - lo) / (hi - lo)``, lo and
hi the clip's min and max); a recipe change keeps the frame; a frame outside the clip is refused in the page and
the frame shown stays; the kernel Explorer's page (explorer.js on its synced traits) paints the same pixels at a
frame. Run: ``python -m pytest tests/ui/test_export_frames.py -q``.
"""

from __future__ import annotations

import base64
import functools
import json

import numpy as np
import pytest
import torch
from lab_harness import required_chromium

import vitcam_nb as vc
from vitcam_nb.widgets import Explorer
from vitcam_nb.widgets.assets import css, esm

pytestmark = pytest.mark.browser
transformers = pytest.importorskip("transformers")

FRAMES, SIDE, SCALE = 4, 16, 4  # the page starts 64 px wide: each map cell is a SCALE x SCALE block of pixels
AXES = {"site": ["F1", "F4"], "weighting": ["gradcam", "layercam"], "target": ["logit"], "class_": ["top1"],
        "layer": [1]}


@functools.cache
def video_trace():
    torch.manual_seed(0)
    cfg = transformers.VideoMAEConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=32, image_size=SIDE, patch_size=8, num_frames=FRAMES,
                                      tubelet_size=2, num_labels=3)
    model = transformers.VideoMAEForVideoClassification(cfg).eval()
    clip = torch.randn((FRAMES, 3, SIDE, SIDE), generator=torch.Generator().manual_seed(0))
    return vc.trace(model, clip, targets="top1")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    path = vc.export_html(video_trace(), tmp_path_factory.mktemp("frames") / "video.html", vc.Recipe(layer=1),
                          axes=AXES, quantize="float32", colormap="gray", opacity=1.0, size=SIDE * SCALE,
                          progress=False)
    for browser in required_chromium():
        context = browser.new_context(offline=True, bypass_csp=True)
        tab = context.new_page()
        tab.goto(path.as_uri())
        tab.wait_for_function("document.body.dataset.loaded === 'true'", timeout=30_000)
        yield tab
        context.close()


def grid(tab) -> np.ndarray:
    data, shape = tab.evaluate("() => { const m = window.vitcamExplorer; const b = m.get('grid');"
                               " return [btoa(String.fromCharCode(...b)), m.get('grid_shape')]; }")
    return np.frombuffer(base64.b64decode(data), "<f4").reshape(shape)


def pixels(tab) -> np.ndarray:
    data, h, w = tab.locator("canvas.vc-canvas").evaluate(
        "(c) => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let s = '';"
        " for (let i = 0; i < d.length; i += 8192) s += String.fromCharCode(...d.subarray(i, i + 8192));"
        " return [btoa(s), c.height, c.width]; }")
    return np.frombuffer(base64.b64decode(data), np.uint8).reshape(h, w, 4)


def slide(tab, f) -> None:
    tab.locator("input[data-field='frame']").evaluate(
        "(s, f) => { s.value = String(f); s.dispatchEvent(new Event('input')); }", f)
    tab.wait_for_function("(f) => { const r = document.querySelector('.vc-explorer');"
                          " return r.dataset.frameShown === String(f) && r.dataset.state === 'ready'; }",
                          arg=f, timeout=10_000)


def gray(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """The page's colour of each value on the gray table (Math.round: half up), NumPy's own arithmetic."""
    return np.clip(np.floor((values.astype(np.float64) - lo) * (255 / (hi - lo)) + 0.5), 0, 255).astype(np.uint8)


def test_the_frame_slider_shows_each_frame_of_vc_cam_exactly_on_the_clips_scale(page):
    tr = video_trace()
    row = page.locator(".vc-frame")
    assert row.locator("label").inner_text() == "frame"
    assert page.locator(".vc-frame-readout").inner_text() == f"0 of {FRAMES} (0–{FRAMES - 1})"
    recipe = vc.Recipe(layer=1)
    full = vc.cam(tr, recipe).values
    lo, hi = float(full.min()), float(full.max())
    for f in (2, 0, 3, 1):
        slide(page, f)
        assert page.locator(".vc-frame-readout").inner_text() == f"{f} of {FRAMES} (0–{FRAMES - 1})"
        assert page.locator(".vc-recipe-id").inner_text() == recipe.id
        np.testing.assert_array_equal(grid(page), full[f])
        shown = pixels(page)
        assert shown.shape == (SIDE * SCALE, SIDE * SCALE, 4)
        cells = shown[::SCALE, ::SCALE, :3]  # opacity 1: the map's colour alone
        want = gray(full[f], lo, hi)
        for c in range(3):
            np.testing.assert_array_equal(cells[..., c], want, err_msg=f"frame {f}")
    frame_max = [float(full[f].max()) for f in range(FRAMES)]
    assert min(frame_max) < hi  # a frame below the clip's top is not stretched to white
    assert pixels(page)[..., 0].max() == gray(np.array([frame_max[1]]), lo, hi)[0]


def test_a_recipe_change_keeps_the_frame_and_a_frame_outside_the_clip_is_refused(page):
    tr = video_trace()
    slide(page, 3)
    page.locator("select[data-field='site']").select_option(value='"F4"')
    want = vc.Recipe(layer=1, site="F4")
    page.wait_for_function("(id) => document.querySelector('.vc-explorer').dataset.recipeId === id", arg=want.id)
    np.testing.assert_array_equal(grid(page), vc.cam(tr, want).values[3])
    before = grid(page)
    page.evaluate("() => { const m = window.vitcamExplorer; m.set('frame_request', {id: 99, index: 7});"
                  " m.save_changes(); }")
    page.wait_for_function("() => document.querySelector('.vc-explorer').dataset.state === 'error'")
    assert "IndexError: frame: expected an int in [0, 3] (the clip has 4 frames), got 7" in \
        page.locator(".vc-error").inner_text()
    assert page.locator(".vc-explorer").evaluate("(r) => r.dataset.frameShown") == "3"
    assert page.locator("input[data-field='frame']").input_value() == "3"
    np.testing.assert_array_equal(grid(page), before)


def kernel_page(path, ex) -> None:
    """explorer.js rendered from the traits a kernel Explorer syncs to the browser (binary traits as bytes)."""
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
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><style>{css()}</style></head><body>"
                    f"<div id='app'></div><script type='application/json' id='state'>"
                    f"{json.dumps(plain).replace('<', chr(92) + 'u003c')}</script>"
                    f"<script type='application/json' id='binary'>{json.dumps(binary)}</script>"
                    f"<script type='module'>{code}</script></body></html>")


def test_the_kernel_explorers_frame_paints_the_exported_pages_pixels(page, tmp_path):
    recipe = vc.Recipe(layer=1, site="F4", weighting="layercam")
    ex = Explorer(video_trace(), recipe, frame_index=2, colormap="gray", opacity=1.0, size=SIDE * SCALE)
    kernel_page(tmp_path / "kernel.html", ex)
    slide(page, 2)
    if page.locator(".vc-recipe-id").inner_text() != recipe.id:
        page.locator("select[data-field='site']").select_option(value='"F4"')
        page.locator("select[data-field='weighting']").select_option(value='"layercam"')
    page.wait_for_function("(id) => document.querySelector('.vc-explorer').dataset.recipeId === id", arg=recipe.id)
    kernel = page.context.new_page()
    try:
        kernel.goto((tmp_path / "kernel.html").as_uri())
        kernel.wait_for_function("document.body.dataset.loaded === 'true'", timeout=30_000)
        assert kernel.locator(".vc-explorer").evaluate("(r) => r.dataset.frameShown") == "2"
        assert kernel.locator(".vc-frame-readout").inner_text() == f"2 of {FRAMES} (0–{FRAMES - 1})"
        np.testing.assert_array_equal(pixels(kernel), pixels(page))
    finally:
        kernel.close()
