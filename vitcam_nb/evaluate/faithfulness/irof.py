"""IROF, iterative removal of features (Rieger & Hansen 2020): segments are removed, most relevant first (by the
map's mean over each segment), cumulatively, and the area *over* the curve of the class score relative to the
intact score measures faithfulness (higher = more faithful).

Segments are the ViT's patches (``segments="patch"``, the default), SLIC superpixels of the model input
(``"slic"``, scikit-image's ``slic(image, start_label=0)`` with its defaults on the channel-last model input,
as Quantus does; scikit-image must be installed) or any integer label image of the input size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate._common import as_map, nan_because
from vitcam_nb.evaluate.faithfulness.perturbation import area_under_curve
from vitcam_nb.evaluate.faithfulness.removal import removed_scores, setup

__all__ = ["SEGMENTATIONS", "irof", "segment_labels"]

SEGMENTATIONS = ("patch", "slic")


def segment_labels(x: torch.Tensor, segments: object) -> np.ndarray:
    """Integer segment labels ``0..n-1`` over the input pixels of ``x`` (1, C, H, W): "slic" superpixels of the
    channel-last input, or a given label image (relabelled to consecutive ids in sorted label order).

    Example:
        >>> segment_labels(torch.zeros(1, 3, 2, 2), np.array([[5, 5], [9, 2]])).tolist()
        [[1, 1], [2, 0]]
    """
    h, w = x.shape[-2:]
    if isinstance(segments, str):
        if segments != "slic":
            raise ArgumentError(f"segments: expected one of {list(SEGMENTATIONS)} or a label image, got {segments!r}")
        try:
            from skimage.segmentation import slic
        except ImportError as e:  # optional: only this segmentation needs it
            raise ArgumentError("segments: 'slic' needs scikit-image (pip install scikit-image)") from e
        labels = slic(np.moveaxis(x[0].numpy(), 0, -1).astype(np.float64), start_label=0)
    else:
        labels = np.asarray(segments)
        if labels.shape != (h, w) or not np.issubdtype(labels.dtype, np.integer):
            raise ArgumentError(f"segments: a label image must be an int array of the input size {(h, w)}, got "
                                f"shape {labels.shape} dtype {labels.dtype}")
    return np.unique(labels, return_inverse=True)[1].reshape(h, w)


def irof(
    model: torch.nn.Module,
    image: object,
    saliency: object,
    target: int | None = None,
    *,
    segments: str | np.ndarray = "patch",
    substrate: str = "mean",
    score: str = "prob",
    batch_size: int = 64,
    seed: int = 0,
    patch_size: int | Sequence[int] | None = None,
    nli_noise: float = 0.01,
    progress: bool | None = None,
) -> xr.DataArray:
    """IROF: area over the curve of score(removed) / score(intact) over the fraction of segments removed, most
    relevant segment first, cumulatively; the curve starts at 1 (nothing removed), so the area is in [0, 1] for a
    score that only falls.

    Arguments not listed below are as in :func:`vitcam_nb.evaluate.deletion`.

    Args:
        segments: "patch" (default; the map may be on the token grid or at the input size), "slic", or an int
            label image of the input size (these two need the map at the input size).

    Returns:
        DataArray over ``fraction`` of segments removed: the relative score, with coordinate ``segments``;
        attrs ``value`` (= ``irof``), ``n_segments``, ``segmentation`` and every setting.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 2))
        >>> r = irof(net, torch.ones(1, 3, 4, 4), np.arange(16.0).reshape(4, 4), 0, patch_size=2, score="logit",
        ...          progress=False)
        >>> r.sizes["fraction"], r.attrs["n_segments"]
        (5, 4)
    """
    by_patch = isinstance(segments, str) and segments == "patch"
    s = setup(model, image, saliency, metric="irof", mode="token" if by_patch else "pixel", substrate=substrate,
              score=score, target=target, batch_size=batch_size, seed=seed, patch_size=patch_size,
              nli_noise=nli_noise)
    if by_patch:
        labels, seg_saliency = None, s.cells.ravel()
    else:
        sal = as_map(saliency, "saliency")
        if sal.shape != s.shape:
            raise ArgumentError(f"saliency: segments other than 'patch' need the map at the input size {s.shape}, "
                                f"got {sal.shape}")
        labels = segment_labels(s.x, segments)
        counts = np.bincount(labels.ravel())
        seg_saliency = np.bincount(labels.ravel(), weights=sal.ravel()) / counts
    n = int(seg_saliency.size)
    order = np.argsort(-seg_saliency, kind="stable")
    removals = [order[:k] for k in range(n + 1)]
    scores = removed_scores(s, removals, progress=progress, desc=f"IROF ({substrate})", labels=labels)
    frac = np.arange(n + 1) / n
    if scores[0] == 0.0:
        value = nan_because("irof", "the intact input scores 0 for the class; the relative score is undefined")
        rel = np.full(n + 1, np.nan)
    else:
        rel = scores / scores[0]
        value = 1.0 - area_under_curve(rel, frac)
    attrs = {**s.attrs, "segmentation": segments if isinstance(segments, str) else "given labels",
             "n_segments": n, "intact_score": float(scores[0]), "irof": value, "value": value}
    return xr.DataArray(rel, dims=("fraction",), coords={"fraction": frac, "segments": ("fraction", np.arange(n + 1))},
                        name="irof", attrs=attrs)
