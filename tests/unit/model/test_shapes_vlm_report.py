"""The VLM known-answer report (issue #55, item 6): its scores are the kit's metrics on maps of the true answer
recomputed here from traces of our own, its random-peak baseline is the brute-force share of pixels near the mask,
and the other object is the one the question does not name (checked from the pixels)."""

from __future__ import annotations

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb import models
from vitcam_nb.data import shapes_vlm as sv
from vitcam_nb.data import train_vlm
from vitcam_nb.evaluate.report.known_answer_vlm import (
    VLM_RECIPES,
    question_scores,
    random_peak,
    report_known_answer_vlm,
    token_pointing,
)

pytest.importorskip("transformers")
needs_model = pytest.mark.skipif("shapes-vlm" not in models.bundled_names(), reason="shapes-vlm is not bundled")


def test_random_peak_is_the_share_of_pixels_within_the_tolerance():
    rng = np.random.default_rng(0)
    mask = np.zeros((20, 24), bool)
    mask[rng.integers(0, 20, 5), rng.integers(0, 24, 5)] = True
    yy, xx = np.mgrid[0:20, 0:24]
    ys, xs = np.nonzero(mask)
    dist = np.sqrt((yy[..., None] - ys) ** 2 + (xx[..., None] - xs) ** 2).min(-1)  # brute force
    for tol in (0.0, 1.5, 3.0):
        assert random_peak(mask, tol) == pytest.approx(np.mean(dist <= tol))
    assert random_peak(mask) == pytest.approx(np.mean(dist <= vc.evaluate.default_tolerance((20, 24))))


def test_question_scores_point_at_the_peaks_object():
    a = np.zeros((16, 16), bool)
    a[1:4, 1:4] = True
    b = a[::-1, ::-1]
    m = a * 2.0 + b * 1.0
    s = question_scores(m, a, b)
    assert (s["pointing_game"], s["other_object"], s["auroc"]) == (1.0, 0.0, 1.0)
    assert np.isnan(question_scores(np.ones((16, 16)), a, b)["pointing_game"])


def test_token_pointing_asks_whether_the_highest_tokens_patch_holds_the_object():
    rng = np.random.default_rng(3)
    for _ in range(20):
        mask = rng.random((64, 64)) > 0.995
        grid = rng.integers(0, 3, (4, 4)).astype(float)
        hits = [mask[16 * r:16 * r + 16, 16 * c:16 * c + 16].any()
                for r in range(4) for c in range(4) if grid[r, c] == grid.max()]  # each tied peak, by loops
        assert token_pointing(grid, mask) == pytest.approx(np.mean(hits))
    assert np.isnan(token_pointing(np.zeros((4, 4)), mask))
    with pytest.raises(vc.ArgumentError, match="mask"):
        token_pointing(np.ones((4, 4)), np.zeros((30, 30), bool))


def test_the_objects_are_the_asked_about_one_and_the_other():
    images, questions, _, masks, kinds, obj = sv.shapes_vqa(40, seed=12, objects=True)
    plain = sv.shapes_vqa(40, seed=12)
    np.testing.assert_array_equal(plain[0], images)
    np.testing.assert_array_equal(obj["masks"][np.arange(40), obj["asked"]], masks)
    palette = np.array(list(sv.COLOURS.values()), np.float64)
    for i in range(40):
        for k in range(2):  # each object's colour and quadrant, from its pixels
            m = obj["masks"][i, k]
            mean = images[i][m].mean(0)
            assert int(np.argmin(np.linalg.norm(palette - mean, axis=1))) == obj["colour"][i, k]
            cy, cx = np.nonzero(m)
            assert int(cy.mean() > 32) * 2 + int(cx.mean() > 32) == obj["quadrant"][i, k]
        named = questions[i].split()[-1]  # the object's name, or its colour
        k = int(obj["asked"][i])
        assert named == (sv.OBJECTS[k] if kinds[i] == 0 else list(sv.COLOURS)[obj["colour"][i, k]])


def test_token_labels_are_the_majority_object_per_patch():
    _, _, _, _, _, obj = sv.shapes_vqa(12, seed=4, objects=True)
    labels = train_vlm.token_labels(obj)
    for i in range(12):
        for t in range(16):
            r, c = divmod(t, 4)
            cover = obj["masks"][i, :, 16 * r:16 * r + 16, 16 * c:16 * c + 16].sum(axis=(1, 2))
            k = int(np.argmax(cover))
            want = (0, 0) if cover[k] < 12 else (1 + int(obj["colour"][i, k]), 1 + k)
            assert tuple(labels[i, t]) == want


@needs_model
def test_the_report_rows_are_the_kits_metrics_on_our_own_traces():
    recipes = {k: VLM_RECIPES[k] for k in ("gradcam tower F6 block 2", "gradcam lm_resid layer 1")}
    rows, settings = report_known_answer_vlm(n_questions=3, seed=321, recipes=recipes)
    model = vc.load_model("shapes-vlm")
    images, questions, answers, masks, kinds, obj = sv.shapes_vqa(3, seed=321, objects=True)
    got = {name: [] for name in recipes}
    tokens = {name: [] for name in recipes}
    for i in range(3):
        tr = vc.trace(model, train_vlm.normalise(images[i:i + 1]),
                      targets=vc.targets.answer(input_ids=sv.prompt_ids(questions[i]),
                                                answer_ids=sv.answer_ids(answers[i])))
        for name, recipe in recipes.items():
            got[name].append(vc.evaluate.pointing_game(vc.cam(tr, recipe).values, masks[i]))
            tokens[name].append(token_pointing(vc.cam(tr, recipe.replace(upsample="none")).values, masks[i]))
    for row, name in zip(rows, recipes, strict=False):
        assert not np.isnan(got[name]).all()
        assert row["recipe"] == name and row["pointing_game"] == pytest.approx(np.nanmean(got[name]))
        assert row["token_pointing"] == pytest.approx(np.nanmean(tokens[name]))
    assert rows[-1]["recipe"] == "random peak"
    assert rows[-1]["pointing_game"] == pytest.approx(np.mean([random_peak(m) for m in masks]))
    right = [g == a for g, a in zip(train_vlm.greedy_answers(model, images, questions), answers)]
    assert settings["accuracy"] == pytest.approx(np.mean(right)) and settings["n_questions"] == 3
