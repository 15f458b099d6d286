"""``vc.evaluate.position_probe`` on a generative VLM's answer trace (issue 55, item 4): the LM-side token sites
(projector, lm_resid) are probed over their image tokens at the layout's cells, against a NumPy reference fit
written here (normal equations solved directly, not the kit's SVD), on the tiny LLaVA built in code."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import vitcam_nb as vc

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_vlm_llava import ANSWER, GRID, PROMPT, make_llava, make_x  # noqa: E402

FOLDS, ALPHA, SEED = 4, 0.5, 3


@pytest.fixture(scope="module")
def trace():
    return vc.trace(make_llava(), make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=["F1", "projector", "lm_resid"])


def reference_r2(x: np.ndarray, y: np.ndarray, folds: int, alpha: float, seed: int) -> float:
    """K-fold ridge: features standardised on the training tokens (constant channel -> 0), intercept unpenalised
    (centred features and targets), w = (X^T X + alpha I)^-1 X^T (y - mean y); R^2 of the out-of-fold predictions
    per coordinate, averaged."""
    order = np.random.default_rng(seed).permutation(len(x))
    pred = np.zeros_like(y)
    for test in np.array_split(order, folds):
        train = np.setdiff1d(np.arange(len(x)), test)
        mean, std = x[train].mean(0), x[train].std(0)
        std[std == 0] = 1.0
        xtr, xte = (x[train] - mean) / std, (x[test] - mean) / std
        mx, my = xtr.mean(0), y[train].mean(0)
        w = np.linalg.solve((xtr - mx).T @ (xtr - mx) + alpha * np.eye(x.shape[1]), (xtr - mx).T @ (y[train] - my))
        pred[test] = (xte - mx) @ w + my
    return float(np.mean(1 - ((y - pred) ** 2).sum(0) / ((y - y.mean(0)) ** 2).sum(0)))


def test_lm_sites_are_probed_at_the_layout_cells_against_a_numpy_fit(trace):
    r2 = vc.evaluate.position_probe(trace, folds=FOLDS, alpha=ALPHA, seed=SEED)
    assert list(r2["site"].values) == ["F1", "projector", "lm_resid"]
    assert list(r2["layer"].values) == [0, 1, 2]  # tower blocks 0..2; LM layers 0..1; the projector's one
    rows, cols = trace["image_token_row"].values, trace["image_token_col"].values
    # the positions are the layout's cells (LLaVA: the tower's raster), not the sequence positions
    np.testing.assert_array_equal(rows * GRID + cols, np.arange(GRID * GRID))
    y = np.stack([rows, cols], -1).astype(np.float64)
    expected = reference_r2(trace["projector"].values.astype(np.float64), y, FOLDS, ALPHA, SEED)
    np.testing.assert_allclose(float(r2.sel(site="projector", layer=0)), expected, rtol=1e-6, atol=1e-9)
    for layer in (0, 1):
        x = trace["lm_resid"].values[layer].astype(np.float64)
        np.testing.assert_allclose(float(r2.sel(site="lm_resid", layer=layer)), reference_r2(x, y, FOLDS, ALPHA, SEED),
                                   rtol=1e-6, atol=1e-9)
    # no LM layer 2 and no projector layer 1: no value, not a zero
    assert np.isnan(float(r2.sel(site="lm_resid", layer=2))) and np.isnan(float(r2.sel(site="projector", layer=1)))
    # the tower site is probed as before (patch tokens, their grid)
    patch = trace["token_kind"].values == "patch"
    x = trace["act"].sel(site="F1", layer=1).values[patch].astype(np.float64)
    np.testing.assert_allclose(float(r2.sel(site="F1", layer=1)), reference_r2(x, y, FOLDS, ALPHA, SEED), rtol=1e-6)
    assert "LM decoder layer" in r2.attrs["lm_sites"]


def test_an_lm_only_trace_is_probed_and_a_missing_site_is_refused_by_name():
    tr = vc.trace(make_llava(), make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                  sites=["lm_resid"])
    r2 = vc.evaluate.position_probe(tr, sites="lm_resid", layers=[1], folds=FOLDS, alpha=ALPHA, seed=SEED)
    y = np.stack([tr["image_token_row"].values, tr["image_token_col"].values], -1).astype(np.float64)
    expected = reference_r2(tr["lm_resid"].values[1].astype(np.float64), y, FOLDS, ALPHA, SEED)
    np.testing.assert_allclose(float(r2.sel(site="lm_resid", layer=1)), expected, rtol=1e-6, atol=1e-9)
    with pytest.raises(vc.ArgumentError, match=r"sites: \['projector'\] not in the trace"):
        vc.evaluate.position_probe(tr, sites=["projector"])
