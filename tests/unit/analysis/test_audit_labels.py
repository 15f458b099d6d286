"""The audit's four labels on hand-made maps of each kind, and the rule's thresholds at their edges."""

from __future__ import annotations

import numpy as np
import pytest

from vitcam_nb import evaluate
from vitcam_nb.evaluate.audit.labels import AUROC_INVERTED, AUROC_LOCALISES, LABELS, label_map, rule_text, thresholds

YY, XX = np.mgrid[:64, :64]
R = np.hypot(YY - 28, XX - 30)
MASK = R <= 10  # a disc, 7.7 % of the pixels


def test_a_blob_on_the_object_localises():
    label, numbers = label_map(np.exp(-R**2 / (2 * 5.0**2)), MASK)
    assert label == "localises"
    assert numbers["pointing_game"] == 1.0 and numbers["auroc"] == 1.0
    assert numbers["energy_inside"] > numbers["mask_share"]


def test_the_complement_of_the_mask_is_inverted():
    label, numbers = label_map((~MASK).astype(float), MASK)
    assert label == "inverted"
    assert numbers["auroc"] == 0.0 and numbers["energy_inside"] == 0.0


def test_a_ring_around_the_object_is_context():
    label, numbers = label_map(np.exp(-(R - 16) ** 2 / (2 * 2.5**2)), MASK)
    assert label == "context"
    assert numbers["pointing_game"] == 0.0
    assert AUROC_INVERTED < numbers["auroc"] < AUROC_LOCALISES
    assert numbers["energy_inside"] < numbers["mask_share"]


@pytest.mark.parametrize("values", [np.zeros((64, 64)), np.full((64, 64), 0.3),
                                    1.0 + 1e-9 * np.random.default_rng(0).random((64, 64))])
def test_zero_constant_and_rounding_noise_maps_are_empty(values):
    label, numbers = label_map(values, MASK)
    assert label == "empty"
    assert numbers["auroc"] is None and numbers["pointing_game"] is None
    assert numbers["mask_share"] == pytest.approx(MASK.mean())


def test_a_tiny_map_with_structure_is_not_empty():
    # The empty rule is relative: small values are not an empty map, a flat one is.
    assert label_map(1e-9 * MASK.astype(float), MASK)[0] == "localises"


def test_a_peak_on_the_object_alone_does_not_localise():
    values = np.random.default_rng(1).random((64, 64))
    values[28, 30] = 2.0
    label, numbers = label_map(values, MASK)
    assert numbers["pointing_game"] == 1.0 and abs(numbers["auroc"] - 0.5) < 0.1
    assert label == "context"


def test_an_object_ranked_high_with_the_peak_elsewhere_is_context():
    values = 0.5 * MASK.astype(float)
    values[60, 60] = 1.0
    label, numbers = label_map(values, MASK)
    assert numbers["pointing_game"] == 0.0 and numbers["auroc"] > 0.99
    assert label == "context"


def _ranked(pos: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """A 2x10 map: 10 mask pixels with values ``pos`` and 10 background pixels 0.5, 1.5, ..., 9.5, so the AUROC is
    the share of the 100 (mask, background) pairs whose mask value is higher."""
    values = np.array([pos, [j + 0.5 for j in range(10)]], float)
    mask = np.array([[True] * 10, [False] * 10])
    return values, mask


@pytest.mark.parametrize(("pos", "want_auroc", "want"), [
    ([100.0] + [8.75] * 6 + [2.0] * 3, 0.70, "localises"),  # 10 + 54 + 6 = 70 pairs won
    ([100.0] + [8.75] * 6 + [2.0] * 2 + [1.0], 0.69, "context"),  # one pair fewer
])
def test_the_localises_threshold_is_auroc_0_7_with_a_pointing_hit(pos, want_auroc, want):
    values, mask = _ranked(pos)
    label, numbers = label_map(values, mask, tolerance=0)
    assert numbers["auroc"] == pytest.approx(want_auroc) and numbers["pointing_game"] == 1.0
    assert label == want


@pytest.mark.parametrize(("pos", "want_auroc", "want"), [
    ([3.0] * 10, 0.30, "inverted"),  # each beats 0.5, 1.5, 2.5: 30 pairs
    ([3.0] * 9 + [4.0], 0.31, "context"),
])
def test_the_inverted_threshold_is_auroc_0_3(pos, want_auroc, want):
    values, mask = _ranked(pos)
    label, numbers = label_map(values, mask, tolerance=0)
    assert numbers["auroc"] == pytest.approx(want_auroc) and numbers["pointing_game"] == 0.0
    assert label == want


def test_the_numbers_are_the_kits_metrics():
    values = np.exp(-(R - 6) ** 2 / 20.0) + 0.1 * np.random.default_rng(2).random((64, 64))
    _, numbers = label_map(values, MASK)
    assert numbers["auroc"] == evaluate.auroc(values, MASK)
    assert numbers["pointing_game"] == evaluate.pointing_game(values, MASK)
    assert numbers["energy_inside"] == evaluate.energy_pointing_game(values, MASK)
    assert numbers["range"] == pytest.approx(np.ptp(values))


def test_bad_masks_and_maps_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="mask: covers the whole map"):
        label_map(np.random.default_rng(0).random((4, 4)), np.ones((4, 4), bool))
    with pytest.raises(ValueError, match="mask: shape"):
        label_map(np.zeros((4, 4)), np.ones((3, 4), bool))
    with pytest.raises(ValueError, match="map2d: contains NaN"):
        label_map(np.full((4, 4), np.nan), MASK[:4, :4] | True)


def test_the_rule_text_states_every_threshold():
    text = rule_text()
    assert set(LABELS) <= {w.rstrip(":") for w in text.split()}
    for key in ("empty_rtol", "pointing_hit", "auroc_localises", "auroc_inverted"):
        assert f"{thresholds()[key]:g}" in text
