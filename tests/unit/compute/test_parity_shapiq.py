"""Exact Shapley values of patch groups (``vc.evaluate.shapley_patches``) against shapiq's ``ExactComputer``
(shapiq >= 1.1, the [test] extra; issue #53): the same game (a group absent = its pixels from the baseline, the
class logit of a tiny float64 timm ViT), the coalitions' inputs built here by slicing, shapiq computing the Shapley
values from all 2^n coalition values by its own formula. Agreement to 1e-6 (the kit stores its scores in float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch

import vitcam_nb.evaluate as ev


def _game(model, x, base, grid, target):
    gy, gx = grid
    h, w = x.shape[-2] // gy, x.shape[-1] // gx

    def value(coalitions: np.ndarray) -> np.ndarray:
        out = []
        for row in coalitions:
            inp = base.clone()
            for k in np.flatnonzero(row):
                r, c = divmod(int(k), gx)
                inp[..., r * h:(r + 1) * h, c * w:(c + 1) * w] = x[..., r * h:(r + 1) * h, c * w:(c + 1) * w]
            with torch.no_grad():
                out.append(float(model(inp)[0, target]))
        return np.array(out)
    return value


@pytest.mark.parametrize(("grid", "target"), [((2, 4), 2), ((2, 2), 0)])
def test_shapley_patches_equal_shapiq_exact_computer(grid, target):
    shapiq = pytest.importorskip("shapiq", reason="shapiq not installed (pip install shapiq; in the [test] extra)")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                              embed_dim=32, num_heads=2, num_classes=3)
    with torch.no_grad():  # logits of order 1, so 1e-6 is a real tolerance
        model.head.weight.normal_(0.0, 1.0)
    model = model.double().eval()
    torch.manual_seed(1)
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    base = torch.randn(1, 3, 32, 32, dtype=torch.float64) * 0.3
    phi = ev.shapley_patches(model, x, grid=grid, baseline=base, target=target, batch_size=64, progress=False)
    n = grid[0] * grid[1]
    values = shapiq.ExactComputer(_game(model, x, base, grid, target), n_players=n)("SV", order=1)
    ref = np.array([values[(k,)] for k in range(n)]).reshape(grid)
    assert np.ptp(ref) > 0.05  # the groups matter, and differently
    np.testing.assert_allclose(phi.values, ref, rtol=0, atol=1e-6)
