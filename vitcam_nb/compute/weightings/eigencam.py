"""EigenCAM (Muhammad & Yeasin 2020): the activations' first principal component, no gradient.

Example:
    >>> A = np.array([[0.0, 0.0], [0.0, 0.0], [3.0, 0.0]], np.float32)
    >>> kernel(A, None, None, np.arange(3), 1)[0][..., 0].tolist()
    [-1.0, -1.0, 2.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vitcam_nb.compute import torch_kernels as tk
from vitcam_nb.compute.channel_maps import first_component
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.weighting import Weighting, register_weighting

# The weighting is reached through its registration (WEIGHTINGS.get(name)); its functions are not API.
__all__ = ["FORMULA", "ORDER", "principal_projection"]

ORDER = 6
FORMULA = ("projection of the centred activations on their first right singular vector, sign fixed "
           "so that the largest-magnitude token is positive (Muhammad & Yeasin 2020)")


def kernel(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """First principal component of the activations (no gradient)."""
    return first_component(A[..., patch, :])


def torch_kernel(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> tk.Maps:
    """First principal component of the activations (no gradient)."""
    return tk.first_component(A[..., patch, :])


def principal_projection(X: np.ndarray) -> np.ndarray:
    """The reference projection of (token, channel) X on its first principal direction, largest token positive;
    refuses data whose direction or largest token is not well defined (a test would compare rounding).

    Example:
        >>> principal_projection(np.array([[0.0, 0.0], [0.0, 0.0], [3.0, 0.0]])).tolist()
        [-1.0, -1.0, 2.0]
    """
    X = X - X.mean(0)
    _, s, vt = np.linalg.svd(X)
    if not s[0] - s[1] > 1e-3 * s[0]:
        raise ArgumentError("X: the first singular vector is not well defined (two equal singular values)")
    proj = X @ vt[0]
    mag = np.sort(np.abs(proj))
    if not mag[-1] - mag[-2] > 1e-6:
        raise ArgumentError("X: the largest-|value| token is not unique, so the sign is not defined")
    return proj if proj[np.abs(proj).argmax()] > 0 else -proj


def reference(A: np.ndarray, G: np.ndarray, wmask: np.ndarray, patch: np.ndarray) -> np.ndarray:
    return principal_projection(A[patch])


register_weighting(Weighting("eigencam", FORMULA, kernel, uses_gradient=False, all_channels=True, title="EigenCAM",
                             torch_kernel=torch_kernel, reference=reference), replace=True)
