"""The weighting kernels: one small function per channel weighting, registered by name beside its formula,
and the head rules that aggregate per-head maps.

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

import dataclasses
from typing import Any

import numpy as np

from vitcam_nb.capture.scoring import top_channels
from vitcam_nb.compute import torch_kernels as tk
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.weighting import WEIGHTINGS, Weighting, register_weighting

__all__ = ["apply_head_rule", "channel_token_maps", "relu", "token_maps", "zero_gradient_gives_zero_map"]

Maps = tuple[np.ndarray, np.ndarray]
#: About how much of A a weighted kernel reads per step: a few layers' tokens, which the scale then reads again
#: from cache; fewer, larger steps cost fewer Python calls (measured best at 2-4 ViT-B layers).
_CHUNK_BYTES = 2 << 20
_UNIT_ROUNDOFF = float(np.finfo(np.float32).eps) / 2


def relu(x: np.ndarray) -> np.ndarray:
    """max(x, 0), elementwise.

    Example:
        >>> relu(np.array([-1.0, 2.0]))
        array([0., 2.])
    """
    return np.maximum(x, 0)


def _group(x: np.ndarray, groups: int) -> np.ndarray:
    return x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)


# -- weightings that pool gradients over tokens into channel weights alpha_k -------------------------------
def _flatten(A: np.ndarray, alpha: np.ndarray, patch: Any, groups: int) -> tuple[np.ndarray, np.ndarray, tuple]:
    """A at the patch tokens as (n, token, group, channel) and alpha as (n, group, channel) over their common
    leading dimensions, and those dimensions."""
    Ap = _group(A[..., patch, :], groups)
    alpha = _group(alpha, groups)
    lead = np.broadcast_shapes(Ap.shape[:-3], alpha.shape[:-2])
    Ap = np.broadcast_to(Ap, (*lead, *Ap.shape[-3:])).reshape(-1, *Ap.shape[-3:])
    alpha = np.broadcast_to(alpha, (*lead, *alpha.shape[-2:])).reshape(-1, *alpha.shape[-2:])
    return Ap, alpha, lead


def _weighted(A: np.ndarray, alpha: np.ndarray, patch: Any, groups: int, norms: np.ndarray | None = None) -> Maps:
    """map[t, g] = sum_{k in g} alpha_k A[t, k] over the patch tokens. ``norms``, if given, receives the sums
    of |A[t, k]| over each group's channels, (..., patch, groups), from the pass that computes the scale."""
    Ap, alpha, lead = _flatten(A, alpha, patch, groups)
    maps = np.empty((Ap.shape[0], *Ap.shape[-3:-1]), np.result_type(Ap, alpha))
    scale = np.empty((Ap.shape[0], groups, Ap.shape[-3], 1), maps.dtype)
    flat_norms = None if norms is None else norms.reshape(maps.shape)
    step = max(1, _CHUNK_BYTES // max(1, Ap.itemsize * int(np.prod(Ap.shape[1:]))))
    buf = np.empty((min(step, Ap.shape[0]), *Ap.shape[1:]), Ap.dtype)
    abs_alpha = np.abs(alpha)[..., None]
    # A few leading slices (layers' tokens, about 2 MB) at a time, so the scale reads them from cache right
    # after the map did: a trace's sites are tens of MB, and a second pass over them costs a memory read.
    # The map keeps einsum's summation order (its bits are the contract's); the scale only tells a real map
    # from rounding noise, so it may sum in BLAS's order, a matrix product several times faster.
    for i in range(0, Ap.shape[0], step):
        part, b = Ap[i:i + step], buf[:min(step, Ap.shape[0] - i)]
        np.einsum("ltgd,lgd->ltg", part, alpha[i:i + step], out=maps[i:i + step])
        np.abs(part, out=b)
        np.matmul(b.transpose(0, 2, 1, 3), abs_alpha[i:i + step], out=scale[i:i + step])
        if flat_norms is not None:
            np.einsum("ltgd->ltg", b, out=flat_norms[i:i + step])  # three times faster than b.sum here
    return maps.reshape(*lead, *maps.shape[-2:]), scale[..., 0].swapaxes(-1, -2).reshape(*lead, *maps.shape[-2:])


def _gradcam_alpha(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any) -> np.ndarray:
    return G[..., wmask, :].mean(axis=-2)


def gradcam(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> Maps:
    """alpha_k = mean over weight tokens of G[t,k]."""
    return _weighted(A, _gradcam_alpha(A, G, wmask, patch), patch, groups)


def _gradcampp_alpha(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any) -> np.ndarray:
    Gw, Aw = G[..., wmask, :], A[..., wmask, :]
    g2 = Gw * Gw
    a = g2 / (2 * g2 + Aw.sum(axis=-2, keepdims=True) * g2 * Gw + 1e-6)
    return (relu(Gw) * np.where(Gw != 0, a, 0)).sum(axis=-2)


def gradcampp(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> Maps:
    """alpha_k = sum_t relu(G) a, a = G^2 / (2 G^2 + (sum_t A) G^3 + 1e-6), a = 0 where G = 0."""
    return _weighted(A, _gradcampp_alpha(A, G, wmask, patch), patch, groups)


def _xgradcam_alpha(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any) -> np.ndarray:
    Gw, Aw = G[..., wmask, :], A[..., wmask, :]
    return (Gw * Aw / (Aw.sum(axis=-2, keepdims=True) + 1e-7)).sum(axis=-2)


def xgradcam(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> Maps:
    """alpha_k = sum_t G[t,k] A[t,k] / (sum_t A[t,k] + 1e-7)."""
    return _weighted(A, _xgradcam_alpha(A, G, wmask, patch), patch, groups)


# -- weightings that combine A and G token by token ------------------------------------------------------
def _summed(terms: np.ndarray, groups: int) -> Maps:
    terms = _group(terms, groups)
    return terms.sum(axis=-1), np.abs(terms).sum(axis=-1)


def hirescam(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> Maps:
    """map[t] = sum_k G[t,k] A[t,k]."""
    return _summed(G[..., patch, :] * A[..., patch, :], groups)


def gradcam_elementwise(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> Maps:
    """map[t] = sum_k relu(G[t,k] A[t,k])."""
    return _summed(relu(G[..., patch, :] * A[..., patch, :]), groups)


def layercam(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> Maps:
    """map[t] = sum_k relu(G[t,k]) A[t,k]."""
    return _summed(relu(G[..., patch, :]) * A[..., patch, :], groups)


def gradient(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> Maps:
    """map[t] = sum_k G[t,k]."""
    return _summed(G[..., patch, :], groups)


# -- projections on the first principal direction ---------------------------------------------------------
def _first_component(X: np.ndarray) -> Maps:
    """Projection of the centred X on its first right singular vector, the largest-|value| token positive."""
    X = X - X.mean(axis=-2, keepdims=True)
    _, _, vt = np.linalg.svd(X, full_matrices=False)
    v = vt[..., 0, :]
    proj = np.einsum("...tk,...k->...t", X, v)
    peak = np.take_along_axis(proj, np.abs(proj).argmax(-1)[..., None], -1)
    proj = proj * np.where(peak < 0, -1, 1)
    scale = np.einsum("...tk,...k->...t", np.abs(X), np.abs(v))
    return proj[..., None], scale[..., None]


def eigencam(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> Maps:
    """First principal component of the activations (no gradient)."""
    return _first_component(A[..., patch, :])


def eigengradcam(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int) -> Maps:
    """First principal component of G * A."""
    return _first_component((G * A)[..., patch, :])


# -- weightings read from model outputs that vc.score stored in the trace ---------------------------------------
def _softmax(S: np.ndarray) -> np.ndarray:
    S = S.astype(np.float64)
    e = np.exp(S - S.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def _scorecam_alpha(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, *, scores: np.ndarray,
                    base: np.ndarray, k: int | None) -> np.ndarray:
    return _softmax(scores)


def scorecam(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int, *, scores: np.ndarray,
             base: np.ndarray, k: int | None) -> Maps:
    """alpha = softmax over channels of the stored scores; map[t] = sum_k alpha_k A[t,k]."""
    return _weighted(A, _scorecam_alpha(A, G, wmask, patch, scores=scores, base=base, k=k), patch, groups)


def _ablationcam_alpha(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, *, scores: np.ndarray,
                       base: np.ndarray, k: int | None) -> np.ndarray:
    base = np.asarray(base, np.float64)[..., None]
    return ((base - scores) / base).astype(np.float32)


def ablationcam(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int, *, scores: np.ndarray,
                base: np.ndarray, k: int | None) -> Maps:
    """alpha_k = (s - s_k) / s, s the target score and s_k the score with channel k zeroed."""
    return _weighted(A, _ablationcam_alpha(A, G, wmask, patch, scores=scores, base=base, k=k), patch, groups)


def _gscorecam_alpha(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, *, scores: np.ndarray,
                     base: np.ndarray, k: int | None) -> np.ndarray:
    if k > A.shape[-1]:
        raise RecipeError(f"k: {k} is more than the {A.shape[-1]} channels of this site")
    top = top_channels(G, patch, k)
    alpha = np.zeros(scores.shape, np.float32)
    np.put_along_axis(alpha, top, _softmax(np.take_along_axis(scores, top, axis=-1)), axis=-1)
    return alpha


def gscorecam(A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int, *, scores: np.ndarray,
              base: np.ndarray, k: int | None) -> Maps:
    """Score-CAM restricted to the top-k channels by mean gradient (softmax over those k only)."""
    return _weighted(A, _gscorecam_alpha(A, G, wmask, patch, scores=scores, base=base, k=k), patch, groups)


for _weighting in (
    Weighting("gradcam", "alpha_k = mean over weight tokens of G[t,k]; map[t] = sum_k alpha_k A[t,k] "
              "(Selvaraju et al. 2017)", gradcam, pools_tokens=True,
              channel_weights=_gradcam_alpha),
    Weighting("hirescam", "map[t] = sum_k G[t,k] A[t,k] (Draelos & Carin 2020)", hirescam),
    Weighting("gradcam_elementwise", "map[t] = sum_k relu(G[t,k] A[t,k])", gradcam_elementwise),
    Weighting("gradcampp", "alpha_k = sum_t relu(G[t,k]) a[t,k], a = G^2 / (2 G^2 + (sum_t A[t,k]) G^3 + 1e-6), "
              "a = 0 where G = 0; map[t] = sum_k alpha_k A[t,k] (Chattopadhay et al. 2018)", gradcampp,
              pools_tokens=True, channel_weights=_gradcampp_alpha),
    Weighting("xgradcam", "alpha_k = sum_t G[t,k] A[t,k] / (sum_t A[t,k] + 1e-7); map[t] = sum_k alpha_k A[t,k] "
              "(Fu et al. 2020)", xgradcam, pools_tokens=True,
              channel_weights=_xgradcam_alpha),
    Weighting("layercam", "map[t] = sum_k relu(G[t,k]) A[t,k] (Jiang et al. 2021)", layercam),
    Weighting("eigencam", "projection of the centred activations on their first right singular vector, sign fixed "
              "so that the largest-magnitude token is positive (Muhammad & Yeasin 2020)", eigencam,
              uses_gradient=False, all_channels=True, title="EigenCAM"),
    Weighting("eigengradcam", "projection of the centred G*A on its first right singular vector, sign fixed so "
              "that the largest-magnitude token is positive", eigengradcam, all_channels=True),
    Weighting("gradient", "map[t] = sum_k G[t,k] (gradient only, as in LeGrad-style maps)", gradient),
    Weighting("scorecam", "alpha = softmax over channels k of s_k, s_k the target logit of the input multiplied by "
              "channel k's patch map, upsampled bilinearly (align_corners=True) to the input and min-max normalised "
              "(x - min) / (max - min + 1e-8); map[t] = sum_k alpha_k A[t,k]; scores from vc.score "
              "(Wang et al. 2020, as in pytorch-grad-cam 1.5.7)", scorecam, uses_gradient=False,
              all_channels=True, title="Score-CAM", scores="score", channel_weights=_scorecam_alpha),
    Weighting("ablationcam", "alpha_k = (s - s_k) / s, s the target logit and s_k the logit with channel k set to "
              "zero at every token of the site (a hook on the site's module); map[t] = sum_k alpha_k A[t,k]; scores "
              "from vc.score (Ramaswamy et al. 2020). pytorch-grad-cam 1.5.7 with its ViT ablation layer does the "
              "same only where the activation minimum is 0; elsewhere (every LayerNorm site, e.g. F1) it writes "
              "min - 1e7 into the ablated channel, which is not copied here: the channel is always set to zero",
              ablationcam, uses_gradient=False, all_channels=True, title="Ablation-CAM", scores="ablation",
              channel_weights=_ablationcam_alpha),
    Weighting("gscorecam", "Score-CAM on the k channels with the largest gradient weight mean over patch tokens of "
              "G[t,k]: alpha = softmax of their scores s_k, 0 for the other channels; map[t] = sum_k alpha_k "
              "A[t,k] (Chen et al. 2022)", gscorecam, all_channels=True, title="gScore-CAM", scores="score",
              channel_weights=_gscorecam_alpha),
):
    # Each built-in kernel's torch twin has its name in torch_kernels (the same formula on the trace's device).
    register_weighting(dataclasses.replace(_weighting, torch_kernel=getattr(tk, _weighting.name)), replace=True)


#: Kernels whose map is zero wherever the gradients they read are zero (each term has a gradient factor).
_ZERO_FROM_ZERO_GRADIENT = frozenset({gradcam, gradcampp, xgradcam, hirescam, gradcam_elementwise, layercam,
                                      gradient, eigengradcam})


def zero_gradient_gives_zero_map(weighting: str) -> bool:
    """Whether the registered kernel of ``weighting`` returns zeros when the gradients it reads are all zero, so
    that a map with a nonzero value proves them nonzero (no scan of the gradients is needed for it).

    Example:
        >>> zero_gradient_gives_zero_map("gradcam"), zero_gradient_gives_zero_map("eigencam")
        (True, False)
    """
    return weighting in WEIGHTINGS and WEIGHTINGS.get(weighting).kernel in _ZERO_FROM_ZERO_GRADIENT


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
        return (*_weighted(A, alpha, patch, groups, new_norms), new_norms)
    Ap, flat_alpha, lead = _flatten(A, alpha, patch, groups)
    maps = np.einsum("ltgd,lgd->ltg", Ap, flat_alpha).reshape(*lead, *Ap.shape[-3:-1])
    top = np.abs(_group(alpha, groups)).max(axis=-1).astype(np.float64)[..., None, :]
    # The exact scale sums K = channels per group products, then the head rule sums the groups: float32 error at
    # most (K + groups) unit roundoffs, in any order; the slack is four times that, plus the bound's own casts.
    slack = 1 + _UNIT_ROUNDOFF * 4 * (A.shape[-1] // groups + groups + 4)
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
