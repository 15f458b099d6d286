"""The weighting kernels, looked up by name, and the head rules that aggregate per-head maps. Each channel
weighting is one module of :mod:`vitcam_nb.compute.weightings` (its kernels, formula and reference), built from the
helpers of :mod:`vitcam_nb.compute.channel_maps`; importing this module finds and registers them.

Each kernel takes activations ``A`` and gradients ``G`` as (..., token, channel) float32 arrays, the tokens
whose gradients form channel weights (``wmask``), the patch tokens (``patch``) and the number of channel
groups (heads), and returns per-group maps over the patch tokens and their magnitude scale (the same sums
over absolute terms, which tell a real map from rounding noise). Any leading dimensions (layers, sites) are
computed at once.

Example:
    >>> A = np.ones((3, 2), np.float32); G = np.ones((3, 2), np.float32)
    >>> token_maps(A, G, "gradcam", np.array([False, True, True]), np.array([1, 2]))[0][..., 0]
    array([2., 2.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from vitcam_nb.compute import weightings  # noqa: F401  (finds and registers the built-in weightings)
from vitcam_nb.compute.channel_maps import (
    UNIT_ROUNDOFF,
    first_component,
    flatten_weighted,
    group_channels,
    relu,
    softmax_channels,
    summed_channels,
    weighted_channels,
)
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.weighting import WEIGHTINGS, Weighting

__all__ = ["apply_head_rule", "channel_token_maps", "relu", "token_maps", "zero_gradient_gives_zero_map"]

Maps = tuple[np.ndarray, np.ndarray]
_UNIT_ROUNDOFF = UNIT_ROUNDOFF
# The private names the public helpers of channel_maps had here, kept for code that imported them.
_group, _flatten, _weighted, _summed, _first_component, _softmax = (
    group_channels, flatten_weighted, weighted_channels, summed_channels, first_component, softmax_channels)


def zero_gradient_gives_zero_map(weighting: str) -> bool:
    """Whether the registered kernel of ``weighting`` returns zeros when the gradients it reads are all zero, so
    that a map with a nonzero value proves them nonzero (no scan of the gradients is needed for it): the
    weighting's own ``zero_from_zero_gradient``.

    Example:
        >>> zero_gradient_gives_zero_map("gradcam"), zero_gradient_gives_zero_map("eigencam")
        (True, False)
    """
    return weighting in WEIGHTINGS and WEIGHTINGS.get(weighting).zero_from_zero_gradient


def token_maps(A: np.ndarray, G: np.ndarray, weighting: str, wmask: np.ndarray, patch: np.ndarray,
               groups: int = 1, **stored: Any) -> Maps:
    """Per-group maps over patch tokens and their magnitude scale, by the registered kernel of ``weighting``.

    ``A`` and ``G`` are (..., T, K); ``wmask`` selects the tokens that form channel weights; ``patch``
    indexes the patch tokens; ``groups`` splits channels into heads; ``stored`` holds ``scores``, ``base`` and
    ``k`` for weightings read from ``vc.score``'s outputs. Returns ``maps`` (..., P, groups) and ``scale``
    (..., P, groups).

    Example:
        >>> A = np.eye(3, 2, dtype=np.float32); G = np.ones((3, 2), np.float32)
        >>> token_maps(A, G, "hirescam", np.ones(3, bool), np.arange(3))[0][..., 0]
        array([1., 1., 0.], dtype=float32)
    """
    return _registered(weighting).kernel(A, G, wmask, patch, groups, **stored)


def channel_token_maps(A: np.ndarray, G: np.ndarray, weighting: str, wmask: Any, patch: Any, groups: int,
                       norms: np.ndarray | None = None, **stored: Any
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """:func:`token_maps` of a weighting with channel weights (``map[t] = sum_k alpha_k A[t,k]``), with the
    activation norms that bound its scale: the sums of ``|A[t,k]|`` over each group's channels at each patch
    token, (..., P, groups). Returns ``(maps, scale, new_norms)``, the maps the kernel's bit for bit, or None
    for a weighting without channel weights.

    Without ``norms``, the scale is the kernel's exact one and ``new_norms`` the norms, summed in the same pass
    over ``|A|``. With them, the scale is an upper bound (``new_norms`` None): the norms times each group's
    largest ``|alpha_k|``, never below the exact scale as the kernel computes it in float32, rounding
    included. A map that clears the bound is real; whether one below it is rounding noise takes the exact
    scale.

    Example:
        >>> A = np.array([[1.0, -2.0], [3.0, 4.0]], np.float32); G = np.ones((2, 2), np.float32)
        >>> every = slice(None)
        >>> maps, scale, norms = channel_token_maps(A, G, "gradcam", every, every, 1)
        >>> maps[..., 0], scale[..., 0], norms[..., 0]
        (array([-1.,  7.], dtype=float32), array([3., 7.], dtype=float32), array([3., 7.], dtype=float32))
        >>> channel_token_maps(A, G, "gradcam", every, every, 1, norms)[1][..., 0] >= scale[..., 0]
        array([ True,  True])
    """
    alpha_of = _registered(weighting).channel_weights
    if alpha_of is None:
        return None
    alpha = alpha_of(A, G, wmask, patch, **stored)
    if norms is None:
        tokens = np.arange(A.shape[-2])[patch].size
        new_norms = np.empty((*np.broadcast_shapes(A.shape[:-2], alpha.shape[:-1]), tokens, groups), np.float32)
        return (*weighted_channels(A, alpha, patch, groups, new_norms), new_norms)
    Ap, flat_alpha, lead = flatten_weighted(A, alpha, patch, groups)
    maps = np.einsum("ltgd,lgd->ltg", Ap, flat_alpha).reshape(*lead, *Ap.shape[-3:-1])
    top = np.abs(group_channels(alpha, groups)).max(axis=-1).astype(np.float64)[..., None, :]
    # The exact scale sums K = channels per group products, then the head rule sums the groups: float32 error at
    # most (K + groups) unit roundoffs, in any order; the slack is four times that, plus the bound's own casts.
    slack = 1 + UNIT_ROUNDOFF * 4 * (A.shape[-1] // groups + groups + 4)
    return maps, (norms * top * slack).astype(np.float32), None


def _registered(weighting: str) -> Weighting:
    if weighting not in WEIGHTINGS:
        raise RecipeError(f"weighting: unknown {weighting!r}; registered: {WEIGHTINGS.names()}")
    return WEIGHTINGS.get(weighting)


def apply_head_rule(maps: np.ndarray, scale: np.ndarray, rule: str | int) -> Maps:
    """Aggregate the trailing group (head) axis of (..., P, groups) maps by a recipe's head rule.

    Example:
        >>> m = np.array([[1.0, -3.0]])
        >>> apply_head_rule(m, np.abs(m), "relu_then_mean")[0], apply_head_rule(m, np.abs(m), 1)[0]
        (array([0.5]), array([-3.]))
    """
    groups = maps.shape[-1]
    if isinstance(rule, int):
        if rule >= groups:
            raise RecipeError(f"heads: head {rule} does not exist (the model has {groups} heads: 0..{groups - 1})")
        return maps[..., rule], scale[..., rule]
    if rule == "channels":
        return maps.sum(-1), scale.sum(-1)
    if rule == "mean_then_relu":
        return maps.mean(-1), scale.mean(-1)
    if rule == "relu_then_mean":
        return relu(maps).mean(-1), scale.mean(-1)
    return maps.max(-1), scale.max(-1)


def __getattr__(name: str) -> Callable[..., Maps]:
    # ``kernels.gradcam``: the NumPy kernel of a registered weighting, where these kernels used to be defined.
    if name in WEIGHTINGS:
        return WEIGHTINGS.get(name).kernel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
