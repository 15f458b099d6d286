"""Ablation-CAM (Ramaswamy et al. 2020): a channel's weight is the relative drop of the target score when the
channel is set to zero (scores stored by ``vc.score``).

Example:
    >>> A = np.ones((2, 2), np.float32)
    >>> s = np.array([1.0, 2.0], np.float32)
    >>> kernel(A, None, None, np.arange(2), 1, scores=s, base=np.float32(4), k=None)[0][..., 0]
    array([1.25, 1.25], dtype=float32)
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

ORDER = 10
FORMULA = ("alpha_k = (s - s_k) / s, s the target logit and s_k the logit with channel k set to "
           "zero at every token of the site (a hook on the site's module); map[t] = sum_k alpha_k A[t,k]; scores "
           "from vc.score (Ramaswamy et al. 2020). pytorch-grad-cam 1.5.7 with its ViT ablation layer does the "
           "same only where the activation minimum is 0; elsewhere (every LayerNorm site, e.g. F1) it writes "
           "min - 1e7 into the ablated channel, which is not copied here: the channel is always set to zero")


def channel_weights(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, *, scores: np.ndarray,
                    base: np.ndarray, k: int | None) -> np.ndarray:
    """alpha_k = (s - s_k) / s, computed in float64."""
    base = np.asarray(base, np.float64)[..., None]
    return ((base - scores) / base).astype(np.float32)


def kernel(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int, *, scores: np.ndarray,
           base: np.ndarray, k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """alpha_k = (s - s_k) / s, s the target score and s_k the score with channel k zeroed."""
    return weighted_channels(A, channel_weights(A, G, wmask, patch, scores=scores, base=base, k=k), patch, groups)


def torch_kernel(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int, *, scores: torch.Tensor,
                 base: torch.Tensor, k: int | None) -> tk.Maps:
    """alpha_k = (s - s_k) / s, s the target score and s_k the score with channel k zeroed."""
    base = base.to(torch.float64)[..., None]
    return tk.weighted_channels(A, ((base - scores) / base).to(torch.float32), patch, groups)


def reference(A: np.ndarray, G: np.ndarray, wmask: np.ndarray, patch: np.ndarray, *, scores: np.ndarray,
              base: float, k: int | None) -> np.ndarray:
    return A[patch] @ ((base - scores) / base)


register_weighting(Weighting("ablationcam", FORMULA, kernel, uses_gradient=False, all_channels=True,
                             title="Ablation-CAM", scores="ablation", channel_weights=channel_weights,
                             torch_kernel=torch_kernel, reference=reference), replace=True)
