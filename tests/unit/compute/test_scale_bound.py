"""The bounded magnitude scale of channel-weighted maps (kernels.channel_token_maps, TraceView.activation_norms,
pipeline.grid_maps): the maps are the kernels' bit for bit, the norms are the sums of |act|, the bound is never
below the exact scale, and every degeneracy verdict is the one the exact scale gives, including maps between the
bound and the exact scale."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb.compute import pipeline
from vitcam_nb.compute.kernels import apply_head_rule, channel_token_maps, token_maps
from vitcam_nb.compute.pipeline import compact, finish_layers, grid_maps
from vitcam_nb.compute.view import ActivationNorms, TraceView
from vitcam_nb.core.recipe import HEAD_RULES
from vitcam_nb.core.weighting import WEIGHTINGS

CHANNEL_WEIGHTED = [n for n in WEIGHTINGS.names() if WEIGHTINGS.get(n).channel_weights is not None]


def _stored(name: str, rng: np.random.Generator, lead: tuple, channels: int) -> dict:
    if not WEIGHTINGS.get(name).scores:
        return {}
    base = rng.uniform(1.0, 2.0, lead).astype(np.float32)
    return {"scores": rng.normal(size=(*lead, channels)).astype(np.float32), "base": base, "k": channels // 2}


@pytest.fixture(scope="module")
def traces():
    from vitcam_testing import make_input, make_model

    model, x = make_model("vit"), make_input("vit")
    return {dtype: vc.trace(model, x, targets="top2", dtype=dtype) for dtype in ("float32", "float16")}


def test_the_channel_weighted_kernels_are_the_ones_written_as_sum_alpha_a():
    # Containment, not the exact list: a weighting registered later with channel weights joins the tests below.
    assert {"gradcam", "gradcampp", "xgradcam", "scorecam", "ablationcam", "gscorecam"} <= set(CHANNEL_WEIGHTED)
    assert not {"hirescam", "layercam", "gradient", "eigencam"} & set(CHANNEL_WEIGHTED)
    A = np.ones((2, 3), np.float32)
    assert channel_token_maps(A, A, "hirescam", slice(None), slice(None), 1) is None


@pytest.mark.parametrize("name", CHANNEL_WEIGHTED)
@pytest.mark.parametrize("groups", [1, 4])
def test_maps_are_the_kernels_and_the_bound_covers_the_exact_scale(name, groups):
    rng = np.random.default_rng(groups)
    lead, T, C = (3, 2), 10, 64
    # Heavy tails and one all-positive slice with equal weights, where the bound is tight and only its slack
    # covers the exact scale's rounding.
    A = rng.standard_cauchy((*lead, T, C)).astype(np.float32)
    G = rng.standard_cauchy((*lead, T, C)).astype(np.float32)
    A[0, 0] = rng.uniform(1, 2, (T, C))
    G[0, 0] = 1.0
    wmask, patch = compact(np.arange(T) > 0), compact(np.arange(T) > 0)
    stored = _stored(name, rng, lead, C)
    exact_maps, exact_scale = token_maps(A, G, name, wmask, patch, groups, **stored)
    maps, scale, norms = channel_token_maps(A, G, name, wmask, patch, groups, **stored)
    assert np.array_equal(maps, exact_maps) and np.array_equal(scale, exact_scale)
    np.testing.assert_allclose(norms, np.abs(A[..., patch, :]).reshape(*lead, T - 1, groups, -1).sum(-1), rtol=1e-6)
    maps, bound, new = channel_token_maps(A, G, name, wmask, patch, groups, norms, **stored)
    assert new is None and np.array_equal(maps, exact_maps)
    assert np.all(bound >= exact_scale)
    for rule in HEAD_RULES:
        assert np.all(apply_head_rule(maps, bound, rule)[1] >= apply_head_rule(maps, exact_scale, rule)[1])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_map_keeps_its_cells_norms_with_the_view_and_only_those(traces, dtype):
    tr = traces[dtype].copy()  # a new Dataset: a view of its own, nothing cached yet
    view = TraceView.of(tr)
    act = tr["act"].values.astype(np.float32)
    patch, heads = view.patch, int(tr.attrs["num_heads"])
    cells = view.activation_norms(heads, slice(1, 2), 1)
    assert cells.get() is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vc.cam(tr, vc.Recipe(site="F3", layer=1, heads="max"))
    norms = cells.get()
    np.testing.assert_allclose(norms[0], np.abs(act[1, 1][patch]).reshape(patch.size, heads, -1).sum(-1), rtol=1e-6)
    assert view.norms[heads][1].sum() == 1 and 1 not in view.norms  # that cell, those groups only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vc.gallery(tr, vc.Recipe(), vary={"layer": "all", "site": ["F1", "F4"]})
    every = view.activation_norms(1, slice(None), slice(None))
    assert every.get() is None  # F3, F5 and F6 not yet
    for site in ("F1", "F4"):
        pos = view.sites.index(site)
        np.testing.assert_allclose(view.activation_norms(1, slice(None), pos).get(),
                                   np.abs(act[:, pos][:, patch]).sum(-1, keepdims=True), rtol=1e-6)


def test_verdicts_near_the_threshold_are_the_exact_scales(traces):
    tr = traces["float32"]
    view = TraceView.of(tr)
    rng = np.random.default_rng(0)
    T, C = view.kinds.size, tr.sizes["channel"]
    # Maps that are a constant plus a ripple swept across the noise threshold: some are decided by the bound
    # alone, and some only by the exact scale.
    ripple = np.logspace(-8, -2, 40)[:, None, None]
    A = (rng.normal(size=(1, 1, C)) + ripple * rng.normal(size=(1, T, C))).astype(np.float32)
    G = rng.normal(size=(40, T, C)).astype(np.float32)
    wmask, patch = compact(np.ones(T, bool)), compact(view.patch)
    cells = ActivationNorms(np.zeros((40, 1, patch.stop - patch.start, 1), np.float32), np.zeros((40, 1), bool),
                            slice(None), 0)
    recipe = vc.Recipe(relu="none", weight_tokens="all")
    exact = finish_layers(view, recipe, *grid_maps(view, recipe, A, G, wmask, patch, 1))[1]
    first = finish_layers(view, recipe, *grid_maps(view, recipe, A, G, wmask, patch, 1, norms=cells))[1]
    assert cells.get() is not None
    raw, scale, zero = grid_maps(view, recipe, A, G, wmask, patch, 1, norms=cells)
    bounded = finish_layers(view, recipe, raw, scale, zero)[1]
    assert np.array_equal(first, exact) and np.array_equal(bounded, exact)
    assert 0 < (exact != "").sum() < 40
    # The bound alone would have called some real maps noise: the exact scale was needed for them.
    _, bound, _ = channel_token_maps(A, G, "gradcam", wmask, patch, 1, cells.get())
    span = raw.max(axis=(-2, -1)) - raw.min(axis=(-2, -1))
    by_bound_alone = span <= view.rtol * bound.max(axis=(-2, -1))
    assert np.any(by_bound_alone & (exact == ""))


@pytest.mark.parametrize("weighting", ["gradcam", "gradcampp", "xgradcam"])
def test_cams_equal_the_exact_scales_bit_for_bit_where_the_bound_cannot_decide(traces, weighting, monkeypatch):
    # Each (layer, site) of the trace made a constant plus a ripple of its own size, from 1e-8 to 1e-2 of it:
    # across the cells the maps go from rounding noise to real, through the band only the exact scale decides.
    tr = traces["float32"].copy(deep=True)
    act = tr["act"].values
    rng = np.random.default_rng(1)
    ripple = np.logspace(-8, -2, act.shape[0] * act.shape[1]).reshape(act.shape[:2])
    act[...] = rng.normal(size=act.shape[-1]) + ripple[..., None, None] * rng.normal(size=act.shape)
    tr = tr.assign(act=(tr["act"].dims, act))
    recipes = [vc.Recipe(weighting=weighting, site=s, layer=layer, relu=r, weight_tokens="all")
               for s in tr["site"].values.tolist() for layer in range(tr.sizes["layer"]) for r in ("after", "none")]
    exact_calls = []
    token_maps_of = pipeline.token_maps

    def counted(A, *args, **kwargs):
        exact_calls.append(A.shape)
        return token_maps_of(A, *args, **kwargs)

    monkeypatch.setattr(pipeline, "token_maps", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = [vc.cam(tr, r) for r in recipes]
        assert exact_calls, "no map needed the exact scale: the test no longer reaches it"
        monkeypatch.setattr(pipeline, "channel_token_maps", lambda *a, **k: None)
        slow = [vc.cam(tr, r) for r in recipes]
    assert 0 < sum(m.attrs["degenerate"] != "" for m in slow) < len(slow)
    for f, s in zip(fast, slow):
        assert np.array_equal(f.values, s.values) and f.attrs["degenerate"] == s.attrs["degenerate"]
