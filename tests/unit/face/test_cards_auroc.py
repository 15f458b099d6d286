"""A report card never shows the pointing game alone: a map whose maximum lies on the object while its mass lies
outside it shows an AUROC below 0.5 and its audit label beside 'pointing game: 1.000'."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb import htmlreport
from vitcam_nb.evaluate.report.card import card_scores


def _mann_whitney(values: np.ndarray, mask: np.ndarray) -> float:
    """AUROC by the rank formula written out here: average ranks over ties, U = R+ - n+(n+ + 1)/2."""
    flat, pos = values.ravel(), mask.ravel()
    order = np.argsort(flat, kind="stable")
    ranks = np.empty(flat.size)
    sorted_values = flat[order]
    start = 0
    while start < flat.size:  # each run of equal values gets the mean of the ranks it spans (1-based)
        stop = start
        while stop + 1 < flat.size and sorted_values[stop + 1] == sorted_values[start]:
            stop += 1
        ranks[order[start:stop + 1]] = (start + stop) / 2.0 + 1.0
        start = stop + 1
    n_pos = int(pos.sum())
    n_neg = flat.size - n_pos
    return (ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def _peak_on_mass_off(shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Low inside the object (about 0.11), high outside it (about 0.62), and one maximal pixel on the object."""
    rng = np.random.default_rng(0)
    h, w = shape
    mask = np.zeros(shape, bool)
    mask[h // 4: h // 2, w // 4: w // 2] = True
    values = np.where(mask, 0.11, 0.62) + rng.uniform(-0.05, 0.05, shape)
    values[h // 4 + 2, w // 4 + 2] = 1.0  # the single maximum, inside the mask
    return values, mask


@pytest.fixture(scope="module")
def tiny_trace():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=3)
    image = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    return vc.trace(model, image, targets="top1")


def test_card_scores_show_auroc_below_chance_and_a_label_beside_a_pointing_hit():
    values, mask = _peak_on_mass_off((64, 64))
    scores = card_scores(values, mask)
    assert scores["pointing game"] == 1.0
    want = _mann_whitney(values, mask)
    assert want < 0.5
    assert scores["AUROC"] == pytest.approx(want, rel=1e-12)
    assert scores["audit label"] == "inverted"  # AUROC well below 0.3: high off the object, low on it
    assert list(scores)[:3] == ["pointing game", "AUROC", "audit label"]


def test_the_auroc_matches_the_rank_formula_with_ties():
    rng = np.random.default_rng(1)
    values = rng.integers(0, 4, (20, 20)).astype(float)  # many ties: the half-counting matters
    mask = rng.random((20, 20)) < 0.3
    assert card_scores(values, mask)["AUROC"] == pytest.approx(_mann_whitney(values, mask), rel=1e-12)


def test_the_html_card_shows_auroc_and_label_next_to_the_pointing_game(tiny_trace):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        m = vc.cam(tiny_trace, vc.Recipe())
    values, mask = _peak_on_mass_off(m.shape)
    m = m.copy(data=values)
    html = htmlreport.render(tiny_trace, [htmlreport.ReportEntry("peak on, mass off", m, card_scores(m, mask))])
    items = re.findall(r"<li>([^<]*)</li>", re.search(r"<ul class='scores'>(.*?)</ul>", html, re.S).group(1))
    assert items[:3] == ["pointing game: 1.000", f"AUROC: {_mann_whitney(values, mask):.3f}", "audit label: inverted"]
    assert float(items[1].split(": ")[1]) < 0.5
