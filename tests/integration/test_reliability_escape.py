"""Issue #32, script injection through the checklist's markdown: every text the kit hands to a markdown
renderer (checklist table, methods paragraph, interop and ambiguity reports) escapes what came from a model, a
file or a user, so it renders as the literal text, never as a tag, link, image or emphasis; ``blocks.<l>.norm1``
renders as written. Rendered with nbconvert's renderer (mistune, what the HTML export uses) and Python-Markdown
(what mkdocs uses); the page-level checks in headless Chromium are tests/ui/test_injection.py."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import markdown
import numpy as np
import pytest
from markdown_it import MarkdownIt
from nbconvert.filters.markdown_mistune import markdown2html_mistune
from vitcam_testing import make_model

import vitcam_nb as vc
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.escape import escape_html, escape_markdown
from vitcam_nb.evaluate.ambiguity.analysis import Ambiguity
from vitcam_nb.evaluate.ambiguity.many import AmbiguityMany
from vitcam_nb.interop import Finding, Translation

IMG = '<img src=x onerror="window.__pwned=1">'
SCRIPT = "<script>window.__pwned=1</script>"
LINK = "[x](javascript:window.__pwned=1)"
IMAGE = '![x](x" onerror="window.__pwned=1)'
# Text that any markdown renderer would turn into markup if it went in raw; each must come out as itself.
HOSTILE = [IMG, SCRIPT, LINK, IMAGE, "<javascript:window.__pwned=1>", "&lt;b&gt; &amp; &#60;i&#62;",
           "*em* **strong** _em_ __strong__ ~~del~~ `code` \\*not\\*", "a | b || c", "blocks.<l>.norm1",
           "[ref]\n\n[ref]: javascript:alert(1)", "# heading", "- item", "+ item", "1. item", "2) item",
           "---", "===", "> quote", "    indented code", "<!-- comment --> x", "<div>\n\nblock html\n\n</div>",
           "snake_case __dunder__ x_ _y", "a\\\nb", "<https://example.org> www.example.org",
           "| x |\n| --- |\n| y |", "phish@attacker.com attacker.com/login x.io mailto:x@y.org xmpp:x@y.org"]
# markdown-it with linkify renders notebooks in VS Code: it links bare domains and e-mail addresses too.
LINKIFY = MarkdownIt("commonmark", {"linkify": True}).enable(["linkify", "table", "strikethrough"])
RENDERERS = {"nbconvert (mistune)": markdown2html_mistune,
             "Python-Markdown": lambda text: markdown.markdown(text, extensions=["tables"]),
             "markdown-it with linkify": LINKIFY.render}


class Parsed(HTMLParser):
    """The element names (but an attribute-less ``span``) and the text (character references decoded) of an HTML
    fragment."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.cells: list[str] = []
        self.text: list[str] = []
        self._cell: list[str] | None = None
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        if tag == "span" and not attrs:  # the escape's own: keeps MathJax off "$" and "\", shows nothing
            return
        self.tags.append(tag)
        if tag in ("td", "th"):
            self._cell = []

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.cells.append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)

    def handle_comment(self, data):
        self.tags.append("!--")


def words(text: str) -> str:
    return " ".join(text.split())


def hostile_trace(tmp_path=None):
    """A trace whose model name, tag and labels are injection attempts; with ``tmp_path``, also a saved file
    edited afterwards (preprocessing, weights origin) and loaded back: save recomputes the checksum, so load
    accepts it."""
    model = make_model("vit")
    model.pretrained_cfg = {"architecture": IMG, "tag": SCRIPT}
    tr = vc.trace(model, np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8), targets="top2",
                  labels=[f"{LINK} {IMAGE} #{i}" for i in range(10)])
    if tmp_path is None:
        return tr
    tr.attrs.update(preprocessing=f"{SCRIPT} {LINK}", weights_origin=f"bundled {IMAGE}", model_name=f"{IMG} *x*")
    path = vc.save(tr, tmp_path / "edited.nc")
    return vc.load(path)


@pytest.mark.parametrize("renderer", RENDERERS)
@pytest.mark.parametrize("text", HOSTILE)
def test_escaped_markdown_renders_as_the_literal_text(text, renderer):
    """The helper itself: each construct comes back as one paragraph of exactly its own text (whitespace
    aside, which HTML does not show), with no other element."""
    html = RENDERERS[renderer](escape_markdown(text))
    parsed = Parsed(html)
    assert set(parsed.tags) <= {"p"}, (text, html)
    assert words("".join(parsed.text)) == words(text), html


@pytest.mark.parametrize("renderer", RENDERERS)
@pytest.mark.parametrize("text", HOSTILE)
def test_an_escaped_table_cell_stays_one_cell(text, renderer):
    md = Checklist({"model and input": {"model": text, "x": "y"}}).to_markdown()
    parsed = Parsed(RENDERERS[renderer](md))
    assert set(parsed.tags) <= {"table", "thead", "tbody", "tr", "th", "td"}, md
    assert parsed.cells == ["category", "item", "value", "model and input", "model", words(text),
                            "model and input", "x", "y"]


def test_escape_html_quotes_attributes():
    assert escape_html(IMG) == "&lt;img src=x onerror=&quot;window.__pwned=1&quot;&gt;"
    assert escape_html("a'b&") == "a&#x27;b&amp;"
    assert escape_html(3) == "3"


@pytest.mark.parametrize("renderer", RENDERERS)
@pytest.mark.parametrize("edited", [False, True], ids=["hostile model", "edited file"])
def test_checklist_markdown_of_a_hostile_trace_has_no_markup_and_says_every_value(tmp_path, renderer, edited):
    tr = hostile_trace(tmp_path if edited else None)
    checklist = vc.Recipe().checklist(tr)
    md = checklist._repr_markdown_()
    assert md == checklist.to_markdown()
    for raw in ("<img", "<script", "](", "<"):
        assert raw not in md
    parsed = Parsed(RENDERERS[renderer](md))
    assert set(parsed.tags) <= {"table", "thead", "tbody", "tr", "th", "td"}
    want = ["category", "item", "value"] + [words(str(text)) for category, items in checklist.items()
                                            for item, value in items.items() for text in (category, item, value)]
    assert parsed.cells == want
    model = checklist["model and input"]["model"]
    assert model.startswith(f"{IMG} *x* ({SCRIPT})" if edited else f"{IMG} ({SCRIPT})")
    if edited:
        assert checklist["model and input"]["preprocessing"] == f"{SCRIPT} {LINK}"
        assert f"weights bundled {IMAGE}" in model


@pytest.mark.parametrize("renderer", RENDERERS)
def test_module_template_renders_as_written(renderer):
    """``blocks.<l>.norm1``: the "<l>" used to be eaten as an HTML tag ("blocks..norm1")."""
    tr = hostile_trace()
    recipe = vc.Recipe(layer=(0, 1), layer_fusion="mean")
    module = recipe.checklist(tr)["feature representation"]["module"]
    assert module == "blocks.<l>.norm1 for each block l listed"
    cells = Parsed(RENDERERS[renderer](recipe.checklist(tr).to_markdown())).cells
    assert "blocks.<l>.norm1 for each block l listed" in cells and "blocks..norm1 for each block l listed" not in cells
    methods = Parsed(RENDERERS[renderer](escape_markdown(recipe.describe(tr))))
    assert "(the output of blocks.<l>.norm1 for each block l listed)" in "".join(methods.text)


@pytest.mark.parametrize("renderer", RENDERERS)
@pytest.mark.parametrize("edited", [False, True], ids=["hostile model", "edited file"])
def test_methods_paragraph_is_plain_text_that_renders_literally_once_escaped(tmp_path, renderer, edited):
    """The paragraph a paper pastes is the plain text itself (a ``str``: it prints and is stored as is); the
    kit escapes it where it reaches HTML, and ``escape_markdown`` is what renders it as markdown."""
    tr = hostile_trace(tmp_path if edited else None)
    methods = vc.Recipe(site="F2", layer=-1, heads="mean_then_relu").describe(tr)
    assert type(methods) is str and IMG in methods
    md = escape_markdown(methods)
    assert "<img" not in md and "<script" not in md
    parsed = Parsed(RENDERERS[renderer](md))
    assert set(parsed.tags) <= {"p"} and words("".join(parsed.text)) == words(methods)


@pytest.mark.parametrize("renderer", RENDERERS)
def test_reports_render_literally(renderer):
    hostile = f"{IMG} {LINK} {IMAGE} {SCRIPT}"
    translation = Translation(None, [Finding("grid", hostile)], vc.Recipe(), "torchcam")
    stub = type("Stub", (), {"report": lambda self: hostile})()
    for obj, md in ((translation, translation._repr_markdown_()),
                    (stub, Ambiguity._repr_markdown_(stub)), (stub, AmbiguityMany._repr_markdown_(stub))):
        parsed = Parsed(RENDERERS[renderer](md))
        assert set(parsed.tags) <= {"p"}, md
        assert words("".join(parsed.text)) == words(obj.report())


def test_checklist_json_and_map_attrs_keep_the_raw_text():
    """Escaping is for rendering only: the record (JSON, map attrs) holds exactly what the trace says."""
    tr = hostile_trace()
    m = vc.cam(tr, vc.Recipe())
    assert json.loads(m.attrs["checklist"])["model and input"]["model"].startswith(f"{IMG} ({SCRIPT})")
    assert IMG in m.attrs["methods"] and "&lt;" not in m.attrs["methods"]


def test_the_explorers_copied_checklist_is_the_escaped_markdown(tmp_path):
    """What "copy checklist (markdown)" copies (the exported page's entries come from compute_grid too)."""
    from vitcam_nb.widgets import Explorer
    from vitcam_nb.widgets.results import compute_grid

    tr = hostile_trace(tmp_path)
    md = vc.Recipe().checklist(tr).to_markdown()
    assert "<img" not in md and "<script" not in md and "&lt;img src=x onerror=" in md
    assert Explorer(tr, vc.Recipe()).checklist_md == md == compute_grid(tr, vc.Recipe()).checklist_md


def test_a_class_label_with_dollar_signs_is_drawn_as_written_not_as_mathtext():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.cbook import is_math_text

    model = make_model("vit")
    tr = vc.trace(model, np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8), targets="top1",
                  labels=[f"$\\alpha$ price $5 #{i}" for i in range(10)])
    recipe = vc.Recipe()
    cls = int(tr["target_class"].values[0])
    figures = [vc.plot.overlay(tr, vc.cam(tr, recipe)), vc.plot.grid(tr, vc.gallery(tr, recipe, vary={"layer": "all"}))]
    for fig in figures:
        titles = [fig._suptitle.get_text()] if fig._suptitle else []
        titles += [ax.get_title() for ax in fig.axes]
        shown = [t for t in titles if "price" in t]
        assert shown and all(not is_math_text(t) for t in shown), titles
        assert all(f"class \\$\\alpha\\$ price \\$5 #{cls}" in t for t in shown), shown
        plt.close(fig)
