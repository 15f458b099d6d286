"""Faithfulness correlation, monotonicity correlation, SaCo, IROF and sufficiency (issue #22): known answers on a
linear model (where the exact contribution of each pixel is known), NumPy references of the formulas, seeding, and
refusals naming the argument."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import vitcam_nb as vc
import vitcam_nb.evaluate as ev
from vitcam_nb.evaluate.faithfulness.correlation import saco_coefficient


def _linear_case(seed: int = 0, size: int = 8):
    """A bias-free linear scorer on a positive input: removing pixels (setting them to 0) drops the logit by exactly
    the removed pixels' contributions, which the map holds."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(1, 3, size, size, generator=g) + 0.1
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * size * size, 2, bias=False))
    with torch.no_grad():
        net[1].weight.copy_(torch.rand(2, 3 * size * size, generator=g))
    contrib = (net[1].weight[0].view(3, size, size) * x[0]).sum(0).detach().double().numpy()
    return net, x, contrib


KW = dict(target=0, score="logit", substrate="mean", mode="pixel", progress=False)


def test_linear_model_known_answers():
    net, x, contrib = _linear_case()
    fc = ev.faithfulness_correlation(net, x, contrib, n_runs=20, subset_size=7, **KW)
    assert fc.attrs["value"] == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(fc.values, fc["saliency_sum"].values, rtol=1e-4)  # drop = removed contribution
    mc = ev.monotonicity_correlation(net, x, contrib, step=4, **KW)
    assert mc.attrs["value"] == pytest.approx(1.0)
    y = float(contrib.sum())
    np.testing.assert_allclose(mc.values, (mc["saliency_sum"].values / y) ** 2, rtol=1e-4)
    assert ev.saco(net, x, contrib, n_groups=10, **KW).attrs["value"] == pytest.approx(1.0)
    assert ev.saco(net, x, -contrib, n_groups=10, **KW).attrs["value"] == pytest.approx(-1.0)
    r = ev.irof(net, x, contrib, segments=np.arange(64).reshape(8, 8) // 4, target=0, score="logit", progress=False)
    seg = np.bincount((np.arange(64) // 4), weights=contrib.ravel())
    rel = 1 - np.concatenate([[0], np.cumsum(np.sort(seg)[::-1])]) / y
    np.testing.assert_allclose(r.values, rel, atol=1e-5)
    assert r.attrs["value"] == pytest.approx(1 - np.trapezoid(rel, dx=1 / 16), abs=1e-5)


def _saco_reference(s, d):
    """Algorithm 1 of Wu et al. (CVPR 2024), written as a loop over group pairs."""
    f = total = 0.0
    for i in range(len(s) - 1):
        for j in range(i + 1, len(s)):
            w = s[i] - s[j] if d[i] >= d[j] else -(s[i] - s[j])
            f += w
            total += abs(w)
    return f / total


def test_saco_coefficient_matches_the_papers_loop():
    rng = np.random.default_rng(4)
    for _ in range(20):
        s = np.sort(rng.random(10))[::-1]
        d = rng.normal(size=10)
        assert saco_coefficient(s, d) == pytest.approx(_saco_reference(s, d), abs=1e-12)
    with pytest.warns(ev.MetricWarning, match="same salience"):
        assert np.isnan(saco_coefficient(np.ones(4), np.arange(4.0)))


def test_saco_groups_on_a_model_match_a_numpy_reference():
    net, x, contrib = _linear_case(1)
    sal = np.random.default_rng(1).random((8, 8))
    r = ev.saco(net, x, sal, n_groups=5, **KW)
    order = np.argsort(-sal.ravel(), kind="stable")
    groups = np.array_split(order, 5)
    drops = np.array([contrib.ravel()[g].sum() for g in groups])
    np.testing.assert_allclose(r.values, drops, rtol=1e-4)
    assert r.attrs["value"] == pytest.approx(_saco_reference([sal.ravel()[g].sum() for g in groups], drops), abs=1e-9)


def test_seeded_and_recorded():
    net, x, contrib = _linear_case(2)
    sal = np.random.default_rng(2).random((8, 8))
    kw = dict(KW, substrate="nli", nli_noise=0.05)
    a = ev.faithfulness_correlation(net, x, sal, n_runs=10, subset_size=0.25, seed=3, **kw)
    b = ev.faithfulness_correlation(net, x, sal, n_runs=10, subset_size=0.25, seed=3, **kw)
    c = ev.faithfulness_correlation(net, x, sal, n_runs=10, subset_size=0.25, seed=4, **kw)
    np.testing.assert_array_equal(a.values, b.values)
    assert not np.array_equal(a["saliency_sum"].values, c["saliency_sum"].values)
    assert (a.attrs["seed"], a.attrs["subset_size"], a.attrs["n_runs"], a.attrs["subsets"]) == (3, 16, 10,
                                                                                              "seeded draw")
    m1 = ev.monotonicity_correlation(net, x, sal, step=16, n_samples=3, seed=1, **kw)
    m2 = ev.monotonicity_correlation(net, x, sal, step=16, n_samples=3, seed=1, **kw)
    np.testing.assert_array_equal(m1.values, m2.values)
    assert m1.attrs["n_samples_scored"] == 3 and m1.attrs["substrate"] == "nli"


def test_constant_map_gives_nan_with_a_reason():
    net, x, _ = _linear_case()
    with pytest.warns(ev.MetricWarning, match="faithfulness_correlation: returning NaN because the map's totals"):
        assert np.isnan(ev.faithfulness_correlation(net, x, np.ones((8, 8)), n_runs=5, subset_size=3,
                                                    **KW).attrs["value"])
    with pytest.warns(ev.MetricWarning, match="saco"):
        assert np.isnan(ev.saco(net, x, np.ones((8, 8)), n_groups=8, **KW).attrs["value"])


@pytest.mark.parametrize("call, match", [
    (lambda n, x, s: ev.faithfulness_correlation(n, x, s, n_runs=1, **KW), "n_runs"),
    (lambda n, x, s: ev.faithfulness_correlation(n, x, s, subset_size=1.5, **KW), "subset_size"),
    (lambda n, x, s: ev.faithfulness_correlation(n, x, s, subset_size=65, **KW), "subset_size"),
    (lambda n, x, s: ev.faithfulness_correlation(n, x, s, subsets=np.array([[0, 99], [1, 2]]), **KW), "subsets"),
    (lambda n, x, s: ev.monotonicity_correlation(n, x, s, step=0, **KW), "step"),
    (lambda n, x, s: ev.monotonicity_correlation(n, x, s, n_samples=0, **KW), "n_samples"),
    (lambda n, x, s: ev.monotonicity_correlation(n, x, s, eps=-1.0, **KW), "eps"),
    (lambda n, x, s: ev.saco(n, x, s, n_groups=1, **KW), "n_groups"),
    (lambda n, x, s: ev.saco(n, x, s, n_groups=10, **dict(KW, substrate="zero")), "substrate"),
    (lambda n, x, s: ev.irof(n, x, s, segments="quickshift", target=0, progress=False), "segments"),
    (lambda n, x, s: ev.irof(n, x, s, segments=np.zeros((4, 4), int), target=0, progress=False), "segments"),
    (lambda n, x, s: ev.irof(n, x, s, segments="patch", target=0, progress=False, batch_size=0), "batch_size"),
])
def test_settings_out_of_range_are_refused_naming_the_argument(call, match):
    net, x, contrib = _linear_case()
    with pytest.raises(ValueError, match=f"^{match}:"):
        call(net, x, contrib)


def test_model_calling_metrics_refuse_a_trace_of_other_weights():
    import timm

    torch.manual_seed(0)
    a = timm.create_model("vit_tiny_patch16_224", depth=1, img_size=32, patch_size=16, num_classes=3).eval()
    b = timm.create_model("vit_tiny_patch16_224", depth=1, img_size=32, patch_size=16, num_classes=3).eval()
    tr = vc.trace(a, torch.zeros(3, 32, 32), targets=0, sites=["F1"])
    sal = np.random.default_rng(0).random((2, 2))
    assert ev.saco(a, tr, sal, target=0, n_groups=2, progress=False).sizes["group"] == 2  # the model that made it
    for fn in (ev.faithfulness_correlation, ev.monotonicity_correlation, ev.saco, ev.irof):
        with pytest.raises(ValueError, match="image: the trace was made with other weights"):
            fn(b, tr, sal, target=0, progress=False)


def test_sufficiency_against_a_numpy_reference():
    rng = np.random.default_rng(7)
    protos = rng.random((3, 6, 6))
    maps = [protos[i % 3] * rng.uniform(0.5, 2) + 0.05 * rng.random((6, 6)) for i in range(12)]
    classes = [i % 3 if i != 4 else 0 for i in range(12)]
    r = ev.sufficiency(maps, classes, threshold=0.5, distance="euclidean")
    flat = np.stack([np.abs(m).ravel() / np.abs(m).max() for m in maps])
    d = np.sqrt(((flat[:, None] - flat[None]) ** 2).sum(-1))
    close = (d / d.max() <= 0.5) & ~np.eye(12, dtype=bool)
    same = np.array(classes)[:, None] == np.array(classes)[None]
    np.testing.assert_allclose(r.values, (close & same).sum(1) / close.sum(1))
    assert r.values[4] < 1.0 and r.values[2] == 1.0  # image 4 breaks its cluster's class; image 2's cluster is pure
    assert r.attrs["value"] == pytest.approx(float(np.mean(r.values)))


def test_sufficiency_reads_traces_and_refuses_bad_input():
    import xarray as xr

    traces = [xr.Dataset({"logits": ("class", np.eye(3)[c])}) for c in (0, 2)]
    r = ev.sufficiency([np.eye(3), np.eye(3) * 2], traces, threshold=1.0)
    assert r["predicted"].values.tolist() == [0, 2] and r.values.tolist() == [0.0, 0.0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = ev.sufficiency([np.eye(3), np.ones((3, 3))], [0, 0], threshold=0.5, distance="euclidean")
    assert np.isnan(r.values).all() and "no other map is within" in str(caught[0].message)
    for kw, match in [(dict(threshold=1.5), "threshold"), (dict(distance="chebyshev"), "distance")]:
        with pytest.raises(ValueError, match=f"^{match}:"):
            ev.sufficiency([np.eye(3), np.ones((3, 3))], [0, 1], **kw)
    with pytest.raises(ValueError, match="^predictions:"):
        ev.sufficiency([np.eye(3), np.ones((3, 3))], [0])
    with pytest.raises(ValueError, match="^maps:"):
        ev.sufficiency([np.eye(3), np.ones((4, 4))], [0, 1])
