"""Tests of vitcam_nb.evaluate's map metrics (issue #6): every agreement and localisation metric on hand-made
maps with known values, and bad input."""

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
