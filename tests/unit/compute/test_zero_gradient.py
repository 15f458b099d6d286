"""The gradient-scan shortcut of pipeline.grid_maps: only kernels that really give a zero map from zero gradients
are listed, and the degeneracy verdict equals a full scan of the gradients."""

import numpy as np
import pytest

from vitcam_nb.compute.kernels import token_maps, zero_gradient_gives_zero_map
from vitcam_nb.core.weighting import WEIGHTINGS


@pytest.mark.parametrize("name", [n for n in WEIGHTINGS.names() if zero_gradient_gives_zero_map(n)])
def test_listed_kernels_give_zero_maps_for_zero_gradients(name):
    rng = np.random.default_rng(0)
    A = rng.normal(size=(3, 9, 8)).astype(np.float32)
    G = np.zeros_like(A)
    G[1, 4, 2], A[1, 4, 2] = 0.5, 1.0  # one positive term, in the middle slice only
    wmask, patch = np.ones(9, bool), np.arange(1, 9)
    maps, _ = token_maps(A, G, name, wmask, patch, 2)
    assert np.all(maps[0] == 0) and np.all(maps[2] == 0)
    assert np.any(maps[1] != 0)


def test_unlisted_and_unknown_weightings_are_scanned():
    assert not zero_gradient_gives_zero_map("eigencam")
    assert not zero_gradient_gives_zero_map("scorecam")
    assert not zero_gradient_gives_zero_map("no-such-weighting")
