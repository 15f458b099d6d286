"""gScore-CAM (Chen et al. 2022): Score-CAM on the k channels with the largest mean gradient over patch tokens.

Example:
    >>> A = np.ones((2, 3), np.float32); G = np.array([[0, 1, 2]] * 2, np.float32)
    >>> kernel(A, G, None, np.arange(2), 1, scores=np.zeros(3, np.float32), base=None, k=2)[0][..., 0]
    array([1., 1.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vitcam_nb.capture.scoring import top_channels
from vitcam_nb.compute import torch_kernels as tk
from vitcam_nb.compute.channel_maps import softmax_channels, weighted_channels
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.weighting import Weighting, register_weighting

# The weighting is reached through its registration (WEIGHTINGS.get(name)); its functions are not API.
__all__ = ["FORMULA", "ORDER"]

ORDER = 11
FORMULA = ("Score-CAM on the k channels with the largest gradient weight mean over patch tokens of "
           "G[t,k]: alpha = softmax of their scores s_k, 0 for the other channels; map[t] = sum_k alpha_k "
           "A[t,k] (Chen et al. 2022)")


def channel_weights(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, *, scores: np.ndarray,
                    base: np.ndarray, k: int | None) -> np.ndarray:
    """Softmax of the top-k channels' scores (by mean gradient over patch tokens), 0 elsewhere."""
    if k > A.shape[-1]:
        raise RecipeError(f"k: {k} is more than the {A.shape[-1]} channels of this site")
    top = top_channels(G, patch, k)
    alpha = np.zeros(scores.shape, np.float32)
    np.put_along_axis(alpha, top, softmax_channels(np.take_along_axis(scores, top, axis=-1)), axis=-1)
    return alpha


def kernel(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int, *, scores: np.ndarray,
           base: np.ndarray, k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Score-CAM restricted to the top-k channels by mean gradient (softmax over those k only)."""
    return weighted_channels(A, channel_weights(A, G, wmask, patch, scores=scores, base=base, k=k), patch, groups)


def torch_kernel(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int, *, scores: torch.Tensor,
                 base: torch.Tensor, k: int | None) -> tk.Maps:
    """Score-CAM restricted to the top-k channels by mean gradient (softmax over those k only)."""
    if k > A.shape[-1]:
        raise RecipeError(f"k: {k} is more than the {A.shape[-1]} channels of this site")
    # capture.scoring.top_channels: ties by channel order (a stable sort of the negated weights).
    weight = G[..., patch, :].to(torch.float32).mean(dim=-2)
    top = torch.sort(-weight, dim=-1, stable=True).indices[..., :k]
    alpha = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
    alpha.scatter_(-1, top, tk.softmax_channels(torch.gather(scores, -1, top)))
    return tk.weighted_channels(A, alpha, patch, groups)


def reference(A: np.ndarray, G: np.ndarray, wmask: np.ndarray, patch: np.ndarray, *, scores: np.ndarray,
              base: float, k: int | None) -> np.ndarray:
    weight = G[patch].mean(0)
    top = sorted(range(weight.size), key=lambda c: (-weight[c], c))[:k]  # ties: the lower channel first
    alpha = np.zeros(weight.size)
    e = np.exp(scores[top] - scores[top].max())
    alpha[top] = e / e.sum()
    return A[patch] @ alpha


register_weighting(Weighting("gscorecam", FORMULA, kernel, all_channels=True, title="gScore-CAM", scores="score",
                             channel_weights=channel_weights, torch_kernel=torch_kernel, reference=reference),
                   replace=True)
