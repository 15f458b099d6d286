"""Grad-CAM++ (Chattopadhay et al. 2018): channel weights from the positive gradients, each scaled by a
higher-order coefficient of the gradient and the channel's activation sum.

Example:
    >>> A = np.ones((3, 2), np.float32)
    >>> kernel(A, A, np.arange(3), np.arange(3), 1)[0][..., 0].round(3)
    array([1.2, 1.2, 1.2], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vitcam_nb.compute import torch_kernels as tk
from vitcam_nb.compute.channel_maps import relu, weighted_channels
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.weighting import Weighting, register_weighting

# The weighting is reached through its registration (WEIGHTINGS.get(name)); its functions are not API.
__all__ = ["FORMULA", "ORDER"]

ORDER = 3
FORMULA = ("alpha_k = sum_t relu(G[t,k]) a[t,k], a = G^2 / (2 G^2 + (sum_t A[t,k]) G^3 + 1e-6), "
           "a = 0 where G = 0; map[t] = sum_k alpha_k A[t,k] (Chattopadhay et al. 2018)")


def channel_weights(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any) -> np.ndarray:
    """alpha_k = sum_t relu(G) a, a = G^2 / (2 G^2 + (sum_t A) G^3 + 1e-6), a = 0 where G = 0."""
    Gw, Aw = G[..., wmask, :], A[..., wmask, :]
    g2 = Gw * Gw
    a = g2 / (2 * g2 + Aw.sum(axis=-2, keepdims=True) * g2 * Gw + 1e-6)
    return (relu(Gw) * np.where(Gw != 0, a, 0)).sum(axis=-2)


def kernel(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """alpha_k = sum_t relu(G) a, a = G^2 / (2 G^2 + (sum_t A) G^3 + 1e-6), a = 0 where G = 0."""
    return weighted_channels(A, channel_weights(A, G, wmask, patch), patch, groups)


def torch_kernel(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> tk.Maps:
    """alpha_k = sum_t relu(G) a, a = G^2 / (2 G^2 + (sum_t A) G^3 + 1e-6), a = 0 where G = 0."""
    Gw, Aw = G[..., wmask, :], A[..., wmask, :]
    g2 = Gw * Gw
    a = g2 / (2 * g2 + Aw.sum(dim=-2, keepdim=True) * g2 * Gw + 1e-6)
    alpha = (tk.relu(Gw) * torch.where(Gw != 0, a, torch.zeros_like(a))).sum(dim=-2)
    return tk.weighted_channels(A, alpha, patch, groups)


def reference(A: np.ndarray, G: np.ndarray, wmask: np.ndarray, patch: np.ndarray) -> np.ndarray:
    Gw, S = G[wmask], A[wmask].sum(0)
    den = 2 * Gw**2 + S * Gw**3 + 1e-6
    if not np.all(np.abs(den[Gw != 0]) > 1e-2):  # a comparison near a pole would test rounding, not the formula
        raise ArgumentError("A, G: the Grad-CAM++ denominator is near 0; the reference needs well-conditioned data")
    a = np.where(Gw != 0, Gw**2 / den, 0)
    return A[patch] @ (np.maximum(Gw, 0) * a).sum(0)


register_weighting(Weighting("gradcampp", FORMULA, kernel, pools_tokens=True, channel_weights=channel_weights,
                             torch_kernel=torch_kernel, reference=reference, zero_from_zero_gradient=True),
                   replace=True)
