"""The exported Explorer's data (vitcam_nb/widgets/bundle.py, standalone.py) and the ``vitcam-nb export``
command: every stored map and text is what vc.cam and the recipe's report give, within the stated quantisation."""

from __future__ import annotations

import base64
import itertools
import json
import zlib

import numpy as np
import pytest
import timm

import vitcam_nb as vc
from vitcam_nb.cli import main
from vitcam_nb.widgets.bundle import build_bundle, quantize_grids

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.DegenerateMapWarning")

AXES = {"site": ["F1", "F4"], "weighting": ["gradcam", "layercam"], "target": ["logit", "prob"]}


@pytest.fixture(scope="module")
def tr():
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)
    return vc.trace(m.eval(), image, targets="top2")


def unpack(bundle):
    maps = zlib.decompress(base64.b64decode(bundle.maps))
    texts = json.loads(zlib.decompress(base64.b64decode(bundle.texts)))
    return maps, texts


@pytest.mark.parametrize("quantize, tol", [("float32", 0.0), ("float16", 1e-3), ("uint8", 0.5 / 255)])
def test_every_entry_is_the_recipe_vc_cam_gives(tr, quantize, tol):
    bundle = build_bundle(tr, vc.Recipe(layer=1), axes=AXES, quantize=quantize, progress=False)
    maps, texts = unpack(bundle)
    meta = bundle.meta
    names = [n for n, _ in meta["axes"]]
    assert names == ["site", "layer", "weighting", "target", "class_"]
    assert dict(meta["axes"])["layer"] == [0, 1] and dict(meta["axes"])["class_"] == ["top1", "top2"]
    combos = list(itertools.product(*(v for _, v in meta["axes"])))
    assert meta["count"] == len(texts) == len(combos) == 2 * 2 * 2 * 2 * 2
    n = 16  # 4 x 4 grid
    start = meta["image_bytes"] + meta["ranges_bytes"]
    assert maps[:meta["image_bytes"]] == np.concatenate(
        [tr["image"].values, np.full((32, 32, 1), 255, np.uint8)], axis=-1).tobytes()
    for combo, entry in zip(combos, texts):
        recipe = vc.Recipe(**dict(zip(names, combo)))
        want = vc.cam(tr, recipe, grid=True).values
        assert entry["id"] == recipe.id and vc.Recipe.from_json(entry["r"]) == recipe
        assert entry["m"] == recipe.describe(tr)
        assert entry["c"] == json.loads(recipe.checklist(tr).to_json())
        g = entry["g"]
        if quantize == "uint8":
            lo, hi = np.frombuffer(maps[meta["image_bytes"]:start], "<f4").reshape(-1, 2)[g]
            got = lo + np.frombuffer(maps[start + n * g:start + n * (g + 1)], np.uint8) * (hi - lo) / 255
            scale = hi - lo
        else:
            size = 4 if quantize == "float32" else 2
            got = np.frombuffer(maps[start + size * n * g:start + size * n * (g + 1)], f"<f{size}")
            scale = 1.0
        np.testing.assert_allclose(got.reshape(4, 4), want, rtol=tol, atol=tol * scale + 1e-7)


def test_quantize_uint8_spans_each_maps_range():
    grids = np.stack([np.linspace(-1, 3, 6, dtype=np.float32).reshape(2, 3), np.zeros((2, 3), np.float32)])
    codes, ranges = quantize_grids(grids, "uint8")
    assert ranges.tolist() == [[-1.0, 3.0], [0.0, 0.0]]
    assert list(codes[:6]) == [0, 51, 102, 153, 204, 255] and list(codes[6:]) == [0] * 6
    with pytest.raises(ValueError, match="quantize"):
        quantize_grids(grids, "int4")


def test_refusals_name_the_argument(tr, tmp_path, capsys):
    with pytest.raises(ValueError, match="axes: 'colour' is not a recipe field"):
        build_bundle(tr, axes={"colour": ["red"]}, progress=False)
    with pytest.raises(ValueError, match="axes: 'site' needs a non-empty list"):
        build_bundle(tr, axes={"site": "F1"}, progress=False)
    with pytest.raises(ValueError, match="max_mb"):
        vc.export_html(tr, tmp_path / "big.html", axes=AXES, max_mb=0.001, progress=False)
    assert not (tmp_path / "big.html").exists()


def test_export_prints_the_size_and_narrow_axes_shrink_the_file(tr, tmp_path, capsys):
    wide = vc.export_html(tr, tmp_path / "wide.html", quantize="float32", progress=False)
    line = capsys.readouterr().out
    assert line.startswith("wide.html: ") and f"{wide.stat().st_size / 1e6:.2f} MB" in line
    narrow = vc.export_html(tr, tmp_path / "narrow.html", axes={"site": ["F1"], "layer": [-1]}, progress=False)
    assert narrow.stat().st_size < wide.stat().st_size / 2  # the page code and image are a fixed ~50 kB
    html = wide.read_text()
    assert "http://" not in html and "https://" not in html and "<script src" not in html
    assert "Content-Security-Policy" in html


def test_cli_export_writes_the_page(tr, tmp_path, capsys):
    vc.save(tr, tmp_path / "t.nc")
    out = tmp_path / "e.html"
    assert main(["export", str(tmp_path / "t.nc"), "--out", str(out), "--axes", "site=F1,F4",
                 "--axes", "weighting=gradcam", "--quiet"]) == 0
    assert out.stat().st_size > 0 and "e.html:" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "t.nc"), "--out", str(out), "--axes", "site"]) == 2
    assert "--axes" in capsys.readouterr().err
