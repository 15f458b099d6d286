"""Tests of vitcam_nb.evaluate (issue #6): every metric on hand-made maps with known values, bad input,
faithfulness on a hand-built evidence model, sanity checks and the atlas on tiny ViTs, and the
known-answer checks on the bundled model when it is installed."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import vitcam_nb as vc
import vitcam_nb.evaluate as ev
from vitcam_nb.evaluate import MetricWarning

# --------------------------------------------------------------------------------------------------
# hand-made maps

REVERSED_A = np.arange(16, dtype=float).reshape(4, 4)
SIGNED = np.array([[5.0, -4.0, 3.0], [-2.5, 1.0, -0.5], [0.25, -0.125, 2.0]])  # distinct |values|


def _bundled_model():
    """The bundled known-answer model, or None while it is not installed yet."""
    try:
        from vitcam_nb.models import load_model

        return load_model("shapes-vit")
    except Exception:  # the models package or its weights file may not exist yet
        return None


# --------------------------------------------------------------------------------------------------
# agreement


def test_spearman_of_reversed_ranking_is_minus_one():
    assert ev.spearman(REVERSED_A, REVERSED_A[::-1, ::-1]) == -1.0
    assert ev.spearman(REVERSED_A, REVERSED_A ** 3) == 1.0  # any increasing transform keeps the ranks


def test_pearson_cosine_known_values():
    assert ev.pearson(REVERSED_A, 2 * REVERSED_A + 1) == pytest.approx(1.0)
    assert ev.pearson(REVERSED_A, -REVERSED_A) == pytest.approx(-1.0)
    assert ev.cosine([[1.0, 0.0]], [[0.0, 1.0]]) == 0.0
    assert ev.cosine([[1.0, 1.0]], [[1.0, 0.0]]) == pytest.approx(1 / math.sqrt(2))
    # Pearson is centred, cosine is not: an offset changes one and not the other
    assert ev.pearson([[1.0, 2.0]], [[11.0, 12.0]]) == pytest.approx(1.0)
    assert ev.cosine([[1.0, 2.0]], [[11.0, 12.0]]) < 1.0


def test_ssim_known_values():
    assert ev.ssim(REVERSED_A, REVERSED_A) == pytest.approx(1.0)
    # two constant maps: only the luminance term remains, (2 mu_a mu_b + C1) / (mu_a^2 + mu_b^2 + C1)
    c1 = (0.01 * 1.0) ** 2
    expected = (2 * 0.2 * 0.6 + c1) / (0.2**2 + 0.6**2 + c1)
    got = ev.ssim(np.full((4, 4), 0.2), np.full((4, 4), 0.6), data_range=1.0)
    assert got == pytest.approx(expected, rel=1e-12)
    a, b = np.random.default_rng(0).random((2, 5, 5))
    assert ev.ssim(a, b) == pytest.approx(ev.ssim(b, a))
    assert ev.ssim(a, b) < ev.ssim(a, a + 0.01 * b)


def test_topk_and_krishna_measures_known_values():
    a = [[4.0, 3.0], [0.0, 0.0]]
    b = [[0.0, 3.0], [4.0, 0.0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MetricWarning)  # zero plateaus tie at the k boundary
        assert ev.topk_iou(a, b, k=2) == pytest.approx(1 / 3)  # {0,1} vs {1,2}
        assert ev.feature_agreement(a, b, k=2) == 0.5
        assert ev.feature_agreement(a, b, k=0.5) == 0.5  # a fraction: half of 4 cells
    # ranks by |value|: a = (0, 2, 1, 3), b = (0, 1, 2, 3): only rank 1 agrees in the top 2
    assert ev.rank_agreement([[4, 3], [1, 0]], [[4, 1], [3, 0]], k=2) == 0.5
    assert ev.rank_agreement([[4, 3], [1, 0]], [[4, 1], [3, 0]], k=4) == 0.5  # ranks 1 and 4 agree
    # same top-2 cells and ranks, one sign differs
    s_a, s_b = [[4.0, -3.0], [0.5, 0.1]], [[4.0, 3.0], [0.5, 0.1]]
    assert ev.feature_agreement(s_a, s_b, k=2) == 1.0
    assert ev.sign_agreement(s_a, s_b, k=2) == 0.5
    assert ev.signed_rank_agreement(s_a, s_b, k=2) == 0.5
    assert ev.sign_agreement(SIGNED, -SIGNED, k=4) == 0.0
    assert ev.feature_agreement(SIGNED, -SIGNED, k=4) == 1.0  # magnitudes agree, signs never


@pytest.mark.parametrize("name", sorted(ev.AGREEMENT_METRICS))
def test_every_agreement_metric_is_one_on_identical_maps(name):
    assert ev.AGREEMENT_METRICS[name](SIGNED, SIGNED) == pytest.approx(1.0)


@pytest.mark.parametrize("name", sorted(ev.AGREEMENT_METRICS))
def test_agreement_refuses_maps_of_different_shapes(name):
    with pytest.raises(ValueError, match=r"b: maps of different shapes"):
        ev.AGREEMENT_METRICS[name](np.ones((3, 3)), np.ones((3, 4)))


def test_agreement_bad_input_errors():
    with pytest.raises(ValueError, match=r"^a: expected a 2-D map"):
        ev.spearman(np.ones((2, 2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"^b: contains NaN"):
        ev.pearson(np.ones((2, 2)), [[1.0, np.nan], [0.0, 1.0]])
    with pytest.raises(ValueError, match=r"^k: a fraction must be in"):
        ev.topk_iou(SIGNED, SIGNED, k=1.5)
    with pytest.raises(ValueError, match=r"^k: a count must be in 1..9"):
        ev.feature_agreement(SIGNED, SIGNED, k=10)
    with pytest.raises(ValueError, match=r"^data_range"):
        ev.ssim(SIGNED, SIGNED, data_range=0)


@pytest.mark.parametrize("name", ["spearman", "pearson", "topk_iou", "feature_agreement", "rank_agreement"])
def test_constant_map_gives_nan_with_a_warning_that_says_why(name):
    with pytest.warns(MetricWarning, match="constant"):
        assert math.isnan(ev.AGREEMENT_METRICS[name](np.full((3, 3), 0.5), SIGNED))


def test_zero_and_same_constant_maps():
    with pytest.warns(MetricWarning, match="all zeros"):
        assert math.isnan(ev.cosine(np.zeros((2, 2)), np.ones((2, 2))))
    with pytest.warns(MetricWarning, match="data range zero"):
        assert math.isnan(ev.ssim(np.ones((2, 2)), np.ones((2, 2))))
    assert ev.ssim(np.ones((2, 2)), np.ones((2, 2)), data_range=1.0) == 1.0


def test_sign_measures_warn_on_maps_taken_after_the_relu():
    with pytest.warns(MetricWarning, match="before the ReLU"):
        ev.sign_agreement(np.abs(SIGNED), np.abs(SIGNED), k=3)
    tagged = xr.DataArray(SIGNED, dims=("y", "x"), attrs={"recipe": vc.Recipe().to_json()})
    with pytest.warns(MetricWarning, match="relu='after'"):
        ev.signed_rank_agreement(tagged, SIGNED, k=3)


def test_metrics_accept_dataarrays_and_return_plain_floats():
    da = xr.DataArray(REVERSED_A, dims=("patch_row", "patch_col"))
    for fn in (ev.spearman, ev.ssim, ev.topk_iou):
        out = fn(da, torch.tensor(REVERSED_A))
        assert type(out) is float


maps_2d = arrays(np.float64, st.tuples(st.integers(2, 5), st.integers(2, 5)),
                 elements=st.floats(-10, 10, allow_nan=False, width=32))


@settings(max_examples=40, deadline=None)
@given(maps_2d, st.randoms(use_true_random=False))
def test_spearman_properties(a, rnd):
    b = np.array(a.ravel())
    rnd.shuffle(b)
    b = b.reshape(a.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MetricWarning)
        r = ev.spearman(a, b)
        if np.ptp(a) == 0:
            assert math.isnan(r)
            return
        assert -1.0 <= r <= 1.0
        assert r == pytest.approx(ev.spearman(b, a))
        # a strictly increasing transform of a map leaves its ranking unchanged
        assert ev.spearman(a, 2.0 * a) == pytest.approx(1.0)
        assert ev.spearman(a, -a) == pytest.approx(-1.0)


# --------------------------------------------------------------------------------------------------
# localisation

MASK = np.zeros((16, 16), bool)
MASK[4:8, 4:8] = True


@pytest.mark.parametrize("name", sorted(ev.LOCALISATION_METRICS))
def test_map_equal_to_mask_scores_one(name):
    assert ev.LOCALISATION_METRICS[name](MASK.astype(float), MASK) == 1.0


def test_pointing_game_hits_misses_and_tolerance():
    m = np.zeros((16, 16))
    m[4, 12] = 1.0  # 5 pixels right of the mask (the mask's last column is 7)
    assert ev.pointing_game(m, MASK, tolerance=4) == 0.0
    assert ev.pointing_game(m, MASK, tolerance=5) == 1.0
    assert ev.pointing_game(m, MASK, tolerance=0) == 0.0
    far = np.zeros((16, 16))
    far[15, 15] = 1.0  # argmax outside the mask, beyond the default tolerance (15 * 16 / 224 px)
    assert ev.pointing_game(far, MASK) == 0.0
    assert ev.default_tolerance((224, 224)) == 15.0
    assert ev.default_tolerance((64, 64)) == pytest.approx(15 * 64 / 224)
    # a plateau maximum half inside, half outside the mask: the expected hit is 0.5
    tie = np.zeros((16, 16))
    tie[5, 5] = tie[15, 0] = 1.0
    assert ev.pointing_game(tie, MASK, tolerance=0) == 0.5


def test_localisation_known_values():
    mask = np.array([[True, False], [True, False]])
    assert ev.energy_pointing_game([[3.0, 1.0], [2.0, 1.0]], mask) == pytest.approx(3 / 3)  # minmax: 1,0,.5,0
    assert ev.energy_pointing_game([[4.0, 2.0], [2.0, 0.0]], mask) == pytest.approx((1 + 0.5) / 2.0)
    assert ev.relevance_mass_accuracy([[-5.0, 3.0], [1.0, 0.0]], [[True, True], [False, False]]) == 0.75
    assert ev.relevance_rank_accuracy([[4.0, 3.0], [2.0, 1.0]], mask) == 0.5
    assert ev.auroc([[0.9, 0.1], [0.8, 0.2]], mask) == 1.0
    assert ev.auroc([[0.1, 0.9], [0.2, 0.8]], mask) == 0.0
    # positives 0.9, 0.2 against negatives 0.5, 0.1: 3 of 4 pairs ordered right
    assert ev.auroc([[0.9, 0.5], [0.2, 0.1]], mask) == 0.75
    with pytest.warns(MetricWarning, match="chance"):
        assert ev.auroc(np.ones((2, 2)), mask) == 0.5


def test_localisation_bad_input():
    with pytest.raises(ValueError, match=r"^mask: shape \(8, 8\) does not match"):
        ev.pointing_game(np.ones((16, 16)), np.ones((8, 8), bool))
    for fn in ev.LOCALISATION_METRICS.values():
        with pytest.raises(ValueError, match=r"^mask: empty mask"):
            fn(np.eye(4), np.zeros((4, 4), bool))
    with pytest.raises(ValueError, match=r"^mask: expected a boolean mask"):
        ev.auroc(np.eye(2), [[0, 2], [1, 0]])
    with pytest.raises(ValueError, match=r"^tolerance"):
        ev.pointing_game(np.eye(4), np.eye(4, dtype=bool), tolerance=-1)
    with pytest.warns(MetricWarning, match="constant"):
        assert math.isnan(ev.pointing_game(np.ones((16, 16)), MASK))
    with pytest.warns(MetricWarning, match="constant"):
        assert math.isnan(ev.energy_pointing_game(np.ones((16, 16)), MASK))
    with pytest.warns(MetricWarning, match="no positive value"):
        assert math.isnan(ev.relevance_mass_accuracy(-np.ones((16, 16)), MASK))
    with pytest.warns(MetricWarning, match="whole map"):
        assert math.isnan(ev.auroc(np.eye(4), np.ones((4, 4), bool)))


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


# --------------------------------------------------------------------------------------------------
# atlas


@pytest.fixture(scope="module")
def vit_traces():
    from vitcam_testing import make_input, make_model

    model = make_model("vit")
    return [vc.trace(model, make_input("vit", seed), targets="top3") for seed in range(2)]


ATLAS_RECIPES = {
    "F1 L0": vc.Recipe(site="F1", layer=0),
    "F1 L0 max-norm": vc.Recipe(site="F1", layer=0, normalize="max"),
    "F4 L1": vc.Recipe(site="F4", layer=1),
    "F1 L2": vc.Recipe(site="F1", layer=2),
    "F6 L2": vc.Recipe(site="F6", layer=2),  # CLS pooling: zero gradient at the last block -> degenerate
    "rollout": vc.Recipe(site="F2", layer="all", layer_fusion="rollout"),
}


def test_atlas_known_values_labels_and_degenerate_recipes(vit_traces):
    tr = vit_traces[0]
    with pytest.warns(MetricWarning, match=r"F6 L2 \(.*degenerate|degenerate.*F6 L2"):
        da = ev.atlas(tr, ATLAS_RECIPES)
    assert da.dims == ("recipe_a", "recipe_b")
    assert list(da["label_a"].values) == list(ATLAS_RECIPES)
    assert list(da["recipe_a"].values) == [r.id for r in ATLAS_RECIPES.values()]
    # min-max and max normalisation of one map are increasing transforms of each other: Spearman 1
    assert da.sel(recipe_a=ATLAS_RECIPES["F1 L0"].id, recipe_b=ATLAS_RECIPES["F1 L0 max-norm"].id) == 1.0
    ok = ~da["degenerate_a"].values
    np.testing.assert_allclose(np.diag(da.values)[ok], 1.0)
    np.testing.assert_array_equal(da.values, da.values.T)
    assert np.isnan(da.sel(recipe_a=ATLAS_RECIPES["F6 L2"].id)).all()
    assert da["degenerate_a"].values.tolist() == [False, False, False, False, True, False]
    # the same call gives the same numbers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MetricWarning)
        np.testing.assert_array_equal(ev.atlas(tr, ATLAS_RECIPES).values, da.values)
    fig = ev.plot_atlas(da)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert sorted(labels) == sorted(ATLAS_RECIPES) and labels[-1] == "F6 L2"  # degenerate last
    assert labels.index("F1 L0") - labels.index("F1 L0 max-norm") in (-1, 1)  # the agreeing pair is adjacent


def test_atlas_over_many_traces_and_sign_measures(vit_traces):
    recipes = [ATLAS_RECIPES[k] for k in ("F1 L0", "F4 L1", "F1 L2")]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ds = ev.atlas(vit_traces, recipes, metric="sign_agreement", k=4)
    # the atlas takes signed maps itself (relu="none", normalize="none"), so no ReLU warning
    assert not [w for w in record if "before the ReLU" in str(w.message)]
    assert set(ds.data_vars) == {"mean", "std", "count"}
    assert ds["mean"].dims == ("recipe_a", "recipe_b")
    assert ds.attrs["n_images"] == 2 and ds.attrs["signed"] == 1
    np.testing.assert_array_equal(ds["count"].values, 2)
    per = [ev.atlas(t, recipes, metric="sign_agreement", k=4).values for t in vit_traces]
    np.testing.assert_allclose(ds["mean"].values, np.mean(per, axis=0))
    np.testing.assert_allclose(ds["std"].values, np.std(per, axis=0))
    ev.plot_atlas(ds)


def test_atlas_bad_input(vit_traces):
    r = vc.Recipe()
    with pytest.raises(ValueError, match=r"^recipes: the same recipe"):
        ev.atlas(vit_traces[0], [r, vc.Recipe(site="F1")])
    with pytest.raises(ValueError, match=r"^recipes: an atlas needs at least 2"):
        ev.atlas(vit_traces[0], [r])
    with pytest.raises(ValueError, match=r"^metric"):
        ev.atlas(vit_traces[0], [r, r.replace(layer=0)], metric="kendall")
    with pytest.raises(ValueError, match=r"^tr: item 1"):
        ev.atlas([vit_traces[0], "x"], [r, r.replace(layer=0)])


# --------------------------------------------------------------------------------------------------
# sanity checks


def test_randomise_parts_copies_and_is_seeded(model_factory, model_snapshot, assert_model_unchanged):
    model = model_factory("vit")
    before = model_snapshot(model)
    assert [p for p, _ in ev.model_parts(model)] == ["head", "blocks.2", "blocks.1", "blocks.0", "embed"]
    a = ev.randomise_parts(model, ["head", "blocks.2"], seed=3)
    b = ev.randomise_parts(model, ["head"], seed=3)
    assert_model_unchanged(before, model)
    assert torch.equal(a.head.weight, b.head.weight)  # a part gets the same draws in every mode
    assert not torch.equal(a.head.weight, model.head.weight)
    assert torch.equal(b.blocks[2].mlp.fc1.weight, model.blocks[2].mlp.fc1.weight)
    assert torch.equal(a.blocks[1].attn.qkv.weight, model.blocks[1].attn.qkv.weight)
    w = model.blocks[2].mlp.fc1.weight
    assert float(a.blocks[2].mlp.fc1.weight.detach().std()) == pytest.approx(float(w.detach().std()), rel=0.1)
    with pytest.raises(ValueError, match=r"^parts"):
        ev.randomise_parts(model, ["blocks.9"])


def test_randomised_logit(vit_traces):
    tr = vit_traces[0]
    out = ev.randomised_logit(tr, vc.Recipe(site="F1", layer=1))
    assert out.dims == ("metric",) and list(out["metric"].values) == ["spearman", "ssim"]
    traced = [int(c) for c in tr["target_class"].values if c >= 0]
    assert out.attrs["predicted"] == traced[0] and out.attrs["other"] in traced[1:]
    again = ev.randomised_logit(tr, vc.Recipe(site="F1", layer=1))
    np.testing.assert_array_equal(out.values, again.values)
    one = tr.isel(target=[0, len(tr["target"]) - 1])  # predicted class + expected logit only
    with pytest.raises(ValueError, match=r"^tr: the trace holds no class other"):
        ev.randomised_logit(one, vc.Recipe(site="F1", layer=1))


def _cascade_check(model, image, recipe):
    sim, maps = ev.model_randomisation(model, image, recipe, return_maps=True, seed=0)
    assert sim.dims == ("layer", "metric")
    assert list(sim["layer"].values) == [p for p, _ in ev.model_parts(model)]
    assert sim["n_randomised"].values.tolist() == list(range(1, sim.sizes["layer"] + 1))
    assert maps.sizes["layer"] == sim.sizes["layer"] + 1
    return sim, maps


def test_cascading_randomisation_lowers_similarity_on_the_bundled_model(model_snapshot,
                                                                         assert_model_unchanged):
    model = _bundled_model()
    if model is None:
        pytest.skip("vc.load_model('shapes-vit') is not available yet (bundled weights missing)")
    from vitcam_nb.data import shapes

    images, labels, _ = shapes(3, seed=123)
    before = model_snapshot(model)
    rows = []
    for image, label in zip(images, labels, strict=True):
        recipe = vc.Recipe(site="F1", layer=-1, class_=int(label))  # pytorch-grad-cam's ViT recipe
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MetricWarning)  # a fully random model may give a flat map
            sim = ev.model_randomisation(model, image, recipe, trace_kwargs={"sites": ["F1"]})
        rows.append(np.abs(sim.sel(metric="spearman").values))  # how much of the ranking survives
    assert_model_unchanged(before, model)
    curve = np.nanmean(rows, axis=0)  # mean |Spearman| to the original map, top part first
    half = len(curve) // 2
    # the more parts are randomised, the less of the original map is left
    assert curve[-1] < curve[0]
    assert np.nanmean(curve[half:]) < np.nanmean(curve[:half])


def test_randomisation_runs_on_a_small_random_vit(model_factory, model_snapshot, assert_model_unchanged):
    model = model_factory("vit")
    from vitcam_testing import make_input

    before = model_snapshot(model)
    sim, maps = _cascade_check(model, make_input("vit"), vc.Recipe(site="F1", layer=1))
    assert_model_unchanged(before, model)
    assert np.isfinite(sim.values).all()
    assert sim.attrs["mode"] == "cascading" and sim.attrs["target_class"] >= 0
    again = ev.model_randomisation(model, make_input("vit"), vc.Recipe(site="F1", layer=1), seed=0)
    np.testing.assert_array_equal(sim.values, again.values)
    ind = ev.model_randomisation(model, make_input("vit"), vc.Recipe(site="F1", layer=1), mode="independent")
    assert ind["n_randomised"].values.tolist() == [1] * ind.sizes["layer"]
    np.testing.assert_array_equal(ind.values[0], sim.values[0])  # the head alone: same draws, same map
    fig = ev.plot_randomisation(sim, maps)
    assert len(fig.axes) == maps.sizes["layer"] + 1


# --------------------------------------------------------------------------------------------------
# known-answer model: deletion and the report


def _tiny_shapes_vit():
    """A random 64-px ViT with the shapes data config, standing in for the bundled model in the report."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    m = VisionTransformer(img_size=64, patch_size=16, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    m.pretrained_cfg = {"input_size": (3, 64, 64), "crop_pct": 1.0, "mean": (0.5,) * 3, "std": (0.25,) * 3,
                        "interpolation": "bicubic", "crop_mode": "center"}
    return m.eval()


def test_report_known_answer_small(tmp_path):
    table, fig = ev.report_known_answer(
        _tiny_shapes_vit(), n_images=2, seed=0, sites=("F1", "F6"), weightings=("gradcam", "eigencam", "scorecam"),
        targets=("logit", "prob"), deletion_steps=4, out_dir=tmp_path, progress=False)
    # 2 layers x 2 sites x (gradcam: 2 targets + eigencam and scorecam (vc.score per image): once)
    assert len(table) == 16
    assert set(table[table.weighting == "scorecam"].target) == {"logit"}
    assert {"rank", "site", "layer", "weighting", "target", "pointing_game", "deletion_auc",
            "degenerate_frac", "recipe_id"} <= set(table.columns)
    ranked = table.dropna(subset=["pointing_game"])["pointing_game"].values
    assert (np.diff(ranked) <= 0).all()
    last_f6 = table[(table.site == "F6") & (table.layer == 1) & (table.weighting == "gradcam")]
    assert (last_f6["degenerate_frac"] == 1.0).all() and last_f6["pointing_game"].isna().all()
    for ext in ("csv", "png", "json"):
        assert (tmp_path / f"known_answer_report.{ext}").is_file()
    assert table.attrs["deletion_step"] == 4 and table.attrs["substrate"] == "mean"


def test_report_scores_channels_at_token_sites_only():
    """The default sites include F2, a matrix per head: Score-CAM rows are at the token sites alone."""
    table, _ = ev.report_known_answer(_tiny_shapes_vit(), n_images=1, seed=0, sites=("F1", "F2"),
                                      weightings=("gradcam", "scorecam"), targets=("logit",), deletion_steps=4,
                                      progress=False)
    assert set(table[table.weighting == "scorecam"].site) == {"F1"}
    assert set(table[table.weighting == "gradcam"].site) == {"F1", "F2"}
    assert len(table) == 2 * 3  # 2 layers x (gradcam at 2 sites + scorecam at 1)


def test_deletion_on_the_bundled_model_removes_the_evidence_first():
    model = _bundled_model()
    if model is None:
        pytest.skip("vc.load_model('shapes-vit') is not available yet (bundled weights missing)")
    from vitcam_nb.data import shapes

    images, labels, masks = shapes(4, seed=7)
    rng = np.random.default_rng(0)
    good, random = [], []
    for img, label, mask in zip(images, labels, masks, strict=True):
        # a good map: the evidence object's mask (tiny noise orders the patches within it)
        g = ev.deletion(model, img, mask.astype(float) + 0.01 * rng.random(mask.shape), target=int(label),
                        progress=False)
        assert g.values[g.attrs["n_cells"] // 8] < g.values[0]  # the most covered patches carry the class
        good.append(g)
        random += [ev.deletion(model, img, rng.random(mask.shape), target=int(label), progress=False)
                   for _ in range(2)]
    # the class score falls faster when the evidence goes first: lower curve early on, lower AUC
    assert np.mean([g.sel(fraction=0.25, method="nearest").item() for g in good]) < np.mean(
        [r.sel(fraction=0.25, method="nearest").item() for r in random])
    assert np.mean([g.attrs["auc"] for g in good]) < np.mean([r.attrs["auc"] for r in random])
