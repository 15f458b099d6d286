"""The demo main job and its HTML report: outputs exist, every shown map has its checklist, no network
references, user strings are escaped."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb import htmlreport
from vitcam_nb.cli import main

EVIL = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def tiny_trace():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=3)
    image = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    return vc.trace(model, image, targets="top2", labels=[EVIL, "b", "c"])


def test_report_escapes_labels_and_has_a_checklist_per_map(tiny_trace):
    recipes = {EVIL: vc.Recipe(), "F4": vc.Recipe(site="F4", layer=0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        entries = [htmlreport.ReportEntry(k, vc.cam(tiny_trace, r), {"pointing game": 1.0}) for k, r in recipes.items()]
    html = htmlreport.render(tiny_trace, entries, title=EVIL, notes=[f"class {EVIL}"])
    assert EVIL not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    cards = re.findall(r"<div class='card[^']*' data-recipe-id='([0-9a-f]{12})'>(.*?)</div></div>", html, re.S)
    assert [rid for rid, _ in cards] == [r.id for r in recipes.values()]
    for _, body in cards:
        assert "<table class='checklist'>" in body
        for category in ("feature representation", "gradient target", "token handling", "aggregation",
                         "spatial reconstruction"):
            assert category in body
    assert "<script" not in html and "http://" not in html and "https://" not in html


@pytest.mark.slow
def test_demo_command_writes_all_outputs(tmp_path, capsys):
    pytest.importorskip("vitcam_nb.models")
    if "shapes-vit" not in vc.models.bundled_names():
        pytest.skip("bundled model shapes-vit is not available")
    assert main(["demo", "--out", str(tmp_path / "out"), "--quiet"]) == 0
    out = tmp_path / "out"
    for name in ("trace.nc", "gallery.png", "atlas.png", "report.html", "recipes.json"):
        assert (out / name).stat().st_size > 0, name
    tr = vc.load(out / "trace.nc")
    html = (out / "report.html").read_text()
    recipes = json.loads((out / "recipes.json").read_text())
    ids = re.findall(r"data-recipe-id='([0-9a-f]{12})'", html)
    assert sorted(ids) == sorted(vc.Recipe.from_dict(r).id for r in recipes.values())
    assert html.count("<table class='checklist'>") == len(ids)
    run = f"run on {tr.attrs['device']}, computed in {tr.attrs['compute_dtype']}, stored as {tr.attrs['dtype']}"
    assert html.count(run) == len(ids)  # every map's methods paragraph
    assert "http://" not in html and "https://" not in html
    degenerate = vc.cam(tr, vc.Recipe(site="F6", layer=-1)).attrs["degenerate"]
    assert degenerate and "degenerate" in html
    assert "vitcam-nb demo wrote:" in capsys.readouterr().out
    assert html.count("<iframe class='explorer'") == 1 and " srcdoc='&lt;!doctype html&gt;" in html


def test_demo_refuses_a_timm_model_without_an_image(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--model", "vit_tiny_patch16_224", "--quiet"]) == 2
    assert "--image" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_of_the_segmentation_model_traces_the_object_region(tmp_path, capsys):
    if "shapes-vit-seg" not in vc.models.bundled_names():
        pytest.skip("bundled model shapes-vit-seg is not available")
    assert main(["demo", "--out", str(tmp_path / "out"), "--model", "shapes-vit-seg", "--quiet"]) == 0
    tr = vc.load(tmp_path / "out" / "trace.nc")
    _img, label, mask = vc.models.sample_image("shapes", 0, with_mask=True)
    assert tr.attrs["target_kind"] == "region"
    assert [int(c) for c in tr["target_class"].values if c >= 0] == [int(label) + 1]  # class 0 is background
    net = vc.load_model("shapes-vit-seg")
    with torch.no_grad():
        out = net(vc.preprocess.prepare_input(net, _img).tensor)[0]
    region = torch.from_numpy(np.asarray(mask, np.float32))
    want = (out * region).sum(dim=(-2, -1)).numpy()  # every class's logit summed over the object's pixels
    np.testing.assert_allclose(tr["logits"].values, want, rtol=1e-4, atol=1e-3)
    assert main(["demo", "--out", str(tmp_path / "o2"), "--model", "shapes-vit-seg", "--image",
                 str(tmp_path / "out" / "gallery.png"), "--quiet"]) == 2
    assert "leave out --image" in capsys.readouterr().err
