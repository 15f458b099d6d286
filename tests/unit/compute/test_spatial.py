"""Spatial reconstruction's fast paths (issue #23) equal the plain formulas bit for bit: the in-place
normalisation and the per-map upsample-and-normalise that galleries write into their output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vitcam_nb.compute.spatial import normalise, upsample, upsample_into


def _maps(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    maps = rng.standard_normal((3, 4, 5, 7)).astype(np.float32)
    maps[0, 1] = 2.5            # a constant map: normalised to zeros
    maps[2, 3] = -np.abs(maps[2, 3])   # all negative: "max" gives zeros
    return maps


@pytest.mark.parametrize("how", ["minmax", "max", "none"])
def test_inplace_normalise_equals_formula(how):
    x = _maps(0)
    expected = normalise(x.copy(), how)
    got = normalise(x, how, inplace=True)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)
    if how == "minmax":
        assert got is x and np.all(got[0, 1] == 0) and got.min() == 0 and got.max() == 1


@pytest.mark.parametrize("mode", ["bilinear", "bicubic", "nearest", "none"])
@pytest.mark.parametrize("how", ["minmax", "max"])
def test_upsample_into_equals_two_steps(mode, how):
    grid = _maps(1)
    size = (5, 7) if mode == "none" else (20, 21)
    out = np.full((*grid.shape[:-2], *size), np.nan, np.float32)
    got = upsample_into(out, grid, mode, how)
    assert got is out
    np.testing.assert_array_equal(got, normalise(upsample(grid, size, mode), how))


def test_upsample_matches_torch_interpolate():
    grid = _maps(2)[0]
    ours = upsample(grid, (20, 21), "bilinear")
    ref = F.interpolate(torch.from_numpy(grid)[None], size=(20, 21), mode="bilinear", align_corners=False)[0]
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-5, atol=1e-5)
