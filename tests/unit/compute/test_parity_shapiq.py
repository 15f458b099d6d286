"""Exact Shapley values of patch groups (``vc.evaluate.shapley_patches``) against shapiq's ``ExactComputer``
(shapiq >= 1.1, in the [test] extra; issue #53): the same game (a group absent = its pixels from the baseline, the
class logit of a tiny float64 timm ViT), each coalition's input built by slicing in ``parity_cases.py``, shapiq
computing the Shapley values from all 2^n coalition values by its own formula. Agreement to 1e-6 (the kit stores
its scores in float32).
"""

from __future__ import annotations

import numpy as np
import pytest
from parity_cases import shapley_vs_shapiq


@pytest.mark.parametrize(("grid", "target"), [((2, 4), 2), ((2, 2), 0)])
def test_shapley_patches_equal_shapiq_exact_computer(grid, target):
    case = shapley_vs_shapiq(grid, target)
    assert case.kit.shape == case.ref.shape == grid
    assert np.ptp(case.ref) > 0.05  # the groups matter, and differently
    np.testing.assert_allclose(case.kit, case.ref, rtol=0, atol=1e-6)
