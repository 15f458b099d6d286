"""XGrad-CAM (Fu et al. 2020): channel weights are the gradients averaged with the activations as weights.

Example:
    >>> A = np.ones((3, 2), np.float32)
    >>> kernel(A, A, np.arange(3), np.arange(3), 1)[0][..., 0]
    array([2., 2., 2.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vitcam_nb.compute import torch_kernels as tk
from vitcam_nb.compute.channel_maps import weighted_channels
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.weighting import Weighting, register_weighting

# The weighting is reached through its registration (WEIGHTINGS.get(name)); its functions are not API.
__all__ = ["FORMULA", "ORDER"]

ORDER = 4
FORMULA = ("alpha_k = sum_t G[t,k] A[t,k] / (sum_t A[t,k] + 1e-7); map[t] = sum_k alpha_k A[t,k] "
           "(Fu et al. 2020)")


def channel_weights(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any) -> np.ndarray:
    """alpha_k = sum_t G[t,k] A[t,k] / (sum_t A[t,k] + 1e-7)."""
    Gw, Aw = G[..., wmask, :], A[..., wmask, :]
    return (Gw * Aw / (Aw.sum(axis=-2, keepdims=True) + 1e-7)).sum(axis=-2)


def kernel(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """alpha_k = sum_t G[t,k] A[t,k] / (sum_t A[t,k] + 1e-7)."""
    return weighted_channels(A, channel_weights(A, G, wmask, patch), patch, groups)


def torch_kernel(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> tk.Maps:
    """alpha_k = sum_t G[t,k] A[t,k] / (sum_t A[t,k] + 1e-7)."""
    Gw, Aw = G[..., wmask, :], A[..., wmask, :]
    return tk.weighted_channels(A, (Gw * Aw / (Aw.sum(dim=-2, keepdim=True) + 1e-7)).sum(dim=-2), patch, groups)


def reference(A: np.ndarray, G: np.ndarray, wmask: np.ndarray, patch: np.ndarray) -> np.ndarray:
    Gw, Aw = G[wmask], A[wmask]
    if not np.all(np.abs(Aw.sum(0)) > 1e-2):  # a comparison near the pole would test rounding, not the formula
        raise ArgumentError("A: a channel's activation sum is near 0; the reference needs well-conditioned data")
    return A[patch] @ (Gw * Aw / (Aw.sum(0) + 1e-7)).sum(0)


register_weighting(Weighting("xgradcam", FORMULA, kernel, pools_tokens=True, channel_weights=channel_weights,
                             torch_kernel=torch_kernel, reference=reference, zero_from_zero_gradient=True),
                   replace=True)
