"""Issue 52 (Reliability IV), findings 1 and 14: ``shapley_agreement`` reads a map and the values by their
dimension names, and refuses a map and values that are not of one input (class, input size, image hash).

The reference is computed here: the map pooled by hand over each group of a (2, 4) grid in (y, x) order and the
Spearman correlation of ``scipy.stats``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import xarray as xr
from scipy import stats

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb import evaluate as ev
from vitcam_nb.models import sample_image

MODEL = vc.load_model("shapes-vit")
IMAGE = sample_image("shapes", 1)
OTHER = sample_image("shapes", 2)
TR = vc.trace(MODEL, IMAGE, targets="top2")
TR_OTHER = vc.trace(MODEL, OTHER, targets="top2")
PHI = ev.shapley_patches(MODEL, TR, grid=(2, 4), progress=False)  # the predicted class, 256 passes


def _cam(trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vc.cam(trace, recipe)


MAP = _cam(TR, Recipe(site="F4", layer=3))


def _by_hand(m: np.ndarray, phi: np.ndarray) -> float:
    pooled = m.reshape(2, 32, 4, 16).mean(axis=(1, 3))
    return float(stats.spearmanr(pooled.ravel(), phi.ravel())[0])


def test_a_transposed_map_or_transposed_values_give_the_same_verdict():
    want = _by_hand(MAP.values.astype(np.float64), PHI.values)
    assert ev.shapley_agreement(MAP, PHI).attrs["value"] == pytest.approx(want, abs=1e-12)
    # Before: (x, y) was read as (y, x) and the verdict changed without a word.
    assert _by_hand(MAP.values.T.astype(np.float64), PHI.values) != pytest.approx(want, abs=1e-6)
    for sal, phi in [(MAP.transpose("x", "y"), PHI), (MAP, PHI.transpose("gx", "gy")),
                     (MAP.transpose("x", "y"), PHI.transpose("gx", "gy"))]:
        got = ev.shapley_agreement(sal, phi)
        assert got.attrs["value"] == pytest.approx(want, abs=1e-12)
        assert got.dims == ("gy", "gx")


def test_a_token_grid_map_is_read_by_its_names_too():
    grid = _cam(TR, Recipe(site="F4", layer=3, upsample="none"))  # (patch_row, patch_col), 8 x 8
    want = float(ev.shapley_agreement(grid, PHI).attrs["value"])
    assert ev.shapley_agreement(grid.transpose("patch_col", "patch_row"), PHI).attrs["value"] == want


@pytest.mark.parametrize("arg, dims", [("saliency", ("a", "b")), ("saliency", ("y", "gx")), ("values", ("y", "x"))])
def test_dimensions_of_no_known_name_are_refused(arg, dims):
    sal = MAP.rename(dict(zip(MAP.dims, dims))) if arg == "saliency" else MAP
    phi = PHI.rename(dict(zip(PHI.dims, dims))) if arg == "values" else PHI
    with pytest.raises(vc.ArgumentError, match=f"^{arg}: dimensions"):
        ev.shapley_agreement(sal, phi)


def test_values_of_another_class_are_refused():
    second = int(TR["target_class"].values[1])  # the class ranked 2
    phi2 = ev.shapley_patches(MODEL, TR, grid=(2, 4), target=second, progress=False)
    with pytest.raises(vc.ArgumentError, match="^values: Shapley values of class"):
        ev.shapley_agreement(MAP, phi2)  # a top-1 map, values of the second class (found from the values' trace)
    with pytest.raises(vc.ArgumentError, match="^values: Shapley values of class"):
        ev.shapley_agreement(MAP, phi2, trace=TR)
    # the map of that class agrees with them
    of_second = _cam(TR, Recipe(site="F4", layer=3, class_=second))
    assert ev.shapley_agreement(of_second, phi2).attrs["value"] == \
        pytest.approx(_by_hand(of_second.values.astype(np.float64), phi2.values), abs=1e-12)
    top2 = _cam(TR, Recipe(site="F4", layer=3, class_="top2"))
    assert np.isfinite(ev.shapley_agreement(top2, phi2, trace=TR).attrs["value"])


def test_values_of_another_input_size_are_refused():
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 2))
    small = ev.shapley_patches(net, torch.randn(1, 3, 32, 32), grid=(2, 4), target=0, progress=False)
    with pytest.raises(vc.ArgumentError, match="^saliency: a 64x64 map at the input size, but the values .* 32x32"):
        ev.shapley_agreement(MAP, small)


def test_values_of_another_image_are_refused_with_the_trace_and_named_without_it():
    phi_other = ev.shapley_patches(MODEL, TR_OTHER, grid=(2, 4), progress=False)
    assert phi_other.attrs["input_sha256"] == TR_OTHER.attrs["input_sha256"] != TR.attrs["input_sha256"]
    with pytest.raises(vc.ArgumentError, match="^values: computed on another image than the trace's"):
        ev.shapley_agreement(MAP, phi_other, trace=TR)
    with pytest.warns(ev.MetricWarning, match="not checked that the map and the values are of one input"):
        got = ev.shapley_agreement(MAP, phi_other)
    assert "image" in got.attrs["unchecked"]
    # Values computed from a pixel array carry the same hash as the trace of that array.
    from_pixels = ev.shapley_patches(MODEL, IMAGE, grid=(2, 4), progress=False)
    assert from_pixels.attrs["input_sha256"] == TR.attrs["input_sha256"]
    assert ev.shapley_agreement(MAP, from_pixels, trace=TR).attrs["unchecked"] == ""


def test_a_map_of_another_trace_is_refused_with_the_trace():
    with pytest.raises(vc.ArgumentError, match="^saliency: computed from trace"):
        ev.shapley_agreement(_cam(TR_OTHER, Recipe(site="F4", layer=3)), PHI, trace=TR)


def test_values_without_an_input_hash_are_named_not_silently_accepted():
    old = PHI.copy()
    for key in ("input_sha256", "trace_id", "class_rank"):
        del old.attrs[key]
    with pytest.warns(ev.MetricWarning, match="carry no input hash"):
        got = ev.shapley_agreement(MAP, old)
    assert got.attrs["value"] == pytest.approx(_by_hand(MAP.values.astype(np.float64), PHI.values), abs=1e-12)


def test_matching_map_and_values_give_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ev.shapley_agreement(MAP, PHI).attrs["unchecked"] == ""
        ev.shapley_agreement(MAP, PHI, trace=TR)
    with pytest.raises(vc.ArgumentTypeError, match="^trace: "):
        ev.shapley_agreement(MAP, PHI, trace={})
