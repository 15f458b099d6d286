"""The gradient alone, summed over channels (as in LeGrad-style maps).

Example:
    >>> G = np.array([[1.0, 2.0]], np.float32)
    >>> kernel(G, G, None, np.arange(1), 1)[0][..., 0]
    array([3.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vitcam_nb.compute import torch_kernels as tk
from vitcam_nb.compute.channel_maps import summed_channels
from vitcam_nb.core.weighting import Weighting, register_weighting

# The weighting is reached through its registration (WEIGHTINGS.get(name)); its functions are not API.
__all__ = ["FORMULA", "ORDER"]

ORDER = 8
FORMULA = "map[t] = sum_k G[t,k] (gradient only, as in LeGrad-style maps)"


def kernel(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """map[t] = sum_k G[t,k]."""
    return summed_channels(G[..., patch, :], groups)


def torch_kernel(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> tk.Maps:
    """map[t] = sum_k G[t,k]."""
    return tk.summed_channels(G[..., patch, :], groups)


def reference(A: np.ndarray, G: np.ndarray, wmask: np.ndarray, patch: np.ndarray) -> np.ndarray:
    return G[patch].sum(1)


register_weighting(Weighting("gradient", FORMULA, kernel, torch_kernel=torch_kernel, reference=reference,
                             zero_from_zero_gradient=True), replace=True)
