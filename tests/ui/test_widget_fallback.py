"""A widget's output read without a widget manager (nbconvert, a code-hosting page, a viewer with no kernel): every
public widget's display bundle carries, beside its live view, ``image/png`` of its view at display time and a
``text/plain`` naming what it shows. Checked on the bundle (its picture decoded and compared, pixel for pixel, with
``vc.plot.overlay`` of ``vc.cam`` for the recipe the widget shows after changes made as the page makes them), in a
notebook executed by nbclient (the stored outputs), and in nbconvert's HTML of that notebook (an ``<img>``, no
empty widget box). Run: ``python -m pytest tests/ui/test_widget_fallback.py -q``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
from pathlib import Path

import matplotlib
import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb.widgets import Compare, Explorer, Gallery, fallback

matplotlib.use("Agg")
pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.core.errors.DegenerateMapWarning")

ROOT = Path(__file__).resolve().parents[2]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def tr(model_factory, model_input):
    return vc.trace(model_factory("vit"), model_input("vit"))


def pixels(png: bytes | str) -> np.ndarray:
    """The RGBA pixels of a PNG (base64 text as stored in a notebook, or bytes)."""
    import matplotlib.image

    raw = base64.b64decode(png) if isinstance(png, str) else png
    return matplotlib.image.imread(io.BytesIO(raw), format="png")


def reference(trace, recipe: vc.Recipe, *, alpha: float = 0.5, cmap: str = "inferno") -> np.ndarray:
    """The picture the Explorer must store, drawn here from vc.cam and vc.plot.overlay (not through the widget):
    the overlay with its colour bar, its title followed by the recipe id."""
    import matplotlib.pyplot as plt

    fig = vc.plot.overlay(trace, vc.cam(trace, recipe), alpha=alpha, cmap=cmap)
    ax = fig.axes[0]
    ax.set_title(f"{ax.get_title()}\nrecipe {recipe.id}", fontsize=9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return pixels(buf.getvalue())


def data_of(widget) -> dict:
    bundle = widget._repr_mimebundle_()
    return bundle[0] if isinstance(bundle, tuple) else bundle


def send(widget, **state) -> None:
    """Deliver state as the page does: JSON over the wire, then ``set_state``."""
    widget.set_state(json.loads(json.dumps(state)))


def test_the_explorers_picture_is_its_current_view(tr):
    ex = Explorer(tr, vc.Recipe(layer=1))
    first = data_of(ex)
    assert first[WIDGET_VIEW]["model_id"] == ex.model_id
    np.testing.assert_array_equal(pixels(first["image/png"]), reference(tr, vc.Recipe(layer=1)))
    # Changes made in the page: a recipe request, then the colormap and opacity controls.
    want = vc.Recipe(site="F2", layer=0)
    send(ex, request={"id": 1, "recipe": {**ex.recipe.to_dict(), "site": "F2", "layer": 0},
                      "changed": ["site", "layer"]})
    send(ex, colormap="viridis", opacity=0.25)
    assert ex.recipe == want and ex.error == ""
    now = data_of(ex)
    shown = pixels(now["image/png"])
    np.testing.assert_array_equal(shown, reference(tr, want, alpha=0.25, cmap="viridis"))
    assert shown.shape != pixels(first["image/png"]).shape or np.abs(shown - pixels(first["image/png"])).max() > 0.1
    text = now["text/plain"]
    assert text.startswith(f"vitcam_nb Explorer: recipe {want.id} ({want.to_string()}); trace {tr.attrs['trace_id']}")
    assert vc.Recipe(layer=1).id not in text and "view when it was displayed" in text


def test_every_public_widget_stores_a_picture_and_says_what_it_is(tr):
    a, b = vc.Recipe(layer=1), vc.Recipe(site="F2", layer=1, weighting="layercam")
    cmp = Compare(tr, a, b)
    data = data_of(cmp)
    assert WIDGET_VIEW in data and pixels(data["image/png"]).ndim == 3
    assert data["text/plain"].startswith(f"vitcam_nb Compare: A {a.id} ({a.to_string()}); B {b.id}")

    g = Gallery(tr, vc.Recipe(), vary=("layer", "site"))
    data = data_of(g)
    assert WIDGET_VIEW in data and f"base recipe {vc.Recipe().id}" in data["text/plain"]
    assert "varied: layer (3), site (6)" in data["text/plain"]
    # The thumbnail grid displayed alone stores the Gallery's picture (the grid), pixel for pixel.
    grid = data_of(g.thumbnails)
    assert grid[WIDGET_VIEW]["model_id"] == g.thumbnails.model_id
    np.testing.assert_array_equal(pixels(grid["image/png"]), pixels(data["image/png"]))
    g.select(1, 2)
    assert f"open in its Explorer: {g.recipe_at(1, 2).id}" in data_of(g)["text/plain"]


def test_a_picture_that_cannot_be_drawn_keeps_the_live_view_and_says_why(tr, monkeypatch):
    ex = Explorer(tr)

    def broken():
        raise RuntimeError("no fonts here")

    monkeypatch.setattr(ex, "static", broken)
    data = data_of(ex)
    assert WIDGET_VIEW in data and "image/png" not in data
    assert data["text/plain"].endswith("No static picture: RuntimeError: no fonts here")
    monkeypatch.setattr(fallback, "STATIC_PNG", False)
    assert "image/png" not in data_of(Explorer(tr))


NOTEBOOK = [
    # The same tiny model and input as the fixtures above (tests/vitcam_testing.py): the same trace id.
    "import matplotlib\nmatplotlib.use('Agg')\nimport vitcam_nb as vc\n"
    "from vitcam_testing import make_model, make_input\n"
    "tr = vc.trace(make_model('vit'), make_input('vit'))\n"
    "ex = vc.Explorer(tr, vc.Recipe(layer=1))\nex",
    "ex.recipe = vc.Recipe(site='F2', layer=0)\nex.colormap = 'viridis'\nex",
    "vc.Gallery(tr, vc.Recipe(), vary='layer')",
]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    book = nbformat.v4.new_notebook()
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    book.cells = [nbformat.v4.new_code_cell(src) for src in NOTEBOOK]
    # The kernel imports this checkout and the test helpers; as JupyterLab saves by default, no widget state.
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
           "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cwd = tmp_path_factory.mktemp("fallback-nb")
        nbclient.NotebookClient(book, timeout=300, kernel_name="python3", store_widget_state=False,
                                resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        for key, value in old.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    return book


def displayed(cell) -> dict:
    outs = [o for o in cell.outputs if o.get("output_type") in ("display_data", "execute_result")]
    assert len(outs) == 1, cell.outputs
    return outs[0]["data"]


def test_a_notebook_stores_each_widgets_picture_of_its_state_when_shown(executed, tr):
    first, second, gallery = (displayed(c) for c in executed.cells)
    for data in (first, second, gallery):
        assert {WIDGET_VIEW, "image/png", "text/plain"} <= set(data)
    assert f"trace {tr.attrs['trace_id']}" in first["text/plain"]  # the kernel traced what the fixture traced
    np.testing.assert_array_equal(pixels(first["image/png"]), reference(tr, vc.Recipe(layer=1)))
    want = vc.Recipe(site="F2", layer=0)
    assert second["text/plain"].startswith(f"vitcam_nb Explorer: recipe {want.id}")
    np.testing.assert_array_equal(pixels(second["image/png"]), reference(tr, want, cmap="viridis"))
    assert gallery["text/plain"].startswith("vitcam_nb Gallery: base recipe")


def test_nbconvert_html_shows_the_pictures_not_an_empty_widget_box(executed):
    from nbconvert import HTMLExporter

    html, _ = HTMLExporter().from_notebook_node(executed)
    images = re.findall(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=\s]+)"', html)
    stored = [displayed(c)["image/png"] for c in executed.cells]
    assert [re.sub(r"\s", "", png) for png in images] == [re.sub(r"\s", "", png) for png in stored]
    # With no widget state, nbconvert leaves the live view out rather than an empty box awaiting a widget manager.
    assert WIDGET_VIEW not in html and "jupyter-widgets" not in html
