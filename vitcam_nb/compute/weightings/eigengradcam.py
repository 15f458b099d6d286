"""Eigen-Grad-CAM: the first principal component of gradient times activation.

Example:
    >>> A = np.array([[0.0, 0.0], [0.0, 0.0], [3.0, 0.0]], np.float32)
    >>> kernel(A, np.ones_like(A), None, np.arange(3), 1)[0][..., 0].tolist()
    [-1.0, -1.0, 2.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vitcam_nb.compute import torch_kernels as tk
from vitcam_nb.compute.channel_maps import first_component
from vitcam_nb.compute.weightings.eigencam import principal_projection
from vitcam_nb.core.weighting import Weighting, register_weighting

# The weighting is reached through its registration (WEIGHTINGS.get(name)); its functions are not API.
__all__ = ["FORMULA", "ORDER"]

ORDER = 7
FORMULA = ("projection of the centred G*A on its first right singular vector, sign fixed so "
           "that the largest-magnitude token is positive")


def kernel(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """First principal component of G * A."""
    return first_component((G * A)[..., patch, :])


def torch_kernel(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> tk.Maps:
    """First principal component of G * A."""
    return tk.first_component((G * A)[..., patch, :])


def reference(A: np.ndarray, G: np.ndarray, wmask: np.ndarray, patch: np.ndarray) -> np.ndarray:
    return principal_projection(G[patch] * A[patch])


register_weighting(Weighting("eigengradcam", FORMULA, kernel, all_channels=True, torch_kernel=torch_kernel,
                             reference=reference, zero_from_zero_gradient=True), replace=True)
