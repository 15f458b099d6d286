"""Faithfulness as agreement between the map and the model's response to removals that are not a prefix of one
ranking: faithfulness correlation (random subsets), monotonicity correlation (one group at a time) and SaCo
(salience-guided faithfulness coefficient, a ViT measure).

* **faithfulness correlation** (Bhatt et al. 2020): over ``n_runs`` random subsets of cells, the Pearson
  correlation between the map's total over the subset and the drop of the class score when the subset is
  removed (higher = more faithful).
* **monotonicity correlation** (Nguyen & Martinez 2020): cells from the least to the most relevant in groups of
  ``step``; each group alone is removed ``n_samples`` times, and the Spearman correlation between the map's
  total over the group and the mean squared change of the score (divided by the squared intact score) is
  the result (higher = more faithful).
* **SaCo** (Wu et al., CVPR 2024): cells ranked by the map and cut into ``n_groups`` equal groups; for every
  pair of groups i < j (i more salient) the salience difference s(G_i) - s(G_j) counts for the map when
  removing G_i drops the score at least as much as removing G_j, and against it otherwise; the signed sum
  over the total weight is in [-1, 1] (1 = the model's response ranks groups exactly as the map does).

Settings as in :func:`~vitcam_nb.evaluate.faithfulness.curves.deletion` (mode, substrate, score, target, batch size,
seed), all recorded in the result's attrs; the headline number is also in ``attrs["value"]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate._common import nan_because, resolve_k
from vitcam_nb.evaluate.faithfulness.irof import irof
from vitcam_nb.evaluate.faithfulness.removal import check_count, removed_scores, setup
from vitcam_nb.evaluate.metric_helpers import correlation

__all__ = ["MODEL_FAITHFULNESS_METRICS", "faithfulness_correlation", "monotonicity_correlation", "saco",
           "saco_coefficient"]


def _correlation(kind: str, a: np.ndarray, b: np.ndarray, metric: str) -> float:
    # The private name this helper had; public, documented: vitcam_nb.evaluate.metric_helpers.correlation.
    return correlation(a, b, kind, metric)


def faithfulness_correlation(
    model: torch.nn.Module,
    image: object,
    saliency: object,
    target: int | None = None,
    *,
    n_runs: int = 100,
    subset_size: int | float = 0.1,
    subsets: np.ndarray | None = None,
    mode: str = "token",
    substrate: str = "mean",
    score: str = "prob",
    batch_size: int = 64,
    seed: int = 0,
    patch_size: int | Sequence[int] | None = None,
    nli_noise: float = 0.01,
    progress: bool | None = None,
) -> xr.DataArray:
    """Faithfulness correlation (Bhatt et al. 2020): Pearson correlation between the map's total over a random
    subset of cells and the drop of the class score when that subset is removed.

    Args:
        model, image, saliency, target, mode, substrate, score, batch_size, patch_size, nli_noise, progress:
            as in :func:`vitcam_nb.evaluate.deletion`.
        n_runs: number of random subsets (2..100000).
        subset_size: cells per subset, an int count or a fraction of the cells in (0, 1].
        subsets: explicit subsets ``(n_runs, subset_size)`` of cell ids (row-major), e.g. to replay another
            toolkit's draws; overrides ``n_runs``, ``subset_size`` and the seeded draw.
        seed: seed of the subsets (``numpy.random.default_rng(seed)``, one draw without replacement per run)
            and of the NLI noise.

    Returns:
        DataArray over ``run``: the score drop per subset, with coordinate ``saliency_sum``; attrs ``value``
        (= ``correlation``) and every setting.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 2))
        >>> fc = faithfulness_correlation(net, torch.ones(1, 3, 4, 4), np.arange(16.0).reshape(4, 4), 0,
        ...                               n_runs=8, subset_size=2, patch_size=1, score="logit", progress=False)
        >>> fc.sizes["run"], -1.0 <= fc.attrs["value"] <= 1.0
        (8, True)
    """
    s = setup(model, image, saliency, metric="faithfulness_correlation", mode=mode, substrate=substrate, score=score,
              target=target, batch_size=batch_size, seed=seed, patch_size=patch_size, nli_noise=nli_noise)
    n = s.n_cells
    given = subsets is not None
    if not given:
        runs = check_count("n_runs", n_runs, 2, 100_000)
        k = resolve_k(subset_size, n, "subset_size")
        rng = np.random.default_rng(seed)
        subsets = np.stack([rng.choice(n, k, replace=False) for _ in range(runs)])
    else:
        subsets = np.asarray(subsets)
        if (subsets.ndim != 2 or subsets.shape[0] < 2 or not np.issubdtype(subsets.dtype, np.integer)
                or subsets.min() < 0 or subsets.max() >= n):
            raise ArgumentError(f"subsets: expected an int array (n_runs >= 2, size) of cell ids in 0..{n - 1}, "
                                f"got shape {subsets.shape} dtype {subsets.dtype}")
    flat = s.cells.ravel()
    sums = flat[subsets].sum(axis=1)
    scores = removed_scores(s, [np.array([], int), *subsets], progress=progress,
                            desc=f"faithfulness correlation ({mode}, {substrate})")
    drops = scores[0] - scores[1:]
    value = _correlation("pearson", sums, drops, "faithfulness_correlation")
    attrs = {**s.attrs, "n_runs": int(subsets.shape[0]), "subset_size": int(subsets.shape[1]),
             "subsets": "given" if given else "seeded draw", "intact_score": float(scores[0]),
             "correlation": value, "value": value}
    return xr.DataArray(drops, dims=("run",), coords={"run": np.arange(len(drops)), "saliency_sum": ("run", sums)},
                        name="faithfulness_correlation", attrs=attrs)


def monotonicity_correlation(
    model: torch.nn.Module,
    image: object,
    saliency: object,
    target: int | None = None,
    *,
    step: int = 1,
    n_samples: int = 10,
    eps: float = 1e-5,
    mode: str = "token",
    substrate: str = "nli",
    score: str = "prob",
    batch_size: int = 64,
    seed: int = 0,
    patch_size: int | Sequence[int] | None = None,
    nli_noise: float = 0.01,
    progress: bool | None = None,
) -> xr.DataArray:
    """Monotonicity correlation (Nguyen & Martinez 2020): Spearman correlation between the map's total over a group
    of cells and the mean squared change of the class score when that group alone is removed.

    Cells go from the least to the most relevant in groups of ``step`` (the last group may be smaller). A fixed
    substrate ("mean", "image_mean", "blur") gives the same input every sample, so it is scored once; with
    "nli" each of the ``n_samples`` draws its own noise. The change is divided by the squared intact score when
    that is at least ``eps`` (Quantus's convention; it does not change the correlation).

    Arguments not listed below are as in :func:`vitcam_nb.evaluate.deletion`.

    Args:
        step: cells per group (1..number of cells); n_samples: draws per group (1..1000); eps: >= 0.

    Returns:
        DataArray over ``group`` (least relevant first): the scaled mean squared change, with coordinate
        ``saliency_sum``; attrs ``value`` (= ``correlation``) and every setting.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 2))
        >>> mc = monotonicity_correlation(net, torch.ones(1, 3, 4, 4), np.arange(16.0).reshape(4, 4), 0, step=4,
        ...                               substrate="mean", patch_size=1, score="logit", progress=False)
        >>> mc.sizes["group"], mc.attrs["n_samples_scored"]
        (4, 1)
    """
    s = setup(model, image, saliency, metric="monotonicity_correlation", mode=mode, substrate=substrate, score=score,
              target=target, batch_size=batch_size, seed=seed, patch_size=patch_size, nli_noise=nli_noise)
    step = check_count("step", step, 1, s.n_cells)
    n_samples = check_count("n_samples", n_samples, 1, 1000)
    if not (np.isfinite(eps) and eps >= 0):
        raise ArgumentError(f"eps: expected a non-negative number, got {eps!r}")
    flat = s.cells.ravel()
    order = np.argsort(flat, kind="stable")
    groups = [order[i: i + step] for i in range(0, s.n_cells, step)]
    draws = n_samples if substrate == "nli" else 1
    removals = [np.array([], int)] + [g for g in groups for _ in range(draws)]
    scores = removed_scores(s, removals, progress=progress, desc=f"monotonicity correlation ({mode}, {substrate})")
    y = scores[0]
    changes = ((scores[1:].reshape(len(groups), draws) - y) ** 2).mean(axis=1)
    if abs(y) >= eps:
        changes = changes / y**2
    sums = np.array([flat[g].sum() for g in groups])
    value = _correlation("spearman", sums, changes, "monotonicity_correlation")
    attrs = {**s.attrs, "step": step, "n_groups": len(groups), "n_samples": n_samples, "n_samples_scored": draws,
             "eps": float(eps), "intact_score": float(y), "correlation": value, "value": value}
    return xr.DataArray(changes, dims=("group",),
                        coords={"group": np.arange(len(groups)), "saliency_sum": ("group", sums)},
                        name="monotonicity_correlation", attrs=attrs)


def saco_coefficient(saliency_sums: np.ndarray, drops: np.ndarray) -> float:
    """SaCo from the groups' salience totals (most salient first) and the score drops their removal causes.

    Example:
        >>> saco_coefficient(np.array([3.0, 2.0, 1.0]), np.array([0.5, 0.2, 0.1]))
        1.0
    """
    s = np.asarray(saliency_sums, dtype=np.float64)
    d = np.asarray(drops, dtype=np.float64)
    i, j = np.triu_indices(len(s), k=1)
    weight = s[i] - s[j]
    signed = np.where(d[i] >= d[j], weight, -weight)
    total = float(np.abs(signed).sum())
    if total == 0.0:
        return nan_because("saco", "every group holds the same salience; the map ranks no group above another")
    return float(signed.sum() / total)


def saco(
    model: torch.nn.Module,
    image: object,
    saliency: object,
    target: int | None = None,
    *,
    n_groups: int = 10,
    mode: str = "token",
    substrate: str = "mean",
    score: str = "prob",
    batch_size: int = 64,
    seed: int = 0,
    patch_size: int | Sequence[int] | None = None,
    nli_noise: float = 0.01,
    progress: bool | None = None,
) -> xr.DataArray:
    """SaCo, the salience-guided faithfulness coefficient (Wu et al., CVPR 2024), in [-1, 1].

    Cells are ranked by the map (ties in row-major order) and cut into ``n_groups`` groups of equal size (sizes
    differ by at most one when they do not divide); each group alone is removed and the drop of the class score
    recorded; then :func:`saco_coefficient`. Token mode (the default) ranks patches, as a ViT sees them.

    Args:
        n_groups: 2..number of cells (the paper uses 10). Others as in :func:`vitcam_nb.evaluate.deletion`.

    Returns:
        DataArray over ``group`` (most salient first): the score drop per group, with coordinates
        ``saliency_sum`` and ``cells``; attrs ``value`` (= ``saco``) and every setting.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 2))
        >>> r = saco(net, torch.ones(1, 3, 4, 4), np.arange(16.0).reshape(4, 4), 0, n_groups=4, patch_size=1,
        ...          score="logit", progress=False)
        >>> r.sizes["group"], -1.0 <= r.attrs["value"] <= 1.0
        (4, True)
    """
    s = setup(model, image, saliency, metric="saco", mode=mode, substrate=substrate, score=score, target=target,
              batch_size=batch_size, seed=seed, patch_size=patch_size, nli_noise=nli_noise)
    k = check_count("n_groups", n_groups, 2, s.n_cells)
    flat = s.cells.ravel()
    groups = np.array_split(np.argsort(-flat, kind="stable"), k)
    scores = removed_scores(s, [np.array([], int), *groups], progress=progress, desc=f"SaCo ({mode}, {substrate})")
    drops = scores[0] - scores[1:]
    sums = np.array([flat[g].sum() for g in groups])
    value = saco_coefficient(sums, drops)
    attrs = {**s.attrs, "n_groups": k, "intact_score": float(scores[0]), "saco": value, "value": value}
    return xr.DataArray(drops, dims=("group",),
                        coords={"group": np.arange(k), "saliency_sum": ("group", sums),
                                "cells": ("group", [len(g) for g in groups])},
                        name="saco", attrs=attrs)


# One calling convention: fn(model, image, saliency, target=None, **settings) -> DataArray whose attrs["value"] is
# the score (higher = more faithful for every entry), for score cards that iterate over metrics by name.
MODEL_FAITHFULNESS_METRICS = {
    "faithfulness_correlation": faithfulness_correlation,
    "monotonicity_correlation": monotonicity_correlation,
    "irof": irof,
    "saco": saco,
}
