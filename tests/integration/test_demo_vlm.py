"""``vitcam-nb demo --model shapes-vlm``: the VLM demo writes its trace, answer-token maps, scores, checklists and
report, with the generated answer recomputed by transformers' own generate and the scores recomputed here from the
saved trace (the kit's metrics on the maps of the saved trace), and refuses what it does not use or did not write."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import vitcam_nb as vc
from vitcam_nb.cli import main
from vitcam_nb.data import shapes_vlm as sv
from vitcam_nb.data.train_vlm import MAX_ANSWER_TOKENS, normalise
from vitcam_nb.demo_vlm import DEMO_RECIPES, VLM_OUTPUTS, sample_question

pytest.importorskip("transformers")


def test_the_vlm_demo_writes_its_outputs_and_their_scores_are_the_maps(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--model", "shapes-vlm", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    card = vc.models.model_card("shapes-vlm")
    assert f"weights: bundled shapes-vlm (file sha256 {card['weights_sha256']})" in printed
    for name in VLM_OUTPUTS:
        assert (out / name).stat().st_size > 0, name
    image, question, true_answer, mask = sample_question()
    scores = json.loads((out / "scores.json").read_text())
    assert (scores["question"], scores["true_answer"]) == (question, true_answer)
    # the generated answer is transformers' own greedy generate on the same prompt
    model = vc.load_model("shapes-vlm")
    ids = torch.tensor([sv.prompt_ids(question)])
    with torch.no_grad():
        gen = model.generate(input_ids=ids, pixel_values=normalise(image[None]), max_new_tokens=MAX_ANSWER_TOKENS,
                             do_sample=False, eos_token_id=sv.EOS_ID, pad_token_id=sv.PAD_ID)[0, ids.shape[1]:].tolist()
    assert sv.EOS_ID in gen and scores["generated_answer"] == sv.decode(gen[: gen.index(sv.EOS_ID)])
    tr = vc.load(out / "trace.nc")
    assert tr.attrs["weights_origin"].startswith("bundled shapes-vlm")
    assert [int(i) for i in str(tr.attrs["answer_ids"]).split(",")] == sv.answer_ids(scores["traced_answer"])
    assert scores["image_token_layout"] == tr.attrs["image_token_layout"]
    # the outline's object: the mask of the object the question names (its colour or its shape)
    rows = {r["recipe"]: r for r in scores["rows"]}
    assert list(rows) == list(DEMO_RECIPES)
    checklists = json.loads((out / "checklists.json").read_text())
    for name, recipe in DEMO_RECIPES.items():
        m = vc.cam(tr, recipe).values.astype(np.float64)
        assert rows[name]["recipe_id"] == recipe.id
        assert rows[name]["pointing_game"] == pytest.approx(vc.evaluate.pointing_game(m, mask), nan_ok=True)
        assert rows[name]["auroc"] == pytest.approx(vc.evaluate.auroc(m, mask), nan_ok=True)
        assert checklists[name] == json.loads(vc.cam(tr, recipe).attrs["checklist"])
    report = (out / "report.md").read_text()
    assert report.count("\n| ") == len(rows) + 2  # header, rule, one row per map
    assert f"Image-token layout: {tr.attrs['image_token_layout']}" in report.replace("\\", "")
    listing = json.loads((out / "recipes.json").read_text())
    assert listing["model"] == "shapes-vlm" and listing["trace_id"] == tr.attrs["trace_id"]
    assert [listing["recipes"][k]["recipe_id"] for k in DEMO_RECIPES] == [r.id for r in DEMO_RECIPES.values()]
    with Image.open(out / "answer_maps.png") as im:
        assert im.text["Model"] == "shapes-vlm" and im.text["Weights"] == tr.attrs["weights_origin"]
        assert im.text["Recipes"].split() == [r.id for r in DEMO_RECIPES.values()] and "Warning" not in im.text


def test_the_vlm_demo_refuses_an_image_and_a_file_it_did_not_write_before_any_work(tmp_path, capsys):
    assert main(["demo", "--model", "shapes-vlm", "--image", "x.png", "--out", str(tmp_path / "d")]) == 2
    assert "image, pretrained, weights: the VLM demo of shapes-vlm" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    theirs = tmp_path / "e"
    theirs.mkdir()
    (theirs / "report.md").write_text("mine")
    assert main(["demo", "--model", "shapes-vlm", "--out", str(theirs), "--quiet"]) == 2
    assert "report.md exists and is not a file vitcam_nb wrote" in capsys.readouterr().err
    assert sorted(p.name for p in theirs.iterdir()) == ["report.md"] and (theirs / "report.md").read_text() == "mine"
