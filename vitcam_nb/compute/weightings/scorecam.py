"""Score-CAM (Wang et al. 2020): channel weights are the softmax of the target scores ``vc.score`` stored, one
per channel's masked input.

Example:
    >>> A = np.ones((2, 2), np.float32)
    >>> kernel(A, None, None, np.arange(2), 1, scores=np.zeros(2, np.float32), base=None, k=None)[0][..., 0]
    array([1., 1.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vitcam_nb.compute import torch_kernels as tk
from vitcam_nb.compute.channel_maps import softmax_channels, weighted_channels
from vitcam_nb.core.weighting import Weighting, register_weighting

# The weighting is reached through its registration (WEIGHTINGS.get(name)); its functions are not API.
__all__ = ["FORMULA", "ORDER"]

ORDER = 9
FORMULA = ("alpha = softmax over channels k of s_k, s_k the target logit of the input multiplied by "
           "channel k's patch map, upsampled bilinearly (align_corners=True) to the input and min-max normalised "
           "(x - min) / (max - min + 1e-8); map[t] = sum_k alpha_k A[t,k]; scores from vc.score "
           "(Wang et al. 2020, as in pytorch-grad-cam 1.5.7)")


def channel_weights(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, *, scores: np.ndarray,
                    base: np.ndarray, k: int | None) -> np.ndarray:
    """alpha = softmax over channels of the stored scores."""
    return softmax_channels(scores)


def kernel(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int, *, scores: np.ndarray,
           base: np.ndarray, k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """alpha = softmax over channels of the stored scores; map[t] = sum_k alpha_k A[t,k]."""
    return weighted_channels(A, channel_weights(A, G, wmask, patch, scores=scores, base=base, k=k), patch, groups)


def torch_kernel(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int, *, scores: torch.Tensor,
                 base: torch.Tensor, k: int | None) -> tk.Maps:
    """alpha = softmax over channels of the stored scores; map[t] = sum_k alpha_k A[t,k]."""
    return tk.weighted_channels(A, tk.softmax_channels(scores), patch, groups)


def reference(A: np.ndarray, G: np.ndarray, wmask: np.ndarray, patch: np.ndarray, *, scores: np.ndarray,
              base: float, k: int | None) -> np.ndarray:
    e = np.exp(scores - scores.max())
    return A[patch] @ (e / e.sum())


register_weighting(Weighting("scorecam", FORMULA, kernel, uses_gradient=False, all_channels=True, title="Score-CAM",
                             scores="score", channel_weights=channel_weights, torch_kernel=torch_kernel,
                             reference=reference), replace=True)
