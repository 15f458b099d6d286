"""The spread of the maps a description allows: per-pixel IQR and standard deviation, how well they agree
(pairwise Spearman), and the share of them that point at the object (the pointing game).

Example:
    >>> mask = np.zeros((4, 4), bool); mask[:2, :2] = True
    >>> localising_share(np.stack([mask, ~mask]).astype(float), mask, tolerance=0)
    0.5
"""

from __future__ import annotations

import dataclasses

import numpy as np
import xarray as xr

from vitcam_nb.compute.spatial import upsample
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate.localisation.metrics import default_tolerance

__all__ = ["Spread", "localising_share", "spread_of"]


@dataclasses.dataclass(frozen=True)
class Spread:
    """Per-pixel spread of the consistent maps (IQR and standard deviation over recipes) and how well they agree:
    the median pairwise Spearman correlation and the share of pairs below 0.5 (constant maps left out).

    Example:
        >>> s = Spread(xr.DataArray(np.zeros((1, 1))), xr.DataArray(np.zeros((1, 1))), 0.4, 0.6, 10, 0)
        >>> s.median_spearman
        0.4
    """

    iqr: xr.DataArray
    std: xr.DataArray
    median_spearman: float
    share_below_half: float
    pairs: int
    constant: int



def spread_of(maps: np.ndarray, dims: tuple[str, str]) -> tuple[Spread, np.ndarray]:
    """The spread of ``maps`` (n, h, w) and their pairwise Spearman matrix (NaN where a map is constant).

    Example:
        >>> spread, rho = spread_of(np.stack([np.eye(3), np.eye(3), 1 - np.eye(3)]), ("y", "x"))
        >>> spread.pairs, round(float(rho[0, 2]), 6)
        (3, -1.0)
    """
    from scipy import stats  # here, not at import: scipy takes half a second to import
    flat = maps.reshape(len(maps), -1).astype(np.float64)
    q75, q25 = np.percentile(flat, [75, 25], axis=0)
    varying = np.ptp(flat, axis=1) > 0
    rho = np.full((len(maps), len(maps)), np.nan)
    if varying.sum() >= 2:
        ranks = stats.rankdata(flat[varying], axis=1)
        rho[np.ix_(varying, varying)] = np.corrcoef(ranks)
    upper = rho[np.triu_indices(len(maps), 1)]
    upper = upper[np.isfinite(upper)]
    shape = maps.shape[1:]
    spread = Spread(xr.DataArray((q75 - q25).reshape(shape), dims=dims, name="iqr"),
                    xr.DataArray(flat.std(axis=0).reshape(shape), dims=dims, name="std"),
                    float(np.median(upper)) if upper.size else float("nan"),
                    float(np.mean(upper < 0.5)) if upper.size else float("nan"), int(upper.size),
                    int((~varying).sum()))
    return spread, rho


def localising_share(maps: np.ndarray, mask: np.ndarray, tolerance: float | None = None) -> float:
    """The share of ``maps`` (n, h, w; any grid, upsampled bilinearly to the mask) whose maximum lies within
    ``tolerance`` pixels of ``mask`` (the pointing game; ties count fractionally; a constant map points nowhere
    and counts as a miss).

    Example:
        >>> mask = np.zeros((4, 4), bool); mask[:2, :2] = True
        >>> localising_share(np.stack([mask, ~mask]).astype(float), mask, tolerance=0)
        0.5
    """
    from scipy import ndimage
    mask = np.asarray(mask, bool)
    if mask.ndim != 2 or not mask.any():
        raise ArgumentError(f"mask: expected a non-empty 2-D boolean mask, got shape {mask.shape}")
    up = upsample(np.asarray(maps, np.float32), mask.shape, "bilinear") if maps.shape[1:] != mask.shape else maps
    tol = default_tolerance(mask.shape) if tolerance is None else float(tolerance)
    hit = (ndimage.distance_transform_edt(~mask) <= tol).ravel()
    flat = up.reshape(len(up), -1)
    peaks = flat == flat.max(axis=1, keepdims=True)
    share = (peaks & hit).sum(axis=1) / peaks.sum(axis=1)
    return float(np.where(np.ptp(flat, axis=1) > 0, share, 0.0).mean())
