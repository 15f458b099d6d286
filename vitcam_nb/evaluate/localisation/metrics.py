"""Localisation: how well a map points at a ground-truth mask of the evidence.

Every function takes a 2-D saliency map and a boolean mask of the *same shape* (measure the upsampled
map, ``vc.cam(tr, recipe)``, against a pixel mask); a mask of another shape or an empty mask raises
``ArgumentError``. DataArrays are read by their dimension names and coordinates (a map or mask transposed to
``(x, y)`` is the same map; other names or coordinates than the other input's are refused); NumPy arrays are
(rows, columns). A map equal to the mask scores 1 on every metric here (on :func:`topk_intersection` when ``k`` is
at most the mask size).
"""

from __future__ import annotations

import numpy as np

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate._common import aligned, as_map, as_mask, nan_because, order_desc, resolve_k, warn

__all__ = [
    "LOCALISATION_METRICS",
    "auroc",
    "default_tolerance",
    "energy_pointing_game",
    "pointing_game",
    "relevance_mass_accuracy",
    "relevance_rank_accuracy",
    "topk_intersection",
]


def default_tolerance(shape: tuple[int, int]) -> float:
    """The pointing-game tolerance: 15 px at 224 px (Zhang et al. 2016), scaled to the map size.

    Scaled by sqrt(H * W) / 224, so 15.0 at 224x224 and about 4.3 px at 64x64.

    Example:
        >>> default_tolerance((224, 224)), round(default_tolerance((64, 64)), 2)
        (15.0, 4.29)
    """
    h, w = shape
    return 15.0 * float(np.sqrt(h * w)) / 224.0


def _inputs(saliency: object, mask: object) -> tuple[np.ndarray, np.ndarray]:
    # by dimension names and coordinates: a mask transposed to (x, y) is the same mask, not another one
    saliency, mask = aligned(("saliency", saliency), ("mask", mask))
    m = as_map(saliency, "saliency")
    return m, as_mask(mask, m.shape)


def pointing_game(saliency: object, mask: object, tolerance: float | None = None) -> float:
    """Pointing game (Zhang et al. 2016): 1.0 if the map's maximum lies within ``tolerance`` pixels of
    the mask, else 0.0.

    ``tolerance`` defaults to :func:`default_tolerance` of the map size; 0 demands a maximum inside the
    mask. When several cells share the maximum (plateaus of a nearest-upsampled map), the result is the
    fraction of them that hit, i.e. the expected hit under random tie-breaking. NaN with a warning for a
    constant map (every pixel is a maximum: the map points nowhere).

    Example:
        >>> mask = np.zeros((8, 8), bool); mask[:2, :2] = True
        >>> pointing_game(mask.astype(float), mask), pointing_game(mask[::-1, ::-1].astype(float), mask)
        (1.0, 0.0)
    """
    from scipy import ndimage
    m, msk = _inputs(saliency, mask)
    tol = default_tolerance(m.shape) if tolerance is None else float(tolerance)
    if not np.isfinite(tol) or tol < 0:
        raise ArgumentError(f"tolerance: expected a non-negative number of pixels, got {tolerance!r}")
    if np.ptp(m) == 0.0:
        return nan_because("pointing_game", "the saliency map is constant (it has no maximum)")
    dist = ndimage.distance_transform_edt(~msk)  # distance of each pixel to the nearest mask pixel
    peaks = m == m.max()
    return float(np.mean(dist[peaks] <= tol))


def energy_pointing_game(saliency: object, mask: object) -> float:
    """Energy-based pointing game (Wang et al. 2020, Score-CAM): the share of the min-max-normalised
    map's energy that falls inside the mask, ``sum(map[mask]) / sum(map)``.

    Min-max normalisation makes the map's minimum zero, so a constant offset never counts as energy.
    NaN with a warning for a constant map.

    Example:
        >>> energy_pointing_game([[1.0, 3.0], [1.0, 1.0]], [[False, True], [False, False]])
        1.0
    """
    m, msk = _inputs(saliency, mask)
    if np.ptp(m) == 0.0:
        return nan_because("energy_pointing_game", "the saliency map is constant (no energy after min-max)")
    e = (m - m.min()) / np.ptp(m)
    return float(e[msk].sum() / e.sum())


def relevance_mass_accuracy(saliency: object, mask: object) -> float:
    """Relevance mass accuracy (Arras et al. 2022): the share of the map's positive relevance inside the
    mask, ``sum(relu(map)[mask]) / sum(relu(map))``.

    Unlike :func:`energy_pointing_game` the raw values are used (no min-max), and negative values are
    dropped, as in CLEVR-XAI. NaN with a warning when the map has no positive value.

    Example:
        >>> relevance_mass_accuracy([[-5.0, 3.0], [1.0, 0.0]], [[True, True], [False, False]])
        0.75
    """
    m, msk = _inputs(saliency, mask)
    pos = np.maximum(m, 0.0)
    total = pos.sum()
    if total == 0.0:
        return nan_because("relevance_mass_accuracy", "the saliency map has no positive value")
    return float(pos[msk].sum() / total)


def relevance_rank_accuracy(saliency: object, mask: object) -> float:
    """Relevance rank accuracy (Arras et al. 2022): with K the mask size, the share of the map's K
    highest cells that lie inside the mask.

    Ties at the K-th value are broken by row-major cell order, with a warning. NaN with a warning for a
    constant map.

    Example:
        >>> relevance_rank_accuracy([[4.0, 3.0], [2.0, 1.0]], [[True, False], [True, False]])
        0.5
    """
    m, msk = _inputs(saliency, mask)
    if np.ptp(m) == 0.0:
        return nan_because("relevance_rank_accuracy", "the saliency map is constant (no ranking)")
    k = int(msk.sum())
    order = order_desc(m)
    flat = m.ravel()
    if k < flat.size and flat[order[k - 1]] == flat[order[k]]:
        warn(f"relevance_rank_accuracy: tied values at the K-th cell (K={k}, the mask size); ties are "
             "broken by row-major cell order")
    return float(msk.ravel()[order[:k]].mean())


def topk_intersection(saliency: object, mask: object, k: int | float = 0.1) -> float:
    """Top-k intersection (Theiner et al. 2021): the share of the map's ``k`` highest cells that lie inside
    the mask.

    ``k`` is a count (1..n) or a fraction of the cells in (0, 1] (see :func:`~vitcam_nb.evaluate.resolve_k`).
    With ``k`` equal to the mask size this is :func:`relevance_rank_accuracy`. Ties at the k-th value are
    broken by row-major cell order, with a warning. NaN with a warning for a constant map.

    Example:
        >>> topk_intersection([[4.0, 3.0], [2.0, 1.0]], [[True, False], [False, False]], k=2)
        0.5
    """
    m, msk = _inputs(saliency, mask)
    n = resolve_k(k, m.size)
    if np.ptp(m) == 0.0:
        return nan_because("topk_intersection", "the saliency map is constant (no top cells)")
    order = order_desc(m)
    flat = m.ravel()
    if n < flat.size and flat[order[n - 1]] == flat[order[n]]:
        warn(f"topk_intersection: tied values at the k-th cell (k={n}); ties are broken by row-major cell order")
    return float(msk.ravel()[order[:n]].mean())


def auroc(saliency: object, mask: object) -> float:
    """Area under the ROC curve of the map's values as a classifier of mask pixels.

    The Mann-Whitney form: the probability that a random mask pixel scores higher than a random pixel
    outside it, ties counting one half. A constant map gives 0.5 (chance) with a warning; a mask that
    covers the whole map gives NaN with a warning (no negatives).

    Example:
        >>> auroc([[0.9, 0.1], [0.8, 0.2]], [[True, False], [True, False]])
        1.0
    """
    from scipy import stats  # here, not at import: scipy takes half a second to import
    m, msk = _inputs(saliency, mask)
    pos = int(msk.sum())
    neg = msk.size - pos
    if neg == 0:
        return nan_because("auroc", "the mask covers the whole map (no negative pixels)")
    if np.ptp(m) == 0.0:
        warn("auroc: the saliency map is constant; returning 0.5 (chance), it separates nothing")
        return 0.5
    ranks = stats.rankdata(m.ravel())
    u = ranks[msk.ravel()].sum() - pos * (pos + 1) / 2.0
    return float(u / (pos * neg))


LOCALISATION_METRICS = {
    "pointing_game": pointing_game,
    "energy_pointing_game": energy_pointing_game,
    "relevance_mass_accuracy": relevance_mass_accuracy,
    "relevance_rank_accuracy": relevance_rank_accuracy,
    "auroc": auroc,
}
"""Every localisation metric by name (higher is better) that scores 1 for a map equal to the mask; not
:func:`topk_intersection`, whose ``k`` is a free setting (with ``k`` above the mask size it cannot reach 1)."""
