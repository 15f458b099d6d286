"""``vitcam-nb demo --model shapes-video``: the video demo writes its trace, frame strips, scores and report, with the
scores recomputed here from the saved trace (NumPy formulas), and refuses what it does not use."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

import vitcam_nb as vc
from vitcam_nb.cli import main
from vitcam_nb.demo_video import VIDEO_OUTPUTS, sample_clip
from vitcam_nb.evaluate.report.known_answer_video import VIDEO_RECIPES

pytest.importorskip("transformers")


def test_the_video_demo_writes_its_outputs_and_their_scores_are_the_maps(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--model", "shapes-video", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    card = vc.models.model_card("shapes-video")
    assert f"weights: bundled shapes-video (file sha256 {card['weights_sha256']})" in printed
    for name in VIDEO_OUTPUTS:
        assert (out / name).stat().st_size > 0, name
    tr = vc.load(out / "trace.nc")
    assert tr.attrs["weights_origin"].startswith("bundled shapes-video") and tr.sizes["frame"] == 4
    _clip, label, masks, evidence = sample_clip()
    scores = json.loads((out / "scores.json").read_text())
    assert scores["evidence_frames"] == np.flatnonzero(evidence).tolist()
    assert scores["true_class"] == card["classes"][label]
    rows = {r["recipe"]: r for r in scores["rows"]}
    assert list(rows) == [*VIDEO_RECIPES, "uniform map"]
    assert rows["uniform map"]["right_frames"] == pytest.approx(0.5)
    for name, recipe in VIDEO_RECIPES.items():
        m = vc.cam(tr, recipe).values.astype(np.float64)
        assert rows[name]["recipe_id"] == recipe.id
        assert rows[name]["right_frames"] == pytest.approx(m[evidence].sum() / m.sum(), rel=1e-6)
    report = (out / "report.md").read_text()
    assert "| gradcam F1 last block | " + VIDEO_RECIPES["gradcam F1 last block"].id in report
    assert report.count("\n| ") == len(rows) + 2  # header, rule, one row per map and the uniform map
    # Every output names the model, the weights' origin and the recipe ids (issue #51): recipes.json and the strips.
    listing = json.loads((out / "recipes.json").read_text())
    assert listing["model"] == "shapes-video" and listing["weights_origin"] == tr.attrs["weights_origin"]
    assert listing["weights_warning"] is None and listing["trace_id"] == tr.attrs["trace_id"]
    assert list(listing["recipes"]) == list(VIDEO_RECIPES)
    for name, recipe in VIDEO_RECIPES.items():
        entry = listing["recipes"][name]
        assert vc.Recipe.from_dict(entry["recipe"]) == recipe and entry["recipe_id"] == recipe.id
        assert entry["canonical_id"] == recipe.resolve(tr).id
    with Image.open(out / "frame_strips.png") as im:
        assert im.text["Model"] == "shapes-video" and im.text["Weights"] == tr.attrs["weights_origin"]
        assert im.text["Recipes"].split() == [r.id for r in VIDEO_RECIPES.values()] and "Warning" not in im.text


def test_the_video_demo_refuses_an_image_before_any_work(tmp_path, capsys):
    assert main(["demo", "--model", "shapes-video", "--image", "x.png", "--out", str(tmp_path / "d")]) == 2
    assert "image, pretrained, weights: the video demo of shapes-video" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
