"""vc.evaluate.position_probe: a cross-validated ridge probe from a patch token's activations to its grid position,
checked against known answers (features that are / are not a function of position), NumPy's least squares, a
brute-force leave-one-out, and scikit-learn when it is installed."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import xarray as xr

import vitcam_nb as vc

probe_module = importlib.import_module("vitcam_nb.evaluate.audit.position_probe")  # the function shadows the module


def _trace(features: np.ndarray, gh: int, gw: int, *, prefix: int = 1, sites=("F1",), layers=(0,)) -> xr.Dataset:
    """A trace-like Dataset: ``prefix`` CLS-like tokens, then the patches in raster order; ``features`` is
    (layer, site, patch token, channel) and the prefix tokens get unrelated values."""
    n = gh * gw
    rows, cols = np.divmod(np.arange(n), gw)
    rng = np.random.default_rng(99)
    act = np.concatenate([rng.normal(size=(*features.shape[:2], prefix, features.shape[-1])) * 50, features], 2)
    return xr.Dataset({"act": (("layer", "site", "token", "channel"), act)},
                      coords={"layer": list(layers), "site": list(sites),
                              "token_kind": ("token", ["cls"] * prefix + ["patch"] * n),
                              "patch_row": ("token", np.r_[[-1] * prefix, rows]),
                              "patch_col": ("token", np.r_[[-1] * prefix, cols])},
                      attrs={"trace_id": "abc"})


def test_features_linear_in_position_give_r2_near_one():
    gh, gw = 8, 8
    rows, cols = np.divmod(np.arange(gh * gw), gw)
    rng = np.random.default_rng(0)
    mix = rng.normal(size=(2, 16))
    feats = np.stack([rows, cols], -1) @ mix + 0.01 * rng.normal(size=(gh * gw, 16))
    # the prefix token's row/col are -1 and its features huge: it is left out, else the fit would break
    tr = _trace(feats[None, None], gh, gw, prefix=1)
    r2 = vc.evaluate.position_probe(tr)
    assert r2.name == "position_r2" and r2.dims == ("site", "layer")
    assert float(r2.sel(site="F1", layer=0)) > 0.999
    assert r2.attrs["folds"] == 5 and r2.attrs["seed"] == 0 and r2.attrs["trace_id"] == "abc"


def test_random_features_give_r2_at_most_about_zero():
    gh, gw = 10, 10
    rng = np.random.default_rng(1)
    feats = rng.normal(size=(2, 1, gh * gw, 24))
    r2 = vc.evaluate.position_probe(_trace(feats, gh, gw, layers=(3, 7)))
    assert r2["layer"].values.tolist() == [3, 7]
    assert (r2.values < 0.1).all()


def test_a_site_that_lost_positions_scores_below_one_that_kept_them():
    gh, gw = 8, 8
    rows, cols = np.divmod(np.arange(gh * gw), gw)
    rng = np.random.default_rng(2)
    kept = np.stack([rows, cols], -1) @ rng.normal(size=(2, 12)) + 0.5 * rng.normal(size=(gh * gw, 12))
    lost = rng.normal(size=(gh * gw, 12))
    r2 = vc.evaluate.position_probe(_trace(np.stack([kept, lost])[None], gh, gw, sites=("F1", "F6")))
    assert float(r2.sel(site="F1", layer=0)) > 0.8 > 0.1 > float(r2.sel(site="F6", layer=0))
    only = vc.evaluate.position_probe(_trace(np.stack([kept, lost])[None], gh, gw, sites=("F1", "F6")), sites="F6")
    assert only["site"].values.tolist() == ["F6"] and float(only.squeeze()) == float(r2.sel(site="F6", layer=0))


def test_ridge_closed_form_tends_to_least_squares():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(40, 6)), rng.normal(size=(40, 2))
    w, b, alpha = probe_module._ridge_fit(x, y, 1e-10)
    coef = np.linalg.lstsq(np.c_[x, np.ones(40)], y, rcond=None)[0]
    assert alpha == 1e-10
    np.testing.assert_allclose(w, coef[:6], atol=1e-8)
    np.testing.assert_allclose(b, coef[6], atol=1e-8)


def test_ridge_closed_form_with_more_channels_than_tokens():
    rng = np.random.default_rng(4)
    x, y, alpha = rng.normal(size=(12, 30)), rng.normal(size=(12, 2)), 2.5
    w, b, _ = probe_module._ridge_fit(x, y, alpha)
    xc, yc = x - x.mean(0), y - y.mean(0)
    want = np.linalg.solve(xc.T @ xc + alpha * np.eye(30), xc.T @ yc)  # the normal equations, intercept free
    np.testing.assert_allclose(w, want, atol=1e-10)
    np.testing.assert_allclose(b, y.mean(0) - x.mean(0) @ want, atol=1e-10)


def test_leave_one_out_alpha_is_the_brute_force_choice():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(25, 8))
    y = x[:, :2] @ rng.normal(size=(2, 2)) + 0.7 * rng.normal(size=(25, 2))
    _, _, chosen = probe_module._ridge_fit(x, y, None)
    scale = float(np.mean(np.linalg.svd(x - x.mean(0), compute_uv=False) ** 2))
    errors = []
    for rel in probe_module.RELATIVE_ALPHAS:
        err = 0.0
        for i in range(25):  # refit without token i, predict it
            keep = np.arange(25) != i
            w, b, _ = probe_module._ridge_fit(x[keep], y[keep], rel * scale)
            err += float(((y[i] - (x[i] @ w + b)) ** 2).sum())
        errors.append(err)
    assert chosen == pytest.approx(probe_module.RELATIVE_ALPHAS[int(np.argmin(errors))] * scale)


def test_matches_scikit_learn_with_the_same_folds():
    sk = pytest.importorskip("sklearn")
    from sklearn.linear_model import Ridge
    from sklearn.metrics import r2_score
    from sklearn.model_selection import cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    assert sk
    gh, gw = 6, 7
    rows, cols = np.divmod(np.arange(gh * gw), gw)
    rng = np.random.default_rng(6)
    feats = np.stack([np.sin(rows), cols], -1) @ rng.normal(size=(2, 10)) + rng.normal(size=(gh * gw, 10))
    feats[:, 3] = 1.0  # a constant channel: both keep it at 0 after standardising
    n, folds, seed, alpha = gh * gw, 4, 11, 3.0
    # the documented fold assignment: a seeded permutation of the patch tokens, split into equal parts
    order = np.random.default_rng(seed).permutation(n)
    cv = [(np.setdiff1d(np.arange(n), test), test) for test in np.array_split(order, folds)]
    y = np.stack([rows, cols], -1).astype(float)
    pred = cross_val_predict(make_pipeline(StandardScaler(), Ridge(alpha=alpha)), feats, y, cv=cv)
    want = r2_score(y, pred, multioutput="uniform_average")
    got = vc.evaluate.position_probe(_trace(feats[None, None], gh, gw), folds=folds, seed=seed, alpha=alpha)
    assert float(got.squeeze()) == pytest.approx(want, abs=1e-9)
    assert got.attrs["alpha"] == alpha


def test_a_one_row_grid_predicts_the_column_only():
    gw = 20
    feats = np.c_[np.arange(gw, dtype=float), np.ones(gw)]  # the column itself: R^2 1 on the column
    r2 = float(vc.evaluate.position_probe(_trace(feats[None, None], 1, gw), alpha=1e-9).squeeze())
    assert r2 == pytest.approx(1.0, abs=1e-6)  # the constant row is left out, not averaged in as NaN


def test_bad_input_is_refused_before_any_work():
    tr = _trace(np.zeros((1, 1, 16, 2)), 4, 4)
    with pytest.raises(TypeError, match="trace: a hierarchical"):
        vc.evaluate.position_probe(xr.DataTree(tr))
    with pytest.raises(TypeError, match="trace: expected an xarray.Dataset"):
        vc.evaluate.position_probe(tr["act"])
    with pytest.raises(ValueError, match=r"trace: missing \['act'\]"):
        vc.evaluate.position_probe(tr.drop_vars("act"))
    with pytest.raises(ValueError, match="folds: expected an int >= 2"):
        vc.evaluate.position_probe(tr, folds=1)
    with pytest.raises(ValueError, match="alpha: expected None"):
        vc.evaluate.position_probe(tr, alpha=0.0)
    with pytest.raises(ValueError, match=r"sites: \['F4'\] not in the trace"):
        vc.evaluate.position_probe(tr, sites=["F4"])
    with pytest.raises(ValueError, match=r"layers: \[5\] not in the trace"):
        vc.evaluate.position_probe(tr, layers=5)
    with pytest.raises(ValueError, match="at least 2 tokens per fold"):
        vc.evaluate.position_probe(tr, folds=10)
    store = tr.assign(act=tr["act"].expand_dims(image=2))
    with pytest.raises(ValueError, match="a store of many images"):
        vc.evaluate.position_probe(store)
