"""Sufficiency (Dasgupta et al. 2022) over a set of images: an explanation is sufficient when the other images whose
maps are close to it get the same predicted class.

Each map is taken as ``|map| / max|map|`` (the kit's per-map normalisation); the distances between all pairs of
maps (default the standardised Euclidean distance, each pixel divided by its variance over the set) are divided
by the largest one; two maps are close when that is at most ``threshold``. An image's sufficiency is the share of
its close neighbours (itself excluded) that share its predicted class; no model call (the predictions come from
the caller, or from the traces' logits).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate._common import as_map, warn

__all__ = ["DISTANCES", "sufficiency"]

DISTANCES = ("seuclidean", "euclidean", "cityblock", "cosine")


def _prediction(p: object, i: int) -> int:
    if isinstance(p, xr.Dataset):
        if "logits" not in p:
            raise ArgumentError(f"predictions: trace {i} has no 'logits' variable")
        return int(np.argmax(np.asarray(p["logits"].values).ravel()))
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
        raise ArgumentError(f"predictions: expected class indices or traces, got {type(p).__name__} at {i}")
    return int(p)


def sufficiency(
    maps: Sequence[object],
    predictions: Sequence[object],
    *,
    threshold: float = 0.6,
    distance: str = "seuclidean",
) -> xr.DataArray:
    """Sufficiency of each map within the set: the share of the images with a close map that share its class.

    Args:
        maps: two or more 2-D maps of one shape (numpy arrays, DataArrays, tensors).
        predictions: the predicted class of each image (ints) or each image's trace (its logits' argmax).
        threshold: closeness threshold on the max-normalised distance, in [0, 1].
        distance: one of ``DISTANCES`` (scipy's ``cdist`` metrics); pixels constant over the set are left out of
            ``"seuclidean"`` (their variance is 0).

    Returns:
        DataArray over ``image``; NaN (with a MetricWarning) for an image with no close neighbour; attrs
        ``value`` (mean over the images with a neighbour), ``n_close`` per image and the settings.

    Example:
        >>> maps = [np.eye(3), np.eye(3) + 0.01, np.ones((3, 3))]
        >>> sufficiency(maps, [1, 1, 2], threshold=1.0, distance="euclidean").values.tolist()
        [0.5, 0.5, 0.0]
    """
    from scipy.spatial.distance import cdist

    if not isinstance(maps, Sequence) or len(maps) < 2:
        raise ArgumentError("maps: expected a sequence of two or more maps")
    arrs = [as_map(m, f"maps[{i}]") for i, m in enumerate(maps)]
    if any(a.shape != arrs[0].shape for a in arrs):
        raise ArgumentError(f"maps: every map must have one shape, got {sorted({a.shape for a in arrs})}")
    if len(predictions) != len(arrs):
        raise ArgumentError(f"predictions: expected {len(arrs)} (one per map), got {len(predictions)}")
    classes = np.array([_prediction(p, i) for i, p in enumerate(predictions)])
    if not (np.isfinite(threshold) and 0.0 <= threshold <= 1.0):
        raise ArgumentError(f"threshold: expected a number in [0, 1], got {threshold!r}")
    if distance not in DISTANCES:
        raise ArgumentError(f"distance: expected one of {list(DISTANCES)}, got {distance!r}")
    flat = np.stack([np.abs(a).ravel() for a in arrs])
    peak = flat.max(axis=1, keepdims=True)
    if (peak == 0).any():
        raise ArgumentError(f"maps: map(s) {np.nonzero(peak.ravel() == 0)[0].tolist()} are all zeros; they cannot be "
                            "normalised")
    flat = flat / peak
    if distance == "seuclidean":
        flat = flat[:, flat.var(axis=0) > 0]
    d = cdist(flat, flat, distance) if flat.shape[1] else np.zeros((len(arrs), len(arrs)))
    if d.max() > 0:
        d = d / d.max()
    close = d <= threshold
    np.fill_diagonal(close, False)
    n_close = close.sum(axis=1)
    same = (close & (classes[None, :] == classes[:, None])).sum(axis=1)
    values = np.where(n_close > 0, same / np.maximum(n_close, 1), np.nan)
    if (n_close == 0).any():
        warn(f"sufficiency: NaN for image(s) {np.nonzero(n_close == 0)[0].tolist()}: no other map is within "
             f"the threshold {threshold}")
    mean = float(np.nanmean(values)) if (n_close > 0).any() else float("nan")
    return xr.DataArray(values, dims=("image",), coords={"image": np.arange(len(arrs)), "n_close": ("image", n_close),
                                                         "predicted": ("image", classes)},
                        name="sufficiency", attrs={"metric": "sufficiency", "threshold": float(threshold),
                                                   "distance": distance, "normalisation": "|map| / max|map| per map",
                                                   "value": mean})
