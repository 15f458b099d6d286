"""HiResCAM (Draelos & Carin 2020): gradient times activation, summed over channels at each token.

Example:
    >>> A = np.eye(3, 2, dtype=np.float32); G = np.ones((3, 2), np.float32)
    >>> kernel(A, G, None, np.arange(3), 1)[0][..., 0]
    array([1., 1., 0.], dtype=float32)
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

ORDER = 1
FORMULA = "map[t] = sum_k G[t,k] A[t,k] (Draelos & Carin 2020)"


def kernel(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """map[t] = sum_k G[t,k] A[t,k]."""
    return summed_channels(G[..., patch, :] * A[..., patch, :], groups)


def torch_kernel(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> tk.Maps:
    """map[t] = sum_k G[t,k] A[t,k]."""
    return tk.summed_channels(G[..., patch, :] * A[..., patch, :], groups)


def reference(A: np.ndarray, G: np.ndarray, wmask: np.ndarray, patch: np.ndarray) -> np.ndarray:
    return (G[patch] * A[patch]).sum(1)


register_weighting(Weighting("hirescam", FORMULA, kernel, torch_kernel=torch_kernel, reference=reference,
                             zero_from_zero_gradient=True), replace=True)
