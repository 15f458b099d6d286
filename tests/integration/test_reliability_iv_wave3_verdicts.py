"""Issue 52 (Reliability IV), battery 2, verdicts: every verdict that takes two maps (or a map and a mask) reads
DataArrays by their dimension names and coordinates through one helper (``_common.aligned``), and
``shapley_agreement`` by coordinate order; ``shapley_patches`` refuses a baseline, a blur width and a model it cannot
score by name, before any pass.

References are computed here by hand with NumPy/SciPy on the maps in (y, x) order (Mann-Whitney AUROC, the mask's
share of the min-max map's energy and of the positive relevance, Spearman of the ranks, cosine of the vectors).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import xarray as xr
from scipy import stats

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb import evaluate as ev
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.data.shapes_video import shape_clips
from vitcam_nb.models import sample_image

MODEL = vc.load_model("shapes-vit")
IMAGE, _, MASK = sample_image("shapes", 1, with_mask=True)
TR = vc.trace(MODEL, IMAGE, targets="top2")


def _cam(trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vc.cam(trace, recipe)


SAL = _cam(TR, Recipe(site="F4", layer=3))
OTHER = _cam(TR, Recipe(site="F1", layer=5))
M = xr.DataArray(np.asarray(MASK, bool), dims=("y", "x"))


def _auroc(m: np.ndarray, msk: np.ndarray) -> float:
    pos, neg = m[msk], m[~msk]
    return float(stats.mannwhitneyu(pos, neg).statistic / (pos.size * neg.size))


def _energy(m: np.ndarray, msk: np.ndarray) -> float:
    e = (m - m.min()) / np.ptp(m)
    return float(e[msk].sum() / e.sum())


def _mass(m: np.ndarray, msk: np.ndarray) -> float:
    pos = np.maximum(m, 0.0)
    return float(pos[msk].sum() / pos.sum())


@pytest.mark.parametrize("metric, reference", [(ev.auroc, _auroc), (ev.energy_pointing_game, _energy),
                                               (ev.relevance_mass_accuracy, _mass)])
def test_localisation_reads_a_transposed_map_or_mask_by_its_names(metric, reference):
    s, msk = SAL.values.astype(np.float64), np.asarray(MASK, bool)
    want = reference(s, msk)
    assert reference(s.T, msk) != pytest.approx(want, abs=1e-6)  # the old positional reading: another verdict
    for sal, mask in [(SAL, M), (SAL.transpose("x", "y"), M), (SAL, M.transpose("x", "y")),
                      (SAL.transpose("x", "y"), M.transpose("x", "y"))]:
        assert metric(sal, mask) == pytest.approx(want, abs=1e-12)
    assert metric(s, msk) == pytest.approx(want, abs=1e-12)  # NumPy keeps its positional meaning


def test_localisation_aligns_by_coordinates_and_refuses_other_names_or_cells():
    s, msk = SAL.values.astype(np.float64), np.asarray(MASK, bool)
    h, w = s.shape
    sal = SAL.assign_coords(y=np.arange(h), x=np.arange(w))
    mask = M.assign_coords(y=np.arange(h), x=np.arange(w))
    want = _auroc(s, msk)
    assert ev.auroc(sal.isel(x=slice(None, None, -1)), mask) == pytest.approx(want, abs=1e-12)
    with pytest.raises(ArgumentError, match="mask: its y coordinates"):
        ev.auroc(sal, mask.assign_coords(y=np.arange(h) + 1))
    with pytest.raises(ArgumentError, match="mask: dimensions"):
        ev.auroc(sal, M.rename(y="row", x="col"))


def test_agreement_reads_a_transposed_second_map_by_its_names():
    a, b = SAL.values.astype(np.float64), OTHER.values.astype(np.float64)
    rho = float(stats.spearmanr(a.ravel(), b.ravel())[0])
    cos = float(a.ravel() @ b.ravel() / (np.linalg.norm(a) * np.linalg.norm(b)))
    assert float(stats.spearmanr(a.ravel(), b.T.ravel())[0]) != pytest.approx(rho, abs=1e-6)
    assert ev.spearman(SAL, OTHER.transpose("x", "y")) == pytest.approx(rho, abs=1e-12)
    assert ev.cosine(SAL.transpose("x", "y"), OTHER) == pytest.approx(cos, abs=1e-12)
    assert ev.topk_iou(SAL, OTHER.transpose("x", "y")) == ev.topk_iou(SAL, OTHER)


# --- shapley_agreement: coordinate order ---------------------------------------------------------------------------

PHI = ev.shapley_patches(MODEL, TR, grid=(2, 4), progress=False)
TOP1 = _cam(TR, Recipe())


def _by_hand(m: np.ndarray, phi: np.ndarray) -> float:
    pooled = m.reshape(2, 32, 4, 16).mean(axis=(1, 3))
    return float(stats.spearmanr(pooled.ravel(), phi.ravel())[0])


def _rho(*args, **kw) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(ev.shapley_agreement(*args, **kw).attrs["value"])


def test_values_with_a_group_coordinate_reversed_are_read_in_coordinate_order():
    want = _by_hand(TOP1.values.astype(np.float64), PHI.values)
    assert _by_hand(TOP1.values.astype(np.float64), PHI.values[:, ::-1]) != pytest.approx(want, abs=1e-6)
    for phi in [PHI.isel(gx=slice(None, None, -1)), PHI.isel(gx=slice(None, None, -1)).transpose(),
                PHI.isel(gy=[1, 0], gx=[2, 0, 3, 1])]:
        assert _rho(TOP1, phi, trace=TR) == pytest.approx(want, abs=1e-12)
    with pytest.raises(ArgumentError, match="values: its gx coordinates"):
        ev.shapley_agreement(TOP1, PHI.isel(gx=[0, 1]).pipe(lambda p: p.assign_coords(gx=[2, 3])))
    with pytest.raises(ArgumentError, match="values: its gx coordinate repeats"):
        ev.shapley_agreement(TOP1, PHI.assign_coords(gx=[0, 1, 1, 2]))


def test_a_map_with_coordinates_is_read_in_their_order():
    want = _by_hand(TOP1.values.astype(np.float64), PHI.values)
    h, w = TOP1.shape
    coords = TOP1.assign_coords(y=np.arange(h), x=np.arange(w))
    assert _rho(coords.isel(x=slice(None, None, -1)), PHI, trace=TR) == pytest.approx(want, abs=1e-12)


def test_a_map_flipped_after_vc_cam_is_refused_against_its_trace():
    # vc.cam gives no coordinates: a flipped map keeps the attrs that name its recipe and trace, so with trace= the
    # map is compared with vc.cam(trace, recipe) and refused, instead of flipping the verdict's sign.
    flipped = TOP1.isel(x=slice(None, None, -1))
    assert _by_hand(flipped.values.astype(np.float64), PHI.values) != pytest.approx(
        _by_hand(TOP1.values.astype(np.float64), PHI.values), abs=1e-6)
    with pytest.raises(ArgumentError, match="saliency: not the map its attrs name"):
        ev.shapley_agreement(flipped, PHI, trace=TR)
    rolled = TOP1.copy(data=np.roll(TOP1.values, 16, axis=1))
    with pytest.raises(ArgumentError, match="saliency: not the map its attrs name"):
        ev.shapley_agreement(rolled, PHI, trace=TR)
    # the map as vc.cam gave it, and its NumPy values (positional, no claim to check), are taken
    assert _rho(TOP1, PHI, trace=TR) == pytest.approx(_by_hand(TOP1.values.astype(np.float64), PHI.values), abs=1e-12)
    assert np.isfinite(_rho(flipped.values, PHI, trace=TR))


# --- shapley_patches: refused by name before any pass ---------------------------------------------------------------

class _Counting:
    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_hook(lambda *a: setattr(self, "n", self.n + 1))


def test_a_baseline_the_model_scores_as_nan_is_refused_as_the_baseline():
    with pytest.raises(ArgumentError, match="^baseline: the model scores"):
        ev.shapley_patches(MODEL, TR, grid=(2, 2), baseline=-1e30, progress=False)


@pytest.mark.parametrize("sigma", [float("inf"), 1e300, 65.0])
def test_a_blur_wider_than_the_input_is_refused_before_any_pass(sigma):
    calls = _Counting(MODEL)
    try:
        with pytest.raises(ArgumentError, match="^blur_sigma: "):
            ev.shapley_patches(MODEL, TR, grid=(2, 2), baseline="blur", blur_sigma=sigma, progress=False)
    finally:
        calls.handle.remove()
    assert calls.n == 0


def test_blur_refuses_a_non_finite_width_by_name():
    import torch

    from vitcam_nb.evaluate.faithfulness.substrates import blur
    with pytest.raises(ArgumentError, match="blur_sigma"):
        blur(torch.zeros(1, 3, 8, 8), float("inf"))


def test_a_video_model_with_a_still_image_is_refused_as_the_model_before_any_pass():
    video = vc.load_model("shapes-video")
    calls = _Counting(video)
    try:
        with pytest.raises(ArgumentError, match="^model: a video model"):
            ev.shapley_patches(video, IMAGE, grid=(2, 2), progress=False)
        with pytest.raises(ArgumentError, match="^model: a video model"):
            ev.shapley_patches(video, shape_clips(1, seed=3)[0][0], grid=(2, 2), progress=False)
    finally:
        calls.handle.remove()
    assert calls.n == 0
