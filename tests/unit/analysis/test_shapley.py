"""Exact Shapley values of patch groups (issue #34, item 5): against a brute-force permutation reference written
here in plain Python, a known answer on an additive model, efficiency, the model handed back as it was, bad input
refused before any forward pass, and the rank agreement of a map with the values."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
import timm
import torch
from scipy import stats

import vitcam_nb as vc
import vitcam_nb.evaluate as ev
from vitcam_nb.evaluate.faithfulness.substrates import blur


def _tiny_vit(seed: int = 0, img: int = 32, dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=img, patch_size=8, depth=1,
                          embed_dim=32, num_heads=2, num_classes=3)
    with torch.no_grad():  # logits of order 1 (timm's head starts near zero), so 1e-6 is a real tolerance
        m.head.weight.normal_(0.0, 1.0)
    return m.to(dtype).eval()


def _permutation_shapley(model, x, base, grid, target):
    """Shapley values as the mean marginal contribution over all orderings of the groups, each coalition's input
    built by slicing (no code shared with the kit)."""
    gy, gx = grid
    h, w = x.shape[-2] // gy, x.shape[-1] // gx
    cache = {}

    def value(coalition: frozenset) -> float:
        if coalition not in cache:
            inp = base.clone()
            for k in coalition:
                r, c = divmod(k, gx)
                inp[..., r * h:(r + 1) * h, c * w:(c + 1) * w] = x[..., r * h:(r + 1) * h, c * w:(c + 1) * w]
            with torch.no_grad():
                cache[coalition] = float(model(inp)[0, target])
        return cache[coalition]

    n = gy * gx
    phi = [0.0] * n
    orders = list(itertools.permutations(range(n)))
    for order in orders:
        before = frozenset()
        for k in order:
            phi[k] += value(before | {k}) - value(before)
            before = before | {k}
    return np.array(phi).reshape(gy, gx) / len(orders), len(orders)


def test_four_groups_equal_the_mean_over_all_24_orderings():
    model = _tiny_vit()
    torch.manual_seed(1)
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    base = torch.randn(1, 3, 32, 32, dtype=torch.float64) * 0.3
    phi = ev.shapley_patches(model, x, grid=(2, 2), baseline=base, target=2, batch_size=5, progress=False)
    ref, n_orders = _permutation_shapley(model, x, base, (2, 2), 2)
    assert n_orders == 24
    np.testing.assert_allclose(phi.values, ref, rtol=0, atol=1e-6)
    assert phi.dims == ("gy", "gx") and phi.attrs["n_forwards"] == 16 and phi.attrs["class"] == 2
    assert np.ptp(ref) > 0.1  # the groups matter, and differently
    # efficiency: the values share out exactly the change from no group to all groups (scores are float32)
    with torch.no_grad():
        full, none = float(model(x)[0, 2]), float(model(base)[0, 2])
    assert phi.values.sum() == pytest.approx(full - none, abs=1e-6)
    assert (phi.attrs["v_all"], phi.attrs["v_none"]) == (pytest.approx(full, abs=1e-6), pytest.approx(none, abs=1e-6))
    assert phi.attrs["weights_origin"] == "random-init" and len(phi.attrs["weights_sha256"]) == 64


def test_named_baselines_are_the_blurred_image_and_the_zero_input():
    model = _tiny_vit(3)
    torch.manual_seed(4)
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    for name, tensor in (("blur", blur(x.float(), 2.0).double()), ("mean", torch.zeros_like(x))):
        named = ev.shapley_patches(model, x, (2, 2), name, target=0, blur_sigma=2.0, progress=False)
        ref, _ = _permutation_shapley(model, x, tensor, (2, 2), 0)
        np.testing.assert_allclose(named.values, ref, rtol=0, atol=1e-6, err_msg=name)
        assert named.attrs["baseline"].startswith(name)


class _Additive(torch.nn.Module):
    """Logit c = sum over groups k of a[c, k] * tanh(mean of group k's pixels): additive over the groups."""

    def __init__(self, grid, n_classes=2, seed=0):
        super().__init__()
        self.grid = grid
        gen = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(torch.randn(n_classes, grid[0] * grid[1], generator=gen))

    def contributions(self, x):
        gy, gx = self.grid
        b, c, h, w = x.shape
        means = x.reshape(b, c, gy, h // gy, gx, w // gx).mean(dim=(1, 3, 5)).reshape(b, -1)
        return torch.tanh(means)

    def forward(self, x):
        return self.contributions(x) @ self.a.T


@pytest.mark.parametrize("grid,size", [((3, 3), 48), ((4, 4), 16)])
def test_an_additive_model_gets_each_groups_own_contribution(grid, size):
    model = _Additive(grid)
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.normal(size=(1, 3, size, size)).astype(np.float32))
    phi = ev.shapley_patches(model, x, grid=grid, baseline=0.25, target=1, batch_size=4096, progress=False)
    # known answer, in NumPy: a[1, k] * (tanh(mean of group k in x) - tanh(0.25))
    gy, gx = grid
    blocks = x.numpy()[0].reshape(3, gy, size // gy, gx, size // gx).mean(axis=(0, 2, 4))
    expected = model.a.detach().numpy()[1].reshape(gy, gx) * (np.tanh(blocks) - np.tanh(0.25))
    np.testing.assert_allclose(phi.values, expected, rtol=0, atol=1e-5)
    assert phi.attrs["n_forwards"] == 2 ** (gy * gx) and phi.attrs["grid"] == f"{gy}x{gx}"


def test_the_model_is_handed_back_as_it_was():
    model = _tiny_vit(5, dtype=torch.float32).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.requires_grad for p in model.parameters()]
    x = torch.randn(1, 3, 32, 32)
    phi = ev.shapley_patches(model, x, (2, 2), "mean", progress=False)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [p.requires_grad for p in model.parameters()] == grads and all(p.grad is None for p in model.parameters())
    # no target: the class the model predicts (in eval mode) for the intact image; one more pass
    with torch.no_grad():
        predicted = int(model.eval()(x).argmax())
    assert phi.attrs["class"] == predicted and phi.attrs["n_forwards"] == 17


class _Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(2))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.net(x)


@pytest.mark.parametrize("kwargs,arg", [
    ({"grid": (3, 3)}, "grid: 3x3 groups do not tile the 32x32"),
    ({"grid": (2, 2), "baseline": "noise"}, "baseline: expected one of"),
    ({"grid": (2, 2), "baseline": torch.zeros(2, 5)}, "baseline: a tensor of shape"),
    ({"grid": (8, 8)}, "grid: 64 groups take 2^64"),
    ({"grid": (4, 4), "max_bytes": 1e5}, "grid: 16 groups take 2^16 = 65,536 forward passes"),
    ({"grid": (2, 2), "max_bytes": 1e5, "batch_size": 64}, "batch_size: 4 groups"),
    ({"grid": (2, 2), "batch_size": 0}, "batch_size: expected a positive int"),
    ({"grid": (2, 2), "score": "energy"}, "score: expected one of"),
    ({"grid": "4x4"}, "grid: expected (rows, columns)"),
])
def test_bad_input_is_refused_naming_the_argument_before_any_forward(kwargs, arg):
    model = _Counting()
    with pytest.raises(ValueError) as info:
        ev.shapley_patches(model, torch.zeros(1, 3, 32, 32), progress=False, **kwargs)
    assert str(info.value).startswith(arg)
    assert model.calls == 0


def test_agreement_is_the_spearman_of_the_map_pooled_per_group():
    rng = np.random.default_rng(0)
    values = vc.evaluate.shapley_patches(_Additive((2, 2)), torch.randn(1, 3, 8, 8), (2, 2), "mean", target=0,
                                         progress=False)
    sal = rng.normal(size=(8, 8))
    got = ev.shapley_agreement(sal, values)
    pooled = np.array([[sal[:4, :4].mean(), sal[:4, 4:].mean()], [sal[4:, :4].mean(), sal[4:, 4:].mean()]])
    np.testing.assert_allclose(got.values, pooled, rtol=0, atol=1e-12)
    assert got.attrs["value"] == pytest.approx(stats.spearmanr(pooled.ravel(), values.values.ravel())[0], abs=1e-12)
    assert got.attrs["pooling"].startswith("mean") and got.attrs["shapley_grid"] == "2x2"
    # a 6x6 token map of a 96 px input and 4x4 groups: pooled over the pixels its cells cover
    phi = np.arange(16.0).reshape(4, 4)[::-1]
    import xarray as xr

    phi_da = xr.DataArray(phi, dims=("gy", "gx"), attrs={"input_size": "96x96"})
    token = rng.normal(size=(6, 6))
    pixels = np.kron(token, np.ones((16, 16)))
    by_hand = pixels.reshape(4, 24, 4, 24).mean(axis=(1, 3))
    agree = ev.shapley_agreement(token, phi_da)
    np.testing.assert_allclose(agree.values, by_hand, rtol=0, atol=1e-12)
    assert agree.attrs["value"] == pytest.approx(stats.spearmanr(by_hand.ravel(), phi.ravel())[0], abs=1e-12)


def test_agreement_is_nan_with_a_reason_for_a_constant_map_and_refuses_a_map_off_the_grid():
    phi = np.arange(4.0).reshape(2, 2)
    with pytest.warns(ev.MetricWarning, match="pooled per group is constant"):
        assert math.isnan(ev.shapley_agreement(np.ones((4, 4)), phi).attrs["value"])
    with pytest.warns(ev.MetricWarning, match="Shapley values are all equal"):
        assert math.isnan(ev.shapley_agreement(np.eye(4), np.zeros((2, 2))).attrs["value"])
    with pytest.raises(ValueError, match="saliency: a 3x3 map does not tile the 2x2 groups"):
        ev.shapley_agreement(np.eye(3), phi)


def test_the_score_card_runs_it_when_named_and_equals_the_direct_call():
    model = _tiny_vit(2, dtype=torch.float32)
    img = np.random.default_rng(3).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    tr = vc.trace(model, img, targets="top1", sites=["F1"])
    recipes = [vc.Recipe(site="F1", layer=0), vc.Recipe(site="F1", layer=0, weighting="layercam")]
    metric = ev.METRICS.get("shapley_agreement")
    assert metric.needs == ("model",) and metric.category == "faithfulness" and not metric.by_default
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        card = ev.scorecard([tr], recipes, ["shapley_agreement"], model=model, n_boot=5, progress=False,
                            settings={"shapley": {"grid": (2, 2), "baseline": "mean"}})
        top1 = int(np.argmax(tr["logits"].values))
        values = ev.shapley_patches(model, tr, (2, 2), "mean", target=top1, progress=False)
        for j, r in enumerate(recipes):
            grid = vc.cam(tr, r.replace(class_=top1, upsample="none"))
            direct = ev.shapley_agreement(grid, values).attrs["value"]
            np.testing.assert_allclose(card["values"].values[0, j, 0], direct, rtol=1e-12, atol=1e-12)
    # not run unasked: a default score card leaves out its 2^16 passes per image
    from vitcam_nb.evaluate.scorecard.card import _metrics

    assert "shapley_agreement" not in [m.name for m in _metrics(None, True, model)]
