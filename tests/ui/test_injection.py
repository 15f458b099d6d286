"""Issue #32, script injection: every HTML- or markdown-producing output, given a trace whose model name, tag,
labels, preprocessing and weights origin are injection attempts (from the model's config, and from a saved
trace file edited afterwards, which ``vc.load`` accepts since ``vc.save`` recomputes the checksum), is opened in
headless Chromium (offline: only file:// loads). No script may run (``window.__pwned`` stays undefined, no
dialog opens, no ``<img>`` or ``javascript:`` link appears) and the hostile text must be on the page as text, so
the escaping is not a deletion.

Outputs: (1) the checklist's markdown, the interop and ambiguity reports' and the methods paragraph put through
``escape_markdown`` (it is plain text) as a notebook's display outputs, the bundles IPython's formatter makes,
exported by nbconvert's HTMLExporter; (2) the demo/CLI report (``vitcam_nb.htmlreport.render`` with its
explorer frame); (3) the exported one-file page (``vc.export_html``); (4) the Explorer widget's ES module
rendered from the traits its Python side syncs.
Run: ``python -m pytest tests/ui/test_injection.py -q``.
"""

from __future__ import annotations

import base64
import json

import nbformat
import numpy as np
import pytest
from IPython.display import Markdown
from lab_harness import required_chromium
from vitcam_testing import make_model

import vitcam_nb as vc
from vitcam_nb import htmlreport
from vitcam_nb.core.escape import escape_markdown
from vitcam_nb.evaluate.ambiguity.analysis import Ambiguity
from vitcam_nb.interop import Finding, Translation
from vitcam_nb.widgets import Explorer
from vitcam_nb.widgets.assets import css, esm
from vitcam_nb.widgets.standalone import explorer_html

pytestmark = pytest.mark.browser

IMG = '<img src=x onerror="window.__pwned=1;alert(1)">'
SCRIPT = "<script>window.__pwned=1;alert(1)</script>"
LINK = "[x](javascript:window.__pwned=1)"
IMAGE = '![x](x" onerror="window.__pwned=1)'
SVG = "<svg onload=window.__pwned=1>"
MODULE = "blocks.<l>.norm1"
AXES = {"site": ["F1", "F4"], "layer": [0, -1]}


def hostile_trace(tmp_path):
    """The model config's name and tag are hostile, and so are the labels; then the saved file is edited."""
    model = make_model("vit")
    model.pretrained_cfg = {"architecture": IMG, "tag": SCRIPT}
    tr = vc.trace(model, np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8), targets="top2",
                  labels=[f"{IMG} {LINK} #{i}" for i in range(10)])
    tr.attrs.update(preprocessing=f"{SCRIPT} {LINK} {IMAGE}", weights_origin=f"bundled {SVG}")
    return vc.load(vc.save(tr, tmp_path / "edited.nc"))


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return hostile_trace(tmp_path_factory.mktemp("trace"))


@pytest.fixture(scope="module")
def browser():
    yield from required_chromium()


class Tab:
    """A page in an offline context (non-file requests aborted) that records every dialog."""

    def __init__(self, browser):
        # bypass_csp: Playwright evaluates its predicates, which the exported page's own CSP forbids.
        self.context = browser.new_context(offline=True, bypass_csp=True)
        self.context.route(lambda url: not url.startswith("file:"), lambda route: route.abort())
        self.page = self.context.new_page()
        self.dialogs: list[str] = []
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))

    def open(self, path, ready: str | None = None):
        self.page.goto(path.as_uri())
        if ready:
            self.page.wait_for_function(ready, timeout=30_000)
        self.page.wait_for_timeout(200)  # a script or handler that failed to be escaped would have run by now
        return self.page

    def assert_nothing_ran(self):
        for frame in self.page.frames:
            assert frame.evaluate("() => typeof window.__pwned") == "undefined", frame.url
            assert frame.evaluate("() => document.querySelectorAll('script:not([src]) + img, svg[onload], "
                                  "[onerror], [onload]').length") == 0, frame.url
            links = frame.evaluate("() => [...document.querySelectorAll('a[href]')].map((a) => a.href)")
            assert not [u for u in links if u.strip().lower().startswith("javascript:")], links
        assert self.dialogs == []


@pytest.fixture
def tab(browser):
    t = Tab(browser)
    yield t
    t.context.close()


def text_of(page) -> str:
    return page.evaluate("() => document.body.textContent")


def notebook_html(tmp_path, objects) -> object:
    """A notebook whose cells display ``objects`` (outputs as a kernel sends them), exported by nbconvert."""
    from IPython.core.formatters import DisplayFormatter
    from nbconvert import HTMLExporter

    formatter = DisplayFormatter()
    cells = []
    for i, obj in enumerate(objects):
        data, metadata = formatter.format(obj)
        assert "text/markdown" in data, type(obj)
        cell = nbformat.v4.new_code_cell(f"obj_{i}", execution_count=i + 1)
        cell.outputs = [nbformat.v4.new_output("execute_result", data=data, metadata=metadata, execution_count=i + 1)]
        cells.append(cell)
    nb = nbformat.v4.new_notebook(cells=cells)
    body, _ = HTMLExporter().from_notebook_node(nb)
    path = tmp_path / "notebook.html"
    path.write_text(body, encoding="utf-8")
    return path


def test_notebook_markdown_outputs_exported_by_nbconvert_run_no_script(tab, trace, tmp_path):
    fused = vc.Recipe(layer=(0, 1), layer_fusion="mean")
    stub = Ambiguity.__new__(Ambiguity)
    stub.report = lambda: f"The description ({SCRIPT}) leaves {IMAGE} open"
    # The methods paragraph is plain text; shown as markdown, it goes through the kit's escape_markdown.
    methods = [Markdown(escape_markdown(r.describe(trace))) for r in (vc.Recipe(), fused)]
    translation = Translation(None, [Finding("grid", f"{IMG} {LINK}")], None, "torchcam")
    objects = [vc.Recipe().checklist(trace), fused.checklist(trace), *methods, translation, stub]
    page = tab.open(notebook_html(tmp_path, objects))
    tab.assert_nothing_ran()
    outputs = page.evaluate("() => [...document.querySelectorAll('.jp-RenderedMarkdown')].map((n) => n.textContent)")
    assert len(outputs) == len(objects)
    assert page.evaluate("() => document.querySelectorAll('.jp-RenderedMarkdown img, "
                         ".jp-RenderedMarkdown script, .jp-RenderedMarkdown svg').length") == 0
    checklist, fused_checklist, methods, fused_methods, translation, ambiguity = outputs
    for text in (IMG, SCRIPT, LINK, IMAGE, SVG):
        assert text in checklist, text
    assert f"{MODULE} for each block l listed" in fused_checklist and "blocks..norm1" not in fused_checklist
    assert " ".join(methods.split()) == " ".join(vc.Recipe().describe(trace).split())
    assert f"(the output of {MODULE} for each block l listed)" in fused_methods
    assert f"[grid] {IMG} {LINK}" in translation and f"({SCRIPT}) leaves {IMAGE} open" in ambiguity
    rows = page.evaluate("() => [...document.querySelectorAll('.jp-RenderedMarkdown table')[0].rows]"
                         ".map((r) => [...r.cells].map((c) => c.textContent.trim()))")
    want = [[c, i, str(v)] for c, items in vc.Recipe().checklist(trace).items() for i, v in items.items()]
    assert rows == [["category", "item", "value"]] + want


def test_demo_report_with_its_explorer_frame_runs_no_script(tab, trace, tmp_path):
    entries = [htmlreport.ReportEntry(f"{IMG} variant", vc.cam(trace, vc.Recipe()), {f"{SCRIPT} score": 0.5}),
               htmlreport.ReportEntry(LINK, vc.cam(trace, vc.Recipe(site="F4", layer=0)))]
    html = htmlreport.render(trace, entries, title=f"demo {SCRIPT}", notes=[f"Predicted class: {IMG} {LINK}"],
                             interactive=explorer_html(trace, axes=AXES, progress=False))
    path = tmp_path / "report.html"
    path.write_text(html, encoding="utf-8")
    page = tab.open(path)
    frame = next(f for f in page.frames if f is not page.main_frame)
    frame.wait_for_function("document.body.dataset.loaded === 'true'", timeout=30_000)
    tab.assert_nothing_ran()
    text = text_of(page)
    for want in (f"demo {SCRIPT}", f"Predicted class: {IMG} {LINK}", f"{IMG} variant", f"{SCRIPT} score", LINK,
                 f"{IMG} ({SCRIPT})", f"{SCRIPT} {LINK} {IMAGE}"):
        assert want in text, want
    assert page.evaluate("() => document.querySelectorAll('img:not([src^=\"data:image/png\"])').length") == 0
    options = frame.locator("select[data-field='class_'] option").all_inner_texts()
    assert any(f"{IMG} {LINK} #" in o for o in options) and frame.locator("img").count() == 0
    assert f"{IMG} ({SCRIPT})" in frame.locator(".vc-checklist").text_content()


def test_exported_page_runs_no_script(tab, trace, tmp_path):
    path = vc.export_html(trace, tmp_path / "explorer.html", axes=AXES, title=f"{SCRIPT} title", progress=False)
    page = tab.open(path, "document.body.dataset.loaded === 'true'")
    tab.assert_nothing_ran()
    assert page.locator("img").count() == 0
    assert page.title() == f"{SCRIPT} title" and page.locator("h1").inner_text() == f"{SCRIPT} title"
    assert f"model {IMG}" in page.locator(".vc-export-note").first.inner_text()
    checklist = page.locator(".vc-checklist").text_content()
    assert f"{IMG} ({SCRIPT})" in checklist and f"{SCRIPT} {LINK} {IMAGE}" in checklist and SVG in checklist
    shown = vc.Recipe.from_json(page.evaluate("() => window.vitcamExplorer.get('recipe_json')"))
    assert page.locator(".vc-methods").inner_text() == shown.describe(trace)
    assert_labels_shown(page, trace)


def assert_labels_shown(page, trace) -> None:
    """Each traced class's hostile label (top2: two classes; the expected-logit target has none) is in the
    class menu as its literal text."""
    options = page.locator("select[data-field='class_'] option").all_inner_texts()
    labels = [str(label) for c, label in zip(trace["target_class"].values, trace["target_label"].values) if c >= 0]
    assert len(labels) == 2 and all(label.startswith(f"{IMG} {LINK} #") for label in labels)
    for label in labels:
        assert any(label in o for o in options), (label, options)


def widget_page(tmp_path, widget, module: str):
    """The widget's ES module rendered from the traits its Python side syncs (binary traits as bytes)."""
    state = {k: v for k, v in widget.get_state().items() if not k.startswith("_") and k != "layout"}
    binary = {k: base64.b64encode(bytes(v)).decode() for k, v in state.items() if isinstance(v, (bytes, memoryview))}
    plain = {k: v for k, v in state.items() if k not in binary}
    code = esm(module) + """
const plain = JSON.parse(document.getElementById("state").textContent);
const binary = JSON.parse(document.getElementById("binary").textContent);
for (const [k, v] of Object.entries(binary)) plain[k] = Uint8Array.from(atob(v), (c) => c.charCodeAt(0));
const model = { get: (k) => plain[k], set: (k, v) => { plain[k] = v; }, save_changes() {}, on() {}, off() {},
                send() {} };
render({ model, el: document.getElementById("app") });
document.body.dataset.loaded = "true";
"""
    path = tmp_path / f"{module}.html"
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><style>{css()}</style></head><body>"
                    f"<div id='app'></div><script type='application/json' id='state'>"
                    f"{json.dumps(plain).replace('<', chr(92) + 'u003c')}</script>"
                    f"<script type='application/json' id='binary'>{json.dumps(binary)}</script>"
                    f"<script type='module'>{code}</script></body></html>", encoding="utf-8")
    return path


def test_explorer_widget_runs_no_script(tab, trace, tmp_path):
    """The Explorer shows the trace's checklist, methods and class labels (the Gallery and Compare widgets show
    recipe fields and ids only)."""
    page = tab.open(widget_page(tmp_path, Explorer(trace, vc.Recipe()), "explorer.js"),
                    "document.body.dataset.loaded === 'true'")
    tab.assert_nothing_ran()
    assert page.locator("img").count() == 0
    assert f"{IMG} ({SCRIPT})" in page.locator(".vc-checklist").text_content()
    assert page.locator(".vc-methods").inner_text() == vc.Recipe().describe(trace)
    assert_labels_shown(page, trace)
