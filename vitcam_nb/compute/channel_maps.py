"""The public helpers a channel weighting's NumPy kernel is built from (:mod:`vitcam_nb.compute.weightings`).

Each takes activations or per-token terms as (..., token, channel) float32 arrays and returns maps over the patch
tokens with their magnitude scale (the same sums over absolute terms, which tell a real map from rounding noise),
per channel group (head): ``(maps, scale)``, both (..., patch, groups).

:func:`weighted_channels` is the one to use for a map of the form ``map[t] = sum_k alpha_k A[t, k]``: its maps are
the project's bit-for-bit contract (einsum's summation order, whatever the chunking), so two weightings that give the
same ``alpha`` give the same bits, and a map store's maps equal ``vc.cam``'s. Their torch twins, for a weighting's
``torch_kernel``, are in :mod:`vitcam_nb.compute.torch_kernels` under the same names.

Example:
    >>> A = np.array([[1.0, -2.0], [3.0, 4.0]], np.float32)
    >>> maps, scale = weighted_channels(A, np.ones(2, np.float32), slice(None), 1)
    >>> maps[..., 0], scale[..., 0]
    (array([-1.,  7.], dtype=float32), array([3., 7.], dtype=float32))
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["UNIT_ROUNDOFF", "first_component", "flatten_weighted", "group_channels", "relu", "softmax_channels",
           "summed_channels", "weighted_channels"]

Maps = tuple[np.ndarray, np.ndarray]
#: About how much of A a weighted kernel reads per step: a few layers' tokens, which the scale then reads again
#: from cache; fewer, larger steps cost fewer Python calls (measured best at 2-4 ViT-B layers).
_CHUNK_BYTES = 2 << 20
#: Half float32's machine epsilon: the relative error of one float32 rounding.
UNIT_ROUNDOFF = float(np.finfo(np.float32).eps) / 2


def relu(x: np.ndarray) -> np.ndarray:
    """max(x, 0), elementwise.

    Example:
        >>> relu(np.array([-1.0, 2.0]))
        array([0., 2.])
    """
    return np.maximum(x, 0)


def group_channels(x: np.ndarray, groups: int) -> np.ndarray:
    """Split the last (channel) axis into ``groups`` equal groups: (..., K) -> (..., groups, K // groups).

    Example:
        >>> group_channels(np.arange(4), 2).tolist()
        [[0, 1], [2, 3]]
    """
    return x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)


def flatten_weighted(A: np.ndarray, alpha: np.ndarray, patch: Any, groups: int) -> tuple[np.ndarray, np.ndarray, tuple]:
    """A at the patch tokens as (n, token, group, channel) and alpha as (n, group, channel) over their common
    leading dimensions, and those dimensions.

    Example:
        >>> Ap, al, lead = flatten_weighted(np.ones((2, 3, 4)), np.ones(4), slice(1, 3), 2)
        >>> Ap.shape, al.shape, lead
        ((2, 2, 2, 2), (2, 2, 2), (2,))
    """
    Ap = group_channels(A[..., patch, :], groups)
    alpha = group_channels(alpha, groups)
    lead = np.broadcast_shapes(Ap.shape[:-3], alpha.shape[:-2])
    Ap = np.broadcast_to(Ap, (*lead, *Ap.shape[-3:])).reshape(-1, *Ap.shape[-3:])
    alpha = np.broadcast_to(alpha, (*lead, *alpha.shape[-2:])).reshape(-1, *alpha.shape[-2:])
    return Ap, alpha, lead


def weighted_channels(A: np.ndarray, alpha: np.ndarray, patch: Any, groups: int,
                      norms: np.ndarray | None = None) -> Maps:
    """map[t, g] = sum_{k in g} alpha_k A[t, k] over the patch tokens, and its scale sum_{k in g} |alpha_k| |A[t, k]|.

    ``A`` is (..., token, K), ``alpha`` (..., K) (leading dimensions broadcast). The maps keep einsum's summation
    order, bit for bit the same whatever the leading shape (the contract every weighted kernel shares); the scale
    may sum in another order (it only tells a real map from rounding noise). ``norms``, if given, receives the sums
    of |A[t, k]| over each group's channels, (..., patch, groups), from the pass that computes the scale.

    Example:
        >>> A = np.ones((3, 4), np.float32)
        >>> weighted_channels(A, np.array([1, 2, 3, 4], np.float32), slice(1, 3), 2)[0]
        array([[3., 7.],
               [3., 7.]], dtype=float32)
    """
    Ap, alpha, lead = flatten_weighted(A, alpha, patch, groups)
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


def summed_channels(terms: np.ndarray, groups: int) -> Maps:
    """map[t, g] = sum_{k in g} terms[t, k] and its scale sum_{k in g} |terms[t, k]|, for weightings that combine A
    and G token by token (``terms`` already at the patch tokens).

    Example:
        >>> summed_channels(np.array([[1.0, -2.0]]), 1)
        (array([[-1.]]), array([[3.]]))
    """
    terms = group_channels(terms, groups)
    return terms.sum(axis=-1), np.abs(terms).sum(axis=-1)


def first_component(X: np.ndarray) -> Maps:
    """Projection of the centred X (..., token, K) on its first right singular vector, the largest-|value| token
    positive, as one group: (..., token, 1) maps and scales.

    Example:
        >>> first_component(np.array([[0.0, 0.0], [0.0, 0.0], [3.0, 0.0]], np.float32))[0][..., 0].tolist()
        [-1.0, -1.0, 2.0]
    """
    X = X - X.mean(axis=-2, keepdims=True)
    _, _, vt = np.linalg.svd(X, full_matrices=False)
    v = vt[..., 0, :]
    proj = np.einsum("...tk,...k->...t", X, v)
    peak = np.take_along_axis(proj, np.abs(proj).argmax(-1)[..., None], -1)
    proj = proj * np.where(peak < 0, -1, 1)
    scale = np.einsum("...tk,...k->...t", np.abs(X), np.abs(v))
    return proj[..., None], scale[..., None]


def softmax_channels(S: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, computed in float64 and returned as float32.

    Example:
        >>> softmax_channels(np.zeros(2, np.float32))
        array([0.5, 0.5], dtype=float32)
    """
    S = S.astype(np.float64)
    e = np.exp(S - S.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
