"""Grad-CAM (Selvaraju et al. 2017): channel weights are the gradients' mean over the weight tokens.

Example:
    >>> A = np.ones((3, 2), np.float32)
    >>> kernel(A, A, np.array([1, 2]), np.array([1, 2]), 1)[0][..., 0]
    array([2., 2.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vitcam_nb.compute import torch_kernels as tk
from vitcam_nb.compute.channel_maps import weighted_channels
from vitcam_nb.core.weighting import Weighting, register_weighting

# The weighting is reached through its registration (WEIGHTINGS.get(name)); its functions are not API.
__all__ = ["FORMULA", "ORDER"]

ORDER = 0  # first in menus and sweeps: the default weighting
FORMULA = ("alpha_k = mean over weight tokens of G[t,k]; map[t] = sum_k alpha_k A[t,k] "
           "(Selvaraju et al. 2017)")


def channel_weights(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any) -> np.ndarray:
    """alpha_k = mean over weight tokens of G[t,k]."""
    return G[..., wmask, :].mean(axis=-2)


def kernel(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """alpha_k = mean over weight tokens of G[t,k]."""
    return weighted_channels(A, channel_weights(A, G, wmask, patch), patch, groups)


def torch_kernel(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> tk.Maps:
    """alpha_k = mean over weight tokens of G[t,k]."""
    return tk.weighted_channels(A, G[..., wmask, :].mean(dim=-2), patch, groups)


def reference(A: np.ndarray, G: np.ndarray, wmask: np.ndarray, patch: np.ndarray) -> np.ndarray:
    return A[patch] @ G[wmask].mean(0)


register_weighting(Weighting("gradcam", FORMULA, kernel, pools_tokens=True, channel_weights=channel_weights,
                             torch_kernel=torch_kernel, reference=reference, zero_from_zero_gradient=True),
                   replace=True)
