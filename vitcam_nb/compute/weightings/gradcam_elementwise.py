"""Element-wise Grad-CAM: the positive part of each gradient-activation product, summed over channels.

Example:
    >>> A = np.array([[1.0, -1.0]], np.float32); G = np.ones((1, 2), np.float32)
    >>> kernel(A, G, None, np.arange(1), 1)[0][..., 0]
    array([1.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vitcam_nb.compute import torch_kernels as tk
from vitcam_nb.compute.channel_maps import relu, summed_channels
from vitcam_nb.core.weighting import Weighting, register_weighting

# The weighting is reached through its registration (WEIGHTINGS.get(name)); its functions are not API.
__all__ = ["FORMULA", "ORDER"]

ORDER = 2
FORMULA = "map[t] = sum_k relu(G[t,k] A[t,k])"


def kernel(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """map[t] = sum_k relu(G[t,k] A[t,k])."""
    return summed_channels(relu(G[..., patch, :] * A[..., patch, :]), groups)


def torch_kernel(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> tk.Maps:
    """map[t] = sum_k relu(G[t,k] A[t,k])."""
    return tk.summed_channels(tk.relu(G[..., patch, :] * A[..., patch, :]), groups)


def reference(A: np.ndarray, G: np.ndarray, wmask: np.ndarray, patch: np.ndarray) -> np.ndarray:
    return np.maximum(G[patch] * A[patch], 0).sum(1)


register_weighting(Weighting("gradcam_elementwise", FORMULA, kernel, torch_kernel=torch_kernel, reference=reference,
                             zero_from_zero_gradient=True), replace=True)
