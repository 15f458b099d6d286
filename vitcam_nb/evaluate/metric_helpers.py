"""The public helpers a new metric needs, so that a metric module (:mod:`vitcam_nb.evaluate.metrics`) does not copy
private code: a correlation with the kit's NaN rule, and the NaN-with-a-reason and input checks every metric shares.

The NaN rule: a metric that is undefined for its input returns NaN *and* a :class:`MetricWarning` saying why (never a
silent NaN); a correlation is undefined when either side is constant.

Example:
    >>> correlation([1.0, 2.0, 3.0], [2.0, 4.0, 7.0], "spearman")
    1.0
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate._common import MetricWarning, as_map, as_mask, nan_because

__all__ = ["CORRELATIONS", "MetricWarning", "as_map", "as_mask", "correlation", "nan_because"]

CORRELATIONS = ("pearson", "spearman")


def correlation(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, kind: str = "pearson",
                metric: str = "correlation") -> float:
    """Pearson (``kind="pearson"``) or Spearman (``"spearman"``) correlation of two equal-length 1-D samples, as
    scipy.stats computes it; NaN with a :class:`MetricWarning` naming ``metric`` when either side is constant (the
    map's totals ``a`` or the model's responses ``b``), where the correlation is undefined.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     correlation([1.0, 1.0], [1.0, 2.0])
        nan
    """
    from scipy import stats  # here, not at import: scipy takes half a second to import
    if kind not in CORRELATIONS:
        raise ArgumentError(f"kind: expected one of {CORRELATIONS}, got {kind!r}")
    a, b = np.asarray(a), np.asarray(b)  # dtypes kept: the metrics' values are what scipy gives on them
    if a.ndim != 1 or a.shape != b.shape:
        raise ArgumentError(f"a, b: expected two 1-D samples of one length, got shapes {a.shape} and {b.shape}")
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        which = "the map's totals" if np.ptp(a) == 0 else "the model's responses"
        return nan_because(metric, f"{which} are constant over the removals; a correlation is undefined")
    fn = stats.pearsonr if kind == "pearson" else stats.spearmanr
    return float(fn(a, b)[0])
