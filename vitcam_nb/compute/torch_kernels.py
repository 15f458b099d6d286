"""The weighting kernels, head rules and layer fusions in torch, beside their NumPy references in
:mod:`vitcam_nb.compute.kernels` and :mod:`vitcam_nb.compute.fusion`: the same formulas term for term, on
tensors of any device, so that maps can be computed where the trace's tensors live (a GPU) without a copy to
the host. NumPy stays the reference (and the default for traces held in memory); these equal it within float32
rounding (tests/unit/compute/test_torch_kernels.py checks every registered entry).

Each kernel is attached to its registered weighting (``Weighting.torch_kernel``), so a weighting registered
with a torch function of its own is computed on the device too. Indices (``wmask``, ``patch``) are slices or
integer tensors on the tensors' device.

Example:
    >>> import torch
    >>> A = torch.ones(3, 2); G = torch.ones(3, 2)
    >>> gradcam(A, G, slice(1, 3), slice(1, 3), 1)[0][..., 0]
    tensor([2., 2.])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vitcam_nb.core.errors import RecipeError

# The kernels themselves are reached through their registered weighting (Weighting.torch_kernel), as in kernels.
__all__ = ["HEAD_RULES_TORCH", "LAYER_FUSIONS_TORCH", "apply_head_rule", "fuse", "relu"]

Maps = tuple[torch.Tensor, torch.Tensor]


def relu(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0), elementwise (NaN stays NaN, as ``np.maximum``).

    Example:
        >>> relu(torch.tensor([-1.0, 2.0]))
        tensor([0., 2.])
    """
    return torch.clamp_min(x, 0)


def _group(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)


def _weighted(A: torch.Tensor, alpha: torch.Tensor, patch: Any, groups: int) -> Maps:
    """map[t, g] = sum_{k in g} alpha_k A[t, k] over the patch tokens, and the same sum of absolute terms."""
    Ap = _group(A[..., patch, :], groups)
    al = _group(alpha, groups)
    return (torch.einsum("...tgd,...gd->...tg", Ap, al),
            torch.einsum("...tgd,...gd->...tg", Ap.abs(), al.abs()))


def gradcam(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> Maps:
    """alpha_k = mean over weight tokens of G[t,k]."""
    return _weighted(A, G[..., wmask, :].mean(dim=-2), patch, groups)


def gradcampp(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> Maps:
    """alpha_k = sum_t relu(G) a, a = G^2 / (2 G^2 + (sum_t A) G^3 + 1e-6), a = 0 where G = 0."""
    Gw, Aw = G[..., wmask, :], A[..., wmask, :]
    g2 = Gw * Gw
    a = g2 / (2 * g2 + Aw.sum(dim=-2, keepdim=True) * g2 * Gw + 1e-6)
    alpha = (relu(Gw) * torch.where(Gw != 0, a, torch.zeros_like(a))).sum(dim=-2)
    return _weighted(A, alpha, patch, groups)


def xgradcam(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> Maps:
    """alpha_k = sum_t G[t,k] A[t,k] / (sum_t A[t,k] + 1e-7)."""
    Gw, Aw = G[..., wmask, :], A[..., wmask, :]
    return _weighted(A, (Gw * Aw / (Aw.sum(dim=-2, keepdim=True) + 1e-7)).sum(dim=-2), patch, groups)


def _summed(terms: torch.Tensor, groups: int) -> Maps:
    terms = _group(terms, groups)
    return terms.sum(dim=-1), terms.abs().sum(dim=-1)


def hirescam(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> Maps:
    """map[t] = sum_k G[t,k] A[t,k]."""
    return _summed(G[..., patch, :] * A[..., patch, :], groups)


def gradcam_elementwise(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> Maps:
    """map[t] = sum_k relu(G[t,k] A[t,k])."""
    return _summed(relu(G[..., patch, :] * A[..., patch, :]), groups)


def layercam(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> Maps:
    """map[t] = sum_k relu(G[t,k]) A[t,k]."""
    return _summed(relu(G[..., patch, :]) * A[..., patch, :], groups)


def gradient(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> Maps:
    """map[t] = sum_k G[t,k]."""
    return _summed(G[..., patch, :], groups)


def _first_component(X: torch.Tensor) -> Maps:
    """Projection of the centred X on its first right singular vector, the largest-|value| token positive."""
    X = X - X.mean(dim=-2, keepdim=True)
    _, _, vt = torch.linalg.svd(X, full_matrices=False)
    v = vt[..., 0, :]
    proj = torch.einsum("...tk,...k->...t", X, v)
    peak = torch.gather(proj, -1, proj.abs().argmax(dim=-1, keepdim=True))
    proj = proj * torch.where(peak < 0, -1.0, 1.0).to(proj.dtype)
    scale = torch.einsum("...tk,...k->...t", X.abs(), v.abs())
    return proj[..., None], scale[..., None]


def eigencam(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> Maps:
    """First principal component of the activations (no gradient)."""
    return _first_component(A[..., patch, :])


def eigengradcam(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int) -> Maps:
    """First principal component of G * A."""
    return _first_component((G * A)[..., patch, :])


def _softmax(S: torch.Tensor) -> torch.Tensor:
    S = S.to(torch.float64)
    e = torch.exp(S - S.amax(dim=-1, keepdim=True))
    return (e / e.sum(dim=-1, keepdim=True)).to(torch.float32)


def scorecam(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int, *, scores: torch.Tensor,
             base: torch.Tensor, k: int | None) -> Maps:
    """alpha = softmax over channels of the stored scores; map[t] = sum_k alpha_k A[t,k]."""
    return _weighted(A, _softmax(scores), patch, groups)


def ablationcam(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int, *, scores: torch.Tensor,
                base: torch.Tensor, k: int | None) -> Maps:
    """alpha_k = (s - s_k) / s, s the target score and s_k the score with channel k zeroed."""
    base = base.to(torch.float64)[..., None]
    return _weighted(A, ((base - scores) / base).to(torch.float32), patch, groups)


def gscorecam(A: torch.Tensor, G: torch.Tensor, wmask: Any, patch: Any, groups: int, *, scores: torch.Tensor,
              base: torch.Tensor, k: int | None) -> Maps:
    """Score-CAM restricted to the top-k channels by mean gradient (softmax over those k only)."""
    if k > A.shape[-1]:
        raise RecipeError(f"k: {k} is more than the {A.shape[-1]} channels of this site")
    # capture.scoring.top_channels: ties by channel order (a stable sort of the negated weights).
    weight = G[..., patch, :].to(torch.float32).mean(dim=-2)
    top = torch.sort(-weight, dim=-1, stable=True).indices[..., :k]
    alpha = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
    alpha.scatter_(-1, top, _softmax(torch.gather(scores, -1, top)))
    return _weighted(A, alpha, patch, groups)


def _one_head(head: int) -> Callable[[torch.Tensor, torch.Tensor], Maps]:
    return lambda maps, scale: (maps[..., head], scale[..., head])


#: head rule -> function of (maps, scale) over a trailing head axis, as ``kernels.apply_head_rule``.
HEAD_RULES_TORCH: dict[str, Callable[[torch.Tensor, torch.Tensor], Maps]] = {
    "channels": lambda maps, scale: (maps.sum(dim=-1), scale.sum(dim=-1)),
    "mean_then_relu": lambda maps, scale: (maps.mean(dim=-1), scale.mean(dim=-1)),
    "relu_then_mean": lambda maps, scale: (relu(maps).mean(dim=-1), scale.mean(dim=-1)),
    "max": lambda maps, scale: (maps.amax(dim=-1), scale.amax(dim=-1)),
}


def apply_head_rule(maps: torch.Tensor, scale: torch.Tensor, rule: str | int) -> Maps:
    """Aggregate the trailing group (head) axis of (..., P, groups) maps by a recipe's head rule (an int picks
    one head).

    Example:
        >>> m = torch.tensor([[1.0, -3.0]])
        >>> apply_head_rule(m, m.abs(), "relu_then_mean")[0], apply_head_rule(m, m.abs(), 1)[0]
        (tensor([0.5000]), tensor([-3.]))
    """
    groups = maps.shape[-1]
    if isinstance(rule, int):
        if rule >= groups:
            raise RecipeError(f"heads: head {rule} does not exist (the model has {groups} heads: 0..{groups - 1})")
        return _one_head(rule)(maps, scale)
    return HEAD_RULES_TORCH[rule](maps, scale)


#: layer fusion -> function of (layer, ..., h, w) maps, as ``fusion.fuse`` ("none" averages like "mean").
LAYER_FUSIONS_TORCH: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda maps: maps.mean(dim=0),
    "mean": lambda maps: maps.mean(dim=0),
    "sum": lambda maps: maps.sum(dim=0),
    "max": lambda maps: maps.amax(dim=0),
}


def fuse(maps: torch.Tensor, how: str) -> torch.Tensor:
    """Fuse (layer, ..., h, w) maps by a layer fusion ("none" and "mean" average; "sum"; "max").

    Example:
        >>> fuse(torch.tensor([[[0.0]], [[2.0]]]), "max")
        tensor([[2.]])
    """
    if how not in LAYER_FUSIONS_TORCH:
        raise RecipeError(f"layer_fusion: {how!r} has no torch implementation here; torch fuses "
                          f"{list(LAYER_FUSIONS_TORCH)} (rollouts are computed by vitcam_nb.compute.torch_maps)")
    return LAYER_FUSIONS_TORCH[how](maps)
