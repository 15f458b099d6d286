"""Reading a score card (:func:`~vitcam_nb.evaluate.scorecard.card.scorecard`): the recipes ranked per metric with their
intervals, and whether the metrics agree about which recipe is best (Spearman or Kendall correlation of the
recipe rankings, each metric oriented so that better is higher).

The functions are also on every Dataset as ``card.scorecard.plot()``, ``card.scorecard.agreement()`` and
``card.scorecard.plot_agreement()``.

Example:
    >>> card = xr.Dataset({"mean": (("recipe", "metric"), [[1.0, 0.2], [2.0, 0.1], [3.0, 0.3]])},
    ...                   coords={"recipe": ["a", "b", "c"], "metric": ["m1", "m2"],
    ...                           "higher_is_better": ("metric", [True, False])})
    >>> metric_agreement(card).sel(metric="m1", other="m2").item()
    -0.5
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentError

__all__ = ["ScorecardAccessor", "metric_agreement", "goodness", "plot_agreement", "plot_scorecard"]

_METHODS = ("spearman", "kendall")


def goodness(card: xr.Dataset) -> xr.DataArray:
    """The mean of each (recipe, metric) signed so that higher is better (lower-is-better metrics negated).

    Example:
        >>> card = xr.Dataset({"mean": (("recipe", "metric"), [[1.0], [2.0]])},
        ...                   coords={"metric": ["m"], "higher_is_better": ("metric", [False])})
        >>> goodness(card).values.ravel().tolist()
        [-1.0, -2.0]
    """
    sign = np.where(card["higher_is_better"].values.astype(bool), 1.0, -1.0)
    return card["mean"] * xr.DataArray(sign, dims="metric")


def metric_agreement(card: xr.Dataset, method: str = "spearman") -> xr.DataArray:
    """Rank agreement between every pair of metrics: the ``method`` correlation of the recipes' oriented means over
    the recipes finite on both (NaN when fewer than 3, or when a metric is constant there).

    Example:
        >>> card = xr.Dataset({"mean": (("recipe", "metric"), [[1.0, 1.0], [2.0, 3.0], [3.0, 2.0]])},
        ...                   coords={"metric": ["a", "b"], "higher_is_better": ("metric", [True, True])})
        >>> metric_agreement(card, "kendall").values.round(3).tolist()
        [[1.0, 0.333], [0.333, 1.0]]
    """
    from scipy import stats  # here, not at import: scipy takes half a second to import
    if method not in _METHODS:
        raise ArgumentError(f"method: expected one of {_METHODS}, got {method!r}")
    g = goodness(card).transpose("recipe", "metric").values
    k = g.shape[1]
    out = np.full((k, k), np.nan)
    fn = stats.spearmanr if method == "spearman" else stats.kendalltau
    for i in range(k):
        for j in range(k):
            ok = np.isfinite(g[:, i]) & np.isfinite(g[:, j])
            if ok.sum() >= 3 and np.ptp(g[ok, i]) > 0 and np.ptp(g[ok, j]) > 0:
                out[i, j] = float(fn(g[ok, i], g[ok, j])[0])
    names = card["metric"].values
    return xr.DataArray(out, dims=("metric", "other"), coords={"metric": names, "other": names},
                        name=f"{method}_rank_agreement",
                        attrs={"method": method, "oriented": "lower-is-better metrics negated before ranking"})


def plot_scorecard(card: xr.Dataset, metrics: list[str] | None = None, labels: dict[str, str] | None = None,
                   ncols: int = 3):
    """One panel per metric: the recipes ranked best first, a dot at the mean and a bar over the 95 % interval.

    ``labels`` maps recipe ids to names shown (default the ids).

    Example:
        >>> card = xr.Dataset({k: (("recipe", "metric"), [[1.0], [2.0]]) for k in ("mean", "low", "high")},
        ...                   coords={"recipe": ["a", "b"], "metric": ["m"], "higher_is_better": ("metric", [True])})
        >>> len(plot_scorecard(card).axes)
        1
    """
    import matplotlib.pyplot as plt

    names = list(card["metric"].values) if metrics is None else list(metrics)
    ncols = max(1, min(ncols, len(names)))
    nrows = int(np.ceil(len(names) / ncols))
    n_rec = card.sizes["recipe"]
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 0.8 + 0.22 * n_rec * nrows), squeeze=False)
    for ax, name in zip(axes.ravel(), names, strict=False):
        one = card.sel(metric=name)
        up = bool(one["higher_is_better"])
        mean = one["mean"].values
        key = np.where(np.isfinite(mean), -mean if up else mean, np.inf)
        order = np.argsort(key, kind="stable")[::-1]  # best ends on top of the panel
        y = np.arange(len(order))
        ax.errorbar(mean[order], y, xerr=[mean[order] - one["low"].values[order],
                                          one["high"].values[order] - mean[order]],
                    fmt="o", ms=3, lw=1, capsize=0)
        ids = [str(v) for v in card["recipe"].values[order]]
        ax.set_yticks(y, [(labels or {}).get(i, i) for i in ids], fontsize=7)
        ax.set_title(f"{name} ({'higher' if up else 'lower'} is better)", fontsize=9)
    for ax in axes.ravel()[len(names):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def plot_agreement(card: xr.Dataset, method: str = "spearman"):
    """The rank-agreement matrix of :func:`metric_agreement` as an annotated heatmap (-1 blue .. +1 red).

    Example:
        >>> card = xr.Dataset({"mean": (("recipe", "metric"), [[1.0, 1.0], [2.0, 3.0], [3.0, 2.0]])},
        ...                   coords={"metric": ["a", "b"], "higher_is_better": ("metric", [True, True])})
        >>> plot_agreement(card).axes[0].get_title()
        'spearman rank agreement of the metrics'
    """
    import matplotlib.pyplot as plt

    mat = metric_agreement(card, method)
    k = mat.sizes["metric"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * k, 0.8 + 0.5 * k))
    im = ax.imshow(mat.values, cmap="RdBu_r", vmin=-1, vmax=1)
    names = [str(v) for v in mat["metric"].values]
    ax.set_xticks(range(k), names, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(k), names, fontsize=7)
    for i in range(k):
        for j in range(k):
            v = mat.values[i, j]
            ax.text(j, i, "" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=6)
    fig.colorbar(im, ax=ax, shrink=0.8)
    ax.set_title(f"{method} rank agreement of the metrics")
    fig.tight_layout()
    return fig


@xr.register_dataset_accessor("scorecard")
class ScorecardAccessor:
    """``card.scorecard.plot()``, ``.agreement(method)`` and ``.plot_agreement(method)`` on a score card.

    Example:
        >>> card = xr.Dataset({"mean": (("recipe", "metric"), [[1.0, 1.0], [2.0, 3.0], [3.0, 2.0]])},
        ...                   coords={"metric": ["a", "b"], "higher_is_better": ("metric", [True, True])})
        >>> float(card.scorecard.agreement().sel(metric="a", other="b"))
        0.5
    """

    def __init__(self, card: xr.Dataset) -> None:
        self._card = card

    def plot(self, metrics: list[str] | None = None, labels: dict[str, str] | None = None, ncols: int = 3):
        """:func:`plot_scorecard` of this card.

        Example:
            >>> callable(ScorecardAccessor.plot)
            True
        """
        return plot_scorecard(self._card, metrics, labels, ncols)

    def agreement(self, method: str = "spearman") -> xr.DataArray:
        """:func:`metric_agreement` of this card.

        Example:
            >>> callable(ScorecardAccessor.agreement)
            True
        """
        return metric_agreement(self._card, method)

    def plot_agreement(self, method: str = "spearman"):
        """:func:`plot_agreement` of this card.

        Example:
            >>> callable(ScorecardAccessor.plot_agreement)
            True
        """
        return plot_agreement(self._card, method)
