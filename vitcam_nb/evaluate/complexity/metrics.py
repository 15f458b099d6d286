"""Complexity: how concentrated a map is, as pure functions of one map (no mask, no model).

Every function looks at the map's magnitude, ``|map| / max|map|`` (the preprocessing Quantus applies by
default: absolute value, then division by the largest magnitude), so a map and any positive multiple of
it score the same. A map with no non-zero value is refused with NaN and a :class:`MetricWarning`.

* :func:`sparseness`: the Gini index of the magnitudes (Chalasani et al. 2020); 0 for a flat map, close to
  1 when one cell holds everything. Higher = sparser = easier to read.
* :func:`complexity`: the Shannon entropy (natural log) of the magnitudes as a distribution
  (Bhatt et al. 2020); 0 for one hot cell, ``log(n)`` for a flat map. Lower = simpler.
* :func:`effective_complexity`: the number of cells whose normalised magnitude exceeds ``eps``
  (Nguyen and Martinez 2020). Lower = simpler.

Example:
    >>> sparseness([[0.0, 0.0], [0.0, 1.0]]), complexity([[1.0, 1.0]]) == float(np.log(2))
    (0.75, True)
"""

from __future__ import annotations

import numpy as np

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate._common import as_map, nan_because

__all__ = ["COMPLEXITY_METRICS", "complexity", "effective_complexity", "sparseness"]


def _magnitude(saliency: object, metric: str) -> np.ndarray | None:
    m = np.abs(as_map(saliency, "saliency")).ravel()
    top = m.max()
    if top == 0.0:
        nan_because(metric, "the saliency map is all zeros (no magnitude to distribute)")
        return None
    return m / top


def sparseness(saliency: object) -> float:
    """Gini index of the map's magnitudes: ``sum((2i - n - 1) a_(i)) / (n sum(a))`` over the sorted
    magnitudes ``a_(1) <= ... <= a_(n)``.

    Exact (Quantus adds 1e-7 to every cell first, which multiplies the index by ``S / (S + n 1e-7)`` with
    ``S`` the sum of the normalised magnitudes). NaN with a warning for an all-zero map.

    Example:
        >>> sparseness([[1.0, 1.0], [1.0, 1.0]]), sparseness([[0.0, 0.0], [0.0, -2.0]])
        (0.0, 0.75)
    """
    a = _magnitude(saliency, "sparseness")
    if a is None:
        return float("nan")
    a = np.sort(a)
    n = a.size
    weights = 2.0 * np.arange(1, n + 1) - n - 1
    return float((weights * a).sum() / (n * a.sum()))


def complexity(saliency: object) -> float:
    """Shannon entropy (nats) of ``p = |map| / sum|map|``, with ``0 log 0 = 0``.

    Quantus computes ``-sum(p log(p + 1e-12))``: the same value within about ``n * 1e-12``. NaN with a
    warning for an all-zero map.

    Example:
        >>> complexity([[0.0, 3.0]]), round(complexity([[1.0, 1.0], [1.0, 1.0]]), 6)
        (0.0, 1.386294)
    """
    a = _magnitude(saliency, "complexity")
    if a is None:
        return float("nan")
    p = a / a.sum()
    p = p[p > 0]
    return float(-(p * np.log(p)).sum()) + 0.0  # + 0.0: an entropy of exactly zero prints 0.0, not -0.0


def effective_complexity(saliency: object, eps: float = 1e-5) -> float:
    """The number of cells whose normalised magnitude ``|map| / max|map|`` is above ``eps``.

    ``eps`` must be in [0, 1). Returned as a float so that an all-zero map can answer NaN (with a warning).

    Example:
        >>> effective_complexity([[0.0, 1e-7], [0.5, 1.0]])
        2.0
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)) or not 0 <= eps < 1:
        raise ArgumentError(f"eps: expected a threshold in [0, 1) on the normalised magnitude, got {eps!r}")
    a = _magnitude(saliency, "effective_complexity")
    if a is None:
        return float("nan")
    return float(np.count_nonzero(a > eps))


COMPLEXITY_METRICS = {
    "sparseness": sparseness,
    "complexity": complexity,
    "effective_complexity": effective_complexity,
}
"""Every complexity metric by name (sparseness: higher is simpler; the other two: lower is simpler)."""
