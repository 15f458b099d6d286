"""Agreement between two maps, measured cell by cell on the same grid.

Compare maps on the token grid (``vc.cam(tr, recipe, grid=True)``): bilinear upsampling smooths both
maps with the same kernel and inflates every correlation. Every function takes two 2-D arrays or
DataArrays of one shape and returns a plain ``float``; maps of different shapes raise ``ValueError``;
an undefined value (a constant map has no ranking and no correlation) is NaN with a
:class:`~vitcam_nb.evaluate.MetricWarning` that says why.

The top-k measures of Krishna et al. 2022 ("The Disagreement Problem in Explainable Machine
Learning") rank cells by absolute value, as the paper ranks features by attribution magnitude; their
sign measures need maps taken before the ReLU (``recipe.replace(relu="none", normalize="none")``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate._common import as_pair, nan_because, order_desc, recipe_fields, resolve_k, warn

__all__ = [
    "AGREEMENT_METRICS",
    "SIGNED_METRICS",
    "agreement_functions",
    "cosine",
    "feature_agreement",
    "pearson",
    "rank_agreement",
    "sign_agreement",
    "signed_rank_agreement",
    "spearman",
    "ssim",
    "topk_iou",
]


def _constant(x: np.ndarray) -> bool:
    return bool(np.ptp(x) == 0.0)


def _pearson_of(x: np.ndarray, y: np.ndarray) -> float:
    xc, yc = x.ravel() - x.mean(), y.ravel() - y.mean()
    r = float(np.dot(xc, yc) / np.sqrt(np.dot(xc, xc) * np.dot(yc, yc)))
    return float(np.clip(r, -1.0, 1.0))


def pearson(a: object, b: object) -> float:
    """Pearson correlation of the cell values of two maps.

    NaN with a warning when either map is constant (zero variance: correlation undefined).

    Example:
        >>> pearson([[0, 1], [2, 3]], [[1, 3], [5, 7]])
        1.0
    """
    x, y = as_pair(a, b)
    for name, m in (("a", x), ("b", y)):
        if _constant(m):
            return nan_because("pearson", f"map {name} is constant (zero variance)")
    return _pearson_of(x, y)


def spearman(a: object, b: object) -> float:
    """Spearman rank correlation: Pearson correlation of the cell ranks (ties get their mean rank).

    NaN with a warning when either map is constant (no ranking).

    Example:
        >>> spearman([[0, 1], [2, 3]], [[3, 2], [1, 0]])
        -1.0
    """
    from scipy import stats  # here, not at import: scipy takes half a second to import
    x, y = as_pair(a, b)
    for name, m in (("a", x), ("b", y)):
        if _constant(m):
            return nan_because("spearman", f"map {name} is constant (no ranking)")
    return _pearson_of(stats.rankdata(x.ravel()), stats.rankdata(y.ravel()))


def cosine(a: object, b: object) -> float:
    """Cosine similarity of the two maps as vectors (not centred, so an offset counts).

    NaN with a warning when either map is all zeros.

    Example:
        >>> cosine([[1, 0]], [[0, 1]])
        0.0
    """
    x, y = as_pair(a, b)
    nx, ny = float(np.linalg.norm(x)), float(np.linalg.norm(y))
    for name, n in (("a", nx), ("b", ny)):
        if n == 0.0:
            return nan_because("cosine", f"map {name} is all zeros (no direction)")
    return float(np.clip(np.dot(x.ravel(), y.ravel()) / (nx * ny), -1.0, 1.0))


def ssim(a: object, b: object, data_range: float | None = None, sigma: float = 1.5) -> float:
    """Structural similarity (Wang et al. 2004), mean of the local SSIM map.

    Local statistics use a Gaussian window (``sigma`` cells, truncated at 3.5 sigma) with reflected
    borders, so the index works on token grids as small as 2x2; K1 = 0.01, K2 = 0.03 and population
    (not sample) variances. ``data_range`` defaults to the joint range of both maps
    (max - min over a and b); pass 1.0 for maps normalised to [0, 1] to compare across pairs. Constant
    maps are allowed (SSIM then compares their levels); NaN with a warning only when both maps are the
    same constant and ``data_range`` is not given (the range is zero).

    Example:
        >>> m = [[0.0, 0.5], [1.0, 0.2]]
        >>> ssim(m, m)
        1.0
    """
    from scipy import ndimage
    x, y = as_pair(a, b)
    if data_range is None:
        rng = float(max(x.max(), y.max()) - min(x.min(), y.min()))
        if rng == 0.0:
            return nan_because("ssim", "both maps are the same constant (data range zero); pass data_range")
    else:
        if not np.isfinite(data_range) or data_range <= 0:
            raise ArgumentError(f"data_range: expected a positive number, got {data_range!r}")
        rng = float(data_range)
    if not sigma > 0:
        raise ArgumentError(f"sigma: expected a positive window width in cells, got {sigma!r}")
    c1, c2 = (0.01 * rng) ** 2, (0.03 * rng) ** 2

    def smooth(z: np.ndarray) -> np.ndarray:
        return ndimage.gaussian_filter(z, sigma=sigma, mode="reflect", truncate=3.5)

    mx, my = smooth(x), smooth(y)
    vx = smooth(x * x) - mx * mx
    vy = smooth(y * y) - my * my
    cxy = smooth(x * y) - mx * my
    local = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(np.clip(local.mean(), -1.0, 1.0))


def topk_iou(a: object, b: object, k: int | float = 0.1) -> float:
    """Intersection over union of the top-k cells (by value) of the two maps.

    ``k``: an int is a number of cells, a float in (0, 1] a fraction of the cells (rounded, at least
    one). Ties at the top-k boundary are broken by row-major cell order, with a warning. NaN with a
    warning when either map is constant (its top-k set would be arbitrary).

    Example:
        >>> topk_iou([[4, 3], [0, 0]], [[0, 3], [4, 0]], k=2)
        0.3333333333333333
    """
    x, y = as_pair(a, b)
    n = resolve_k(k, x.size)
    sets = []
    for name, m in (("a", x), ("b", y)):
        if _constant(m):
            return nan_because("topk_iou", f"map {name} is constant (its top-k set is arbitrary)")
        order = order_desc(m)
        _warn_boundary_tie("topk_iou", name, m.ravel()[order], n)
        sets.append(set(order[:n].tolist()))
    return len(sets[0] & sets[1]) / len(sets[0] | sets[1])


def _warn_boundary_tie(metric: str, name: str, sorted_values: np.ndarray, n: int) -> None:
    if n < sorted_values.size and sorted_values[n - 1] == sorted_values[n]:
        warn(f"{metric}: map {name} has tied values at the top-k boundary (k={n}); ties are broken by "
             "row-major cell order")


def _top_abs(metric: str, x: np.ndarray, y: np.ndarray, k: int | float) -> tuple | float:
    n = resolve_k(k, x.size)
    tops = []
    for name, m in (("a", x), ("b", y)):
        mag = np.abs(m)
        if _constant(mag):
            return nan_because(metric, f"|map {name}| is constant (no top-k features)")
        order = order_desc(mag)
        _warn_boundary_tie(metric, name, mag.ravel()[order], n)
        tops.append(order[:n])
    return n, tops[0], tops[1]


def feature_agreement(a: object, b: object, k: int | float = 0.1) -> float:
    """Krishna et al.'s feature agreement: the share of the top-k cells (by |value|) the maps have in common.

    ``|topk(a) ∩ topk(b)| / k``; ``k`` as in :func:`topk_iou`.

    Example:
        >>> feature_agreement([[4, 3], [0, 0]], [[0, 3], [4, 0]], k=2)
        0.5
    """
    x, y = as_pair(a, b)
    top = _top_abs("feature_agreement", x, y, k)
    if isinstance(top, float):
        return top
    n, ta, tb = top
    return len(set(ta.tolist()) & set(tb.tolist())) / n


def rank_agreement(a: object, b: object, k: int | float = 0.1) -> float:
    """Krishna et al.'s rank agreement: the share of rank positions 1..k held by the same cell in both maps.

    Cells are ranked by |value|; ``k`` as in :func:`topk_iou`.

    Example:
        >>> rank_agreement([[4, 3], [1, 0]], [[4, 1], [3, 0]], k=2)
        0.5
    """
    x, y = as_pair(a, b)
    top = _top_abs("rank_agreement", x, y, k)
    if isinstance(top, float):
        return top
    n, ta, tb = top
    return float(np.sum(ta == tb)) / n


def _warn_unsigned(metric: str, a: object, b: object, x: np.ndarray, y: np.ndarray) -> None:
    for name, raw in (("a", a), ("b", b)):
        relu = recipe_fields(raw).get("relu")
        if relu not in (None, "none"):
            warn(f"{metric}: map {name} was made with relu={relu!r}; sign measures need maps taken before "
                 "the ReLU (recipe.replace(relu='none', normalize='none'))")
            return
    if x.min() >= 0 and y.min() >= 0:
        warn(f"{metric}: neither map has a negative value, so every sign agrees; sign measures need maps "
             "taken before the ReLU (recipe.replace(relu='none', normalize='none'))")


def sign_agreement(a: object, b: object, k: int | float = 0.1) -> float:
    """Krishna et al.'s sign agreement: the share of the top-k cells (by |value|) in both maps' top-k
    that have the same sign in both.

    Use maps taken before the ReLU; a warning says so when both maps are non-negative (or carry a
    recipe with a ReLU).

    Example:
        >>> sign_agreement([[4, -3], [0, 0]], [[4, 3], [0, 0]], k=2)
        0.5
    """
    x, y = as_pair(a, b)
    _warn_unsigned("sign_agreement", a, b, x, y)
    top = _top_abs("sign_agreement", x, y, k)
    if isinstance(top, float):
        return top
    n, ta, tb = top
    common = np.array(sorted(set(ta.tolist()) & set(tb.tolist())), dtype=np.int64)
    xs, ys = np.sign(x.ravel()), np.sign(y.ravel())
    return float(np.sum(xs[common] == ys[common])) / n


def signed_rank_agreement(a: object, b: object, k: int | float = 0.1) -> float:
    """Krishna et al.'s signed rank agreement: same cell at the same rank position and with the same sign.

    Example:
        >>> signed_rank_agreement([[4, -3], [0, 0]], [[4, 3], [0, 0]], k=2)
        0.5
    """
    x, y = as_pair(a, b)
    _warn_unsigned("signed_rank_agreement", a, b, x, y)
    top = _top_abs("signed_rank_agreement", x, y, k)
    if isinstance(top, float):
        return top
    n, ta, tb = top
    xs, ys = np.sign(x.ravel()), np.sign(y.ravel())
    same = (ta == tb) & (xs[ta] == ys[tb])
    return float(np.sum(same)) / n


AGREEMENT_METRICS: dict[str, Callable[..., float]] = {
    "spearman": spearman,
    "pearson": pearson,
    "cosine": cosine,
    "ssim": ssim,
    "topk_iou": topk_iou,
    "feature_agreement": feature_agreement,
    "rank_agreement": rank_agreement,
    "sign_agreement": sign_agreement,
    "signed_rank_agreement": signed_rank_agreement,
}
"""Every agreement metric by name (higher means more agreement)."""

SIGNED_METRICS: frozenset[str] = frozenset({"sign_agreement", "signed_rank_agreement"})
"""Metrics that need maps taken before the ReLU and normalisation."""


def agreement_functions(metrics: Sequence[str | Callable[..., float]]) -> list[tuple[str, Callable[..., float]]]:
    """``(name, function)`` for each entry of ``metrics``: a name from :data:`AGREEMENT_METRICS` or a callable
    ``f(map_a, map_b) -> float`` (named by its ``__name__``).

    Example:
        >>> [name for name, _ in agreement_functions(["spearman", cosine])]
        ['spearman', 'cosine']
    """
    out = []
    for m in metrics:
        if callable(m):
            out.append((getattr(m, "__name__", "custom"), m))
        elif m in AGREEMENT_METRICS:
            out.append((m, AGREEMENT_METRICS[m]))
        else:
            raise ArgumentError(f"metrics: expected names from {list(AGREEMENT_METRICS)} or callables, got {m!r}")
    if not out:
        raise ArgumentError("metrics: expected at least one metric")
    return out
