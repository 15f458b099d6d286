"""The helpers of the weighting kernels, head rules and layer fusions in torch, beside their NumPy references in
:mod:`vitcam_nb.compute.channel_maps`, :mod:`vitcam_nb.compute.kernels` and :mod:`vitcam_nb.compute.fusion`: the
same formulas term for term, on
tensors of any device, so that maps can be computed where the trace's tensors live (a GPU) without a copy to
the host. NumPy stays the reference (and the default for traces held in memory); these equal it within float32
rounding (tests/unit/compute/test_torch_kernels.py checks every registered entry).

Each weighting's torch kernel is written in its own module of :mod:`vitcam_nb.compute.weightings` with these
helpers and attached to its registered weighting (``Weighting.torch_kernel``), so a weighting registered with a
torch function of its own is computed on the device too. Indices (``wmask``, ``patch``) are slices or integer
tensors on the tensors' device.

Example:
    >>> import torch
    >>> A = torch.ones(3, 2); G = torch.ones(3, 2)
    >>> weighted_channels(A, G[1:3].mean(dim=0), slice(1, 3), 1)[0][..., 0]
    tensor([2., 2.])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vitcam_nb.core.errors import RecipeError

# The kernels themselves live with their weighting (vitcam_nb.compute.weightings) and are reached through it
# (Weighting.torch_kernel); ``torch_kernels.gradcam`` and the like still name them (module __getattr__ below).
__all__ = ["HEAD_RULES_TORCH", "LAYER_FUSIONS_TORCH", "apply_head_rule", "first_component", "fuse", "group_channels",
           "relu", "softmax_channels", "summed_channels", "weighted_channels"]

Maps = tuple[torch.Tensor, torch.Tensor]


def relu(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0), elementwise (NaN stays NaN, as ``np.maximum``).

    Example:
        >>> relu(torch.tensor([-1.0, 2.0]))
        tensor([0., 2.])
    """
    return torch.clamp_min(x, 0)


def group_channels(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Split the last (channel) axis into ``groups`` equal groups, as ``channel_maps.group_channels``.

    Example:
        >>> group_channels(torch.arange(4), 2).tolist()
        [[0, 1], [2, 3]]
    """
    return x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)


def weighted_channels(A: torch.Tensor, alpha: torch.Tensor, patch: Any, groups: int) -> Maps:
    """map[t, g] = sum_{k in g} alpha_k A[t, k] over the patch tokens, and the same sum of absolute terms (the torch
    twin of ``channel_maps.weighted_channels``, equal to it within float32 rounding).

    Example:
        >>> weighted_channels(torch.ones(3, 2), torch.tensor([1.0, 2.0]), slice(1, 3), 1)[0][..., 0]
        tensor([3., 3.])
    """
    Ap = group_channels(A[..., patch, :], groups)
    al = group_channels(alpha, groups)
    return (torch.einsum("...tgd,...gd->...tg", Ap, al),
            torch.einsum("...tgd,...gd->...tg", Ap.abs(), al.abs()))


def summed_channels(terms: torch.Tensor, groups: int) -> Maps:
    """map[t, g] = sum_{k in g} terms[t, k] and the sum of |terms|, as ``channel_maps.summed_channels``.

    Example:
        >>> summed_channels(torch.tensor([[1.0, -2.0]]), 1)
        (tensor([[-1.]]), tensor([[3.]]))
    """
    terms = group_channels(terms, groups)
    return terms.sum(dim=-1), terms.abs().sum(dim=-1)


def first_component(X: torch.Tensor) -> Maps:
    """Projection of the centred X on its first right singular vector, the largest-|value| token positive, as
    ``channel_maps.first_component``.

    Example:
        >>> first_component(torch.tensor([[0.0, 0.0], [0.0, 0.0], [3.0, 0.0]]))[0][..., 0].tolist()
        [-1.0, -1.0, 2.0]
    """
    X = X - X.mean(dim=-2, keepdim=True)
    _, _, vt = torch.linalg.svd(X, full_matrices=False)
    v = vt[..., 0, :]
    proj = torch.einsum("...tk,...k->...t", X, v)
    peak = torch.gather(proj, -1, proj.abs().argmax(dim=-1, keepdim=True))
    proj = proj * torch.where(peak < 0, -1.0, 1.0).to(proj.dtype)
    scale = torch.einsum("...tk,...k->...t", X.abs(), v.abs())
    return proj[..., None], scale[..., None]


def softmax_channels(S: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis in float64, returned as float32, as ``channel_maps.softmax_channels``.

    Example:
        >>> softmax_channels(torch.zeros(2))
        tensor([0.5000, 0.5000])
    """
    S = S.to(torch.float64)
    e = torch.exp(S - S.amax(dim=-1, keepdim=True))
    return (e / e.sum(dim=-1, keepdim=True)).to(torch.float32)


# The private names these helpers had before they were public.
_group, _weighted, _summed, _first_component, _softmax = (group_channels, weighted_channels, summed_channels,
                                                          first_component, softmax_channels)


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


def __getattr__(name: str) -> Callable[..., Maps]:
    # ``torch_kernels.gradcam``: the torch kernel of a registered weighting, where these kernels used to be defined.
    from vitcam_nb.core.weighting import WEIGHTINGS

    if name in WEIGHTINGS and WEIGHTINGS.get(name).torch_kernel is not None:
        return WEIGHTINGS.get(name).torch_kernel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
