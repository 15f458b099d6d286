"""Reliability IV battery, findings M8, M9, M4 and M2: arguments of the face functions refused or named before any
work, as the functions beside them do.

- M8: ``export_html``'s ``axes`` is checked with the shared ``check_space`` (a typo was silently left out).
- M9: a destination folder that cannot be written is refused before the page is computed (was a bare
  PermissionError after it).
- M4: ``shapley_agreement`` of a plain NumPy map names the image check it could not make.
- M2: ``Recipe.canonical_id`` on a map store refuses what ``vc.cam`` refuses on it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb import evaluate as ev
from vitcam_nb.models import sample_image
from vitcam_nb.widgets import standalone

MODEL = vc.load_model("shapes-vit")
IMAGE = sample_image("shapes", 1)
OTHER = sample_image("shapes", 2)
TR = vc.trace(MODEL, IMAGE, targets="top1")
SMALL = {"site": ["F1"], "layer": [-1], "weighting": ["gradcam"], "target": ["logit"], "class_": ["top1"]}


def _cam(trace, recipe: Recipe):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vc.cam(trace, recipe)


def _no_page(*args, **kwargs):
    raise AssertionError("the page was computed before the argument was refused")


def test_export_html_refuses_a_typo_in_axes_before_any_map(tmp_path, monkeypatch):
    path = tmp_path / "p.html"
    with monkeypatch.context() as m:
        m.setattr(standalone, "_page", _no_page)
        with pytest.raises(vc.RecipeError, match=r"^axes: site 'f4' is not a value of the field; did you mean 'F4'"):
            vc.export_html(TR, path, Recipe(), axes={"site": ["F1", "f4"]}, progress=False)
        with pytest.raises(vc.RecipeError, match=r"^axes: weighting 'layercm'"):
            vc.export_html(TR, path, axes={"weighting": ["gradcam", "layercm"]}, progress=False)
    assert not path.exists()
    # Valid axes (and "all" for a default axis) still make a page.
    vc.export_html(TR, path, axes={**SMALL, "layer": "all"}, progress=False)
    assert path.read_text(encoding="utf-8").startswith("<!doctype html>")


def test_export_html_refuses_a_folder_it_cannot_write_before_computing(monkeypatch):
    # /sys is read-only for every user, root too; the old code computed the page, then raised PermissionError.
    assert Path("/sys").is_dir() and not os.access("/sys", os.W_OK) or os.geteuid() == 0
    monkeypatch.setattr(standalone, "_page", _no_page)
    with pytest.raises(vc.TraceFileError, match=r"^path: cannot write /sys/x\.html: folder /sys cannot be written"):
        vc.export_html(TR, "/sys/x.html", Recipe(), axes=SMALL, progress=False)


def test_export_html_writable_folder_is_left_clean(tmp_path):
    path = tmp_path / "p.html"
    vc.export_html(TR, path, axes=SMALL, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.html"]  # the probe file is removed


def test_shapley_agreement_of_a_plain_array_names_the_image_it_could_not_check():
    phi = ev.shapley_patches(MODEL, TR, grid=(2, 4), progress=False)
    other_map = np.asarray(_cam(vc.trace(MODEL, OTHER, targets="top1"), Recipe(site="F4", layer=3)).values)
    with pytest.warns(ev.MetricWarning, match="not checked that the map and the values are of one input"):
        got = ev.shapley_agreement(other_map, phi)
    assert "the map's image" in got.attrs["unchecked"]
    # With the trace the values' hash is compared with it: checked, nothing unchecked, no warning.
    own_map = np.asarray(_cam(TR, Recipe(site="F4", layer=3)).values)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ev.shapley_agreement(own_map, phi, trace=TR).attrs["unchecked"] == ""
        assert ev.shapley_agreement(_cam(TR, Recipe(site="F4", layer=3)), phi).attrs["unchecked"] == ""


def test_canonical_id_on_a_map_store_refuses_what_cam_refuses(tmp_path):
    path = tmp_path / "m.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vc.map_many(MODEL, [IMAGE, OTHER], [Recipe(), Recipe(site="F4")], path, progress=False)
    ds = vc.open_maps(path)
    for store in (ds, vc.image_maps(ds, 0)):
        with pytest.raises(vc.RecipeError) as by_cam:
            vc.cam(store, Recipe(site="F5"))
        with pytest.raises(vc.RecipeError) as by_id:
            Recipe(site="F5").canonical_id(store)
        assert str(by_id.value) == str(by_cam.value)
        assert "is not in this map store" in str(by_id.value)
        # A stored recipe has the id it has on a trace of the image (the whole store: on every image, when they
        # rank one class first; else its top1 is one class per image and keeps its spelling).
        firsts = {int(np.argmax(row)) for row in np.atleast_2d(store["logits"].values)}
        expected = Recipe(site="F4", layer=-1).canonical_id(TR) if len(firsts) == 1 else Recipe(site="F4", layer=5).id
        assert Recipe(site="F4", layer=-1).canonical_id(store) == expected
