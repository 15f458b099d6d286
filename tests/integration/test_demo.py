"""The demo main job and its HTML report: outputs exist, every shown map has its checklist, no network
references, user strings are escaped; random weights are stated in a banner and on every figure, and every output
names the model, the weights' origin and the recipe ids."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb import htmlreport
from vitcam_nb.cli import main
from vitcam_nb.demo import demo_recipes

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
    listing = json.loads((out / "recipes.json").read_text())
    recipes = {k: v["recipe"] for k, v in listing["recipes"].items()}
    ids = re.findall(r"data-recipe-id='([0-9a-f]{12})'", html)
    assert sorted(ids) == sorted(vc.Recipe.from_dict(r).id for r in recipes.values())
    _assert_outputs_name_model_origin_and_recipes(out, tr, "shapes-vit")
    # Trained (bundled) weights: no banner, no warning line on the figures.
    assert "weights-banner" not in html.split("<style>")[1].split("</style>")[1]
    assert listing["weights_warning"] is None
    for name in ("gallery.png", "atlas.png"):
        with Image.open(out / name) as im:
            assert "Warning" not in im.text and not im.text["Title"].startswith("RANDOM")
            assert _banner_red_pixels(im) == 0, name
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


BANNER_RGB = (0xB0, 0x00, 0x20)  # the title line's fill, as the report's banner


def _banner_red_pixels(im: Image.Image) -> int:
    """Pixels of the banner's exact fill in the picture's top 60 rows (nothing else in a demo figure is that red)."""
    top = np.asarray(im.convert("RGB"))[:60]
    return int((top == BANNER_RGB).all(-1).sum())


def _assert_outputs_name_model_origin_and_recipes(out, tr, model: str) -> None:
    """Every output names the model, the weights' origin and the recipe ids (canonical: resolved on the trace)."""
    origin = tr.attrs["weights_origin"]
    assert tr.attrs["weights_origin"] and tr.attrs["model_name"]  # trace.nc: a trace holds no recipe
    listing = json.loads((out / "recipes.json").read_text())
    assert listing["model"] == model and listing["weights_origin"] == origin
    assert listing["trace_id"] == tr.attrs["trace_id"]
    num_layers = int(tr.attrs["num_layers"])
    assert list(listing["recipes"]) == list(demo_recipes(num_layers))
    for label, entry in listing["recipes"].items():
        recipe = vc.Recipe.from_dict(entry["recipe"])
        assert recipe == demo_recipes(num_layers)[label], label
        assert entry["recipe_id"] == recipe.id and entry["canonical_id"] == recipe.resolve(tr).id, label
    # The gallery varies layer and site of the default recipe: its maps' canonical ids, computed here independently.
    gallery_ids = {vc.Recipe(site=s, layer=b).id for b in range(num_layers)  # absolute blocks, as written
                   for s in ("F1", "F2", "F3", "F4", "F5", "F6")}
    atlas_ids = [e["canonical_id"] for e in listing["recipes"].values()]
    for name, want in (("gallery.png", gallery_ids), ("atlas.png", atlas_ids)):
        with Image.open(out / name) as im:
            assert im.text["Model"] == model and im.text["Weights"] == origin, name
            got = im.text["Recipes"].split()
            assert (set(got) == want) if name == "gallery.png" else (got == want), name
    html = (out / "report.html").read_text()
    assert f"Model: {model}; weights: {origin}." in html
    for entry in listing["recipes"].values():
        assert f"canonical id {entry['canonical_id']}" in html


@pytest.mark.slow
def test_a_demo_of_random_weights_says_so_in_a_banner_on_every_figure_and_in_recipes_json(tmp_path, capsys):
    image = tmp_path / "in.png"
    Image.fromarray(np.random.default_rng(2).integers(0, 255, (48, 48, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "out"
    # test_vit: timm's 6-block, 64-wide ViT at 160 px, built here with random weights (its published ones exist).
    with pytest.warns(vc.RandomWeightsWarning, match="test_vit was built with random-init weights"):
        assert main(["demo", "--model", "test_vit", "--image", str(image), "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("weights: random-init (untrained")
    tr = vc.load(out / "trace.nc")
    assert tr.attrs["weights_origin"] == "random-init"
    _assert_outputs_name_model_origin_and_recipes(out, tr, "test_vit")
    warning = "RANDOM WEIGHTS — maps show an untrained model"
    html = (out / "report.html").read_text()
    body = html.split("<body>", 1)[1]
    # The banner is the first thing on the page, above the title, styled as a banner (not the muted small print).
    assert body.lstrip().startswith(f"<div class='weights-banner' role='alert'><strong>{warning}</strong>")
    assert ".weights-banner{background:#b00020;color:#fff;font-size:1.15em" in html
    listing = json.loads((out / "recipes.json").read_text())
    assert listing["weights_origin"] == "random-init" and listing["weights_warning"] == warning
    for name in ("gallery.png", "atlas.png"):
        with Image.open(out / name) as im:
            assert im.text["Warning"] == warning and im.text["Title"].startswith(f"{warning}; "), name
            # The title line is drawn: a block of the banner's red, a 14 pt line at 80 dpi, at the top.
            assert _banner_red_pixels(im) > 20 * 300, name


def test_the_report_banner_follows_the_traces_weights_origin(tiny_trace):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        entries = [htmlreport.ReportEntry("default", vc.cam(tiny_trace, vc.Recipe()))]
    assert tiny_trace.attrs["weights_origin"] == "random-init"  # a VisionTransformer built in the test, untrained
    cases = {"random-init": htmlreport.RANDOM_WEIGHTS, "unknown": htmlreport.UNKNOWN_WEIGHTS, None: None,
             "bundled shapes-vit (file sha256 ab)": None, "pretrained x from hf-hub:timm/x (file sha256 ab)": None,
             "file w.safetensors (file sha256 ab)": None}
    for origin, banner in cases.items():
        tr = tiny_trace.copy()
        tr.attrs = {**tiny_trace.attrs, "model_name": EVIL}
        if origin is None:
            tr.attrs.pop("weights_origin")
            banner = htmlreport.UNKNOWN_WEIGHTS  # not recorded: the kit cannot tell
        else:
            tr.attrs["weights_origin"] = origin
        html = htmlreport.render(tr, entries)
        body = html.split("<body>", 1)[1]
        if banner is None:
            assert "weights-banner" not in body, origin
        else:
            assert body.lstrip().startswith(f"<div class='weights-banner' role='alert'><strong>{banner}</strong>")
            assert EVIL not in html and "&lt;img src=x onerror=alert(1)&gt;" in body.split("</div>")[0], origin
