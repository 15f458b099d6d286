"""Issue 52 (Reliability IV), battery2 wave 3: the face functions refuse by name before any work.

- ``export_html``: a starting recipe whose block the model lacks (``layer=9`` of 6 blocks) opened the page on
  another recipe; a class the model lacks on the class axis (7 of 5) was accepted; a starting recipe that is not
  among the page's recipes is refused before anything is written (an explicit class the trace ranks first is the
  axis's ``"top1"``: the same map, still taken).
- ``run_figure``: ``weights=5`` (bare TypeError after the passes) and an ``out`` that cannot be made (bare
  FileNotFoundError after the passes) are refused before any pass.
- ``vc.audit.summarise``: a CSV whose field is over csv's 128 KB limit raised a bare ``csv.Error``.
"""

from __future__ import annotations

import base64
import itertools
import json
import zlib

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb.audit_figure import run_figure
from vitcam_nb.core.card_schema import PaperCardError
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, ExportError, RecipeError
from vitcam_nb.models import sample_image
from vitcam_nb.widgets import standalone
from vitcam_nb.widgets.bundle import build_bundle

MODEL = vc.load_model("shapes-vit")  # 6 blocks, 5 classes
IMAGE = sample_image("shapes", 1)
TR = vc.trace(MODEL, IMAGE, targets="top2")
SMALL = {"site": ["F1"], "weighting": ["gradcam"], "target": ["logit"]}


def _no_page(*args, **kwargs):
    raise AssertionError("the page was computed before the argument was refused")


# -- export_html -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, message", [
    ({"recipe": Recipe(layer=9)}, RecipeError, r"^recipe: layer 9 is out of range for a model with 6 blocks"),
    ({"recipe": Recipe(layer=(0, -7), layer_fusion="mean")}, RecipeError, r"^recipe: layer -7 is out of range"),
    ({"recipe": Recipe(class_=5)}, RecipeError, r"^recipe: class_ 5 is out of range for a model with 5 classes"),
    ({"axes": {**SMALL, "class_": ["top1", 7]}}, RecipeError, r"^axes: class_ 7 is out of range .* 5 classes"),
])
def test_export_html_refuses_a_block_or_class_the_model_lacks_before_any_map(tmp_path, monkeypatch, kwargs, error,
                                                                              message):
    monkeypatch.setattr(standalone, "_page", _no_page)
    with pytest.raises(error, match=message):
        vc.export_html(TR, tmp_path / "p.html", progress=False, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_export_html_refuses_a_starting_recipe_the_page_does_not_hold(tmp_path):
    with pytest.raises(ExportError, match=r"^recipe: F4@-1 .* is not among the page's recipes"):
        vc.export_html(TR, tmp_path / "p.html", Recipe(site="F4"), axes=SMALL, progress=False)
    assert list(tmp_path.iterdir()) == []


def _start(bundle) -> dict:
    """The recipe of the entry the page opens on, read back from the packed texts."""
    entries = json.loads(zlib.decompress(base64.b64decode(bundle.texts)))
    return json.loads(entries[bundle.meta["start"]]["r"])


def test_the_page_opens_on_the_recipe_asked_for():
    top1 = int(np.argmax(TR["logits"].values))
    # an explicit class the trace ranks first is the class axis's "top1": one map, so the page opens there
    bundle = build_bundle(TR, Recipe(layer=2, class_=top1), axes=SMALL, progress=False)
    names, values = zip(*bundle.meta["axes"])
    combo = dict(zip(names, list(itertools.product(*values))[bundle.meta["start"]]))
    assert combo["layer"] == 2 and combo["class_"] == "top1"
    assert _start(bundle)["layer"] == 2


# -- run_figure --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, message", [
    ({"weights": 5}, ArgumentTypeError, r"^weights: expected a file or folder path"),
    ({"out": "/proc/vcfig"}, ArgumentError, r"^out: /proc/vcfig cannot be written"),
])
def test_run_figure_refuses_weights_and_an_impossible_out_before_any_pass(tmp_path, kwargs, error, message):
    calls = []
    hook = MODEL.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(error, match=message):
            run_figure(**{"out": tmp_path / "fig", "model": "shapes-vit", "images": 1, "photo": False,
                          "progress": False, "examples": 1, **kwargs})
    finally:
        hook.remove()
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_run_figure_refuses_an_out_below_a_file(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(ArgumentError, match=r"^out: .* is a file, not a folder"):
        run_figure(out=tmp_path / "f" / "fig", model="shapes-vit", images=1, photo=False, progress=False)
    assert (tmp_path / "f").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


# -- audit.summarise ---------------------------------------------------------------------------------------------------
def test_summarise_names_a_csv_field_over_the_csv_limit(tmp_path):
    path = tmp_path / "huge.csv"
    path.write_bytes(b"title,site\n" + b"x" * 200_000 + b",F1\n")
    with pytest.raises(PaperCardError, match=r"^cards: .*huge.csv is not a CSV of cards \(field larger than"):
        vc.audit.summarise(path)
