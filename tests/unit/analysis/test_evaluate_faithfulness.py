"""Tests of vitcam_nb.evaluate's faithfulness metrics (issue #6): deletion, insertion, MoRF/LeRF, ROAD and noisy
linear imputation on a hand-built evidence model with known answers, bad input, and a trace scored on the
input the trace saw."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitcam_nb as vc
import vitcam_nb.evaluate as ev
from vitcam_nb.evaluate import MetricWarning

# --------------------------------------------------------------------------------------------------
# faithfulness on a hand-built evidence model


class EvidenceModel(torch.nn.Module):
    """Logit 0 = mean input intensity over a fixed square (the evidence); logit 1 = 0."""

    def __init__(self, rows: slice, cols: slice):
        super().__init__()
        self.rows, self.cols = rows, cols
        self.scale = torch.nn.Parameter(torch.ones(()))  # a parameter, to check it is left alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.scale * x[:, :, self.rows, self.cols].mean(dim=(1, 2, 3))
        return torch.stack([v, torch.zeros_like(v)], dim=1)


EVIDENCE = (slice(0, 4), slice(0, 4))  # the top-left 2x2 patches of an 8x8 input with 2x2 patches
GOOD = np.zeros((8, 8))
GOOD[EVIDENCE] = 1.0


def _textured(seed: int = 0, size: int = 8) -> torch.Tensor:
    x = 0.3 * torch.randn((1, 3, size, size), generator=torch.Generator().manual_seed(seed))
    x[:, :, :4, :4] += 2.0
    return x


def test_deletion_exact_auc_on_the_evidence_model(model_snapshot, assert_model_unchanged):
    model = EvidenceModel(*EVIDENCE).train()
    before = model_snapshot(model)
    ones = torch.ones(1, 3, 8, 8)
    # removing the 4 evidence patches first: the logit falls 1, .75, .5, .25, 0, 0, ... over 16 patches
    tok = ev.deletion(model, ones, GOOD, target=0, patch_size=2, score="logit", progress=False)
    assert tok.attrs["auc"] == pytest.approx(0.125)
    np.testing.assert_allclose(tok.values[:6], [1, 0.75, 0.5, 0.25, 0, 0], atol=1e-6)
    assert tok["fraction"].values[[0, -1]].tolist() == [0.0, 1.0]
    # the same in pixel mode, one pixel per step: 16 of 64 pixels carry the evidence
    pix = ev.deletion(model, ones, GOOD, target=0, mode="pixel", step=1, score="logit", progress=False)
    assert pix.attrs["auc"] == pytest.approx(0.125)
    ins = ev.insertion(model, ones, GOOD, target=0, patch_size=2, substrate="mean", score="logit",
                       progress=False)
    assert ins.attrs["auc"] == pytest.approx(0.875)
    lm = ev.lerf_morf_area(model, ones, GOOD, target=0, patch_size=2, score="logit", progress=False)
    assert (lm.attrs["morf_auc"], lm.attrs["lerf_auc"]) == pytest.approx((0.125, 0.875))
    assert lm.attrs["area"] == pytest.approx(0.75)
    assert list(lm["order"].values) == ["morf", "lerf"]
    assert_model_unchanged(before, model)
    assert model.training


@pytest.mark.parametrize("substrate", ["mean", "image_mean", "blur", "nli"])
def test_deletion_of_the_evidence_first_falls_faster_than_a_random_map(substrate):
    model = EvidenceModel(*EVIDENCE)
    x = _textured()
    kw = dict(target=0, patch_size=2, substrate=substrate, score="logit", progress=False, blur_sigma=2.0)
    good = ev.deletion(model, x, GOOD, **kw)
    rnd = [ev.deletion(model, x, np.random.default_rng(s).random((8, 8)), **kw).attrs["auc"]
           for s in range(3)]
    assert good.attrs["auc"] < min(rnd)
    # after the 4 evidence patches (a quarter of the image) are gone, the good curve has fallen further
    quarter = good.sel(fraction=0.25).item()
    assert quarter < good.sel(fraction=0.0).item() - 0.5


def test_faithfulness_settings_are_recorded_and_runs_are_reproducible():
    model = EvidenceModel(*EVIDENCE)
    x = _textured(1)
    sal = np.random.default_rng(3).random((8, 8))
    kw = dict(target=0, patch_size=2, substrate="nli", score="prob", step=2, seed=7, progress=False)
    a = ev.deletion(model, x, sal, batch_size=3, **kw)
    b = ev.deletion(model, x, sal, batch_size=64, **kw)
    np.testing.assert_array_equal(a.values, b.values)  # the same numbers whatever the batch size
    c = ev.deletion(model, x, sal, batch_size=3, **{**kw, "seed": 8})
    assert not np.array_equal(a.values[1:-1], c.values[1:-1])  # the NLI noise follows the seed
    expected = dict(mode="token", substrate="nli", score="prob", step=2, seed=7, target=0, order="morf",
                    patch_size="2x2", nli_noise=0.01, metric="deletion", n_steps=8)
    for key, value in expected.items():
        assert a.attrs[key] == value, key
    assert "auc" in a.attrs
    blur = ev.insertion(model, x, sal, target=0, patch_size=2, progress=False)
    assert blur.attrs["substrate"] == "blur" and blur.attrs["blur_sigma"] == pytest.approx(5 * 8 / 224)


def test_road_with_explicit_percentiles():
    model = EvidenceModel(*EVIDENCE)
    x = _textured(2)
    good = ev.road(model, x, GOOD + 0.01 * np.random.default_rng(0).random((8, 8)), target=0, score="logit",
                   percentiles=(0.1, 0.25, 0.5), progress=False)
    assert good.dims == ("percentile",)
    assert good["percentile"].values.tolist() == [0.1, 0.25, 0.5]
    assert good["cells"].values.tolist() == [6, 16, 32]
    assert good.attrs["substrate"] == "nli" and good.attrs["mode"] == "pixel"
    lerf = ev.road(model, x, GOOD, target=0, score="logit", order="lerf", percentiles=(0.1, 0.25, 0.5),
                   progress=False)
    assert good.values[1] < lerf.values[1] - 0.5  # MoRF removes the evidence, LeRF keeps it
    with pytest.raises(ValueError, match="^percentiles"):
        ev.road(model, x, GOOD, percentiles=(0.5, 0.2))


def test_noisy_linear_imputation_is_exact_on_a_linear_ramp():
    yy, xx = np.mgrid[0:9, 0:9]
    ramp = np.stack([0.1 * xx + 0.2 * yy, -0.3 * xx, 0.05 * yy + 1.0])
    hole = np.zeros((9, 9), bool)
    hole[3:6, 3:6] = True
    filled = ev.noisy_linear_imputation(ramp, hole, noise=0.0)
    np.testing.assert_allclose(filled, ramp, atol=1e-10)
    noisy = ev.noisy_linear_imputation(ramp, hole, noise=0.1, seed=1)
    np.testing.assert_array_equal(noisy[:, ~hole], ramp[:, ~hole])  # known pixels never change
    np.testing.assert_array_equal(noisy, ev.noisy_linear_imputation(ramp, hole, noise=0.1, seed=1))


def test_faithfulness_bad_input():
    model = EvidenceModel(*EVIDENCE)
    x = _textured()
    with pytest.raises(ValueError, match=r"^saliency: token mode needs a map"):
        ev.deletion(model, x, np.ones((3, 3)), patch_size=2)
    with pytest.raises(ValueError, match=r"^saliency: pixel mode needs a map"):
        ev.deletion(model, x, np.ones((4, 4)), mode="pixel")
    with pytest.raises(ValueError, match=r"^substrate"):
        ev.deletion(model, x, GOOD, patch_size=2, substrate="black")
    with pytest.raises(ValueError, match=r"^step"):
        ev.deletion(model, x, GOOD, patch_size=2, step=0)
    with pytest.raises(ValueError, match=r"^target"):
        ev.deletion(model, x, GOOD, patch_size=2, target=5)
    with pytest.raises(ValueError, match=r"^patch_size: token mode needs"):
        ev.deletion(model, x, GOOD)
    with pytest.raises(ValueError, match=r"^image: array of dtype bool has no pixel meaning"):
        ev.deletion(model, np.zeros((8, 8, 3), bool), GOOD, patch_size=2)
    with pytest.raises(ValueError, match=r"^image: cannot normalise a uint8 array"):
        ev.deletion(model, np.zeros((8, 8, 3), np.uint8), GOOD, patch_size=2)
    with pytest.warns(MetricWarning, match="constant"):
        ev.deletion(model, x, np.ones((8, 8)), patch_size=2, progress=False)


def test_a_trace_is_scored_on_the_input_the_trace_saw(model_factory):
    model = model_factory("vit")
    image = np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    tr = vc.trace(model, image, targets="top2")
    x, how = ev.model_input(model, tr)
    assert how.startswith("trace image")
    with torch.no_grad():
        logits = model(x)[0].numpy()
    np.testing.assert_allclose(logits, tr["logits"].values, rtol=1e-4, atol=1e-4)
    m = vc.cam(tr, vc.Recipe(site="F1", layer=1))
    curve = ev.deletion(model, tr, m, progress=False)  # patch size from the trace, map at pixel size
    assert curve.sizes["fraction"] == tr.attrs["grid_h"] * tr.attrs["grid_w"] + 1
    assert curve.attrs["saliency_recipe_id"] == m.attrs["recipe_id"]
    assert curve.attrs["target"] == int(np.argmax(tr["logits"].values))
    # without a target, the class the map's recipe names is scored (here the second-highest logit)
    second = vc.cam(tr, vc.Recipe(site="F1", layer=1, class_="top2"), grid=True)
    runner_up = int(np.argsort(-tr["logits"].values)[1])
    assert ev.deletion(model, tr, second, progress=False).attrs["target"] == runner_up
