"""Faithfulness: does removing what the map calls relevant change the model's score?

These metrics call the model. Inputs are built in batches, every random draw is seeded, and long runs
show a progress bar (``tqdm.auto``). Every setting that changes the numbers (mode, substrate, step,
score, order, seed, blur width, imputation noise) is recorded in the result's attrs.

* **token mode** removes whole patches, most relevant first, ordering patches by the map averaged per
  patch (the natural unit of a ViT); **pixel mode** removes pixels in the protocol of RISE
  (Petsiuk et al. 2018): a fixed number of pixels per step, the trapezoidal area under the curve over
  the fraction removed, softmax probability of the class as the score.
* **substrates** (what a removed region becomes): ``"mean"`` the model's normalisation mean colour, a
  zero input tensor (RISE's deletion substrate); ``"image_mean"`` this image's mean colour;
  ``"blur"`` a Gaussian blur of the image (RISE's insertion substrate: sigma 5 px, radius 5 px at
  224 px, both scaled with the image size; zero padding); ``"nli"`` noisy linear imputation
  (Rong et al. 2022, ROAD): each removed pixel equals the weighted mean of its 8 neighbours (weights
  1/6 for edge and 1/12 for corner neighbours), solved as one sparse linear system, plus Gaussian
  noise of ``nli_noise`` (in model-input units).

The model is put in eval mode while it is scored and every module's train/eval flag is restored
afterwards; parameters are never touched.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate._common import as_map, warn
from vitcam_nb.evaluate.faithfulness.perturbation import (
    MODES,
    ORDERS,
    SCORES,
    Scorer,
    area_under_curve,
    cell_scores,
    check_choice,
    model_input,
    model_name,
    patch_size_of,
    perturbation_scores,
    pixel_rank,
    resolve_target,
)
from vitcam_nb.evaluate.faithfulness.substrates import SUBSTRATES

__all__ = ["PerturbationSetup", "deletion", "insertion", "lerf_morf_area", "road"]


class PerturbationSetup:
    """Validated settings shared by deletion, insertion, lerf_morf_area and road: the model input, the cells
    and their saliency, the class scored, and the attrs every result records.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 3))
        >>> s = PerturbationSetup(net, torch.ones(1, 3, 4, 4), np.eye(4), mode="token", substrate="mean", step=None,
        ...                       score="prob", order="morf", target=None, batch_size=8, seed=0, patch_size=2,
        ...                       blur_sigma=None, nli_noise=0.01, metric="deletion")
        >>> s.n_cells, s.attrs["cell"], s.counts(None)[0].tolist()
        (4, 'patch', [0, 1, 2, 3, 4])
    """

    def __init__(self, model, image, saliency, *, mode, substrate, step, score, order, target, batch_size,
                 seed, patch_size, blur_sigma, nli_noise, metric):
        check_choice("mode", mode, MODES)
        check_choice("substrate", substrate, SUBSTRATES)
        check_choice("score", score, SCORES)
        check_choice("order", order, ORDERS)
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ArgumentError(f"batch_size: expected a positive int, got {batch_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ArgumentError(f"seed: expected a non-negative int, got {seed!r}")
        if not (np.isfinite(nli_noise) and nli_noise >= 0):
            raise ArgumentError(f"nli_noise: expected a non-negative number, got {nli_noise!r}")
        self.scorer = Scorer(model, score)
        self.x, self.input_kind = model_input(model, image)
        h, w = self.x.shape[-2:]
        self.shape = (int(h), int(w))
        self.patch = patch_size_of(model, image, patch_size) if mode == "token" else None
        sal = as_map(saliency, "saliency")
        self.cells = cell_scores(sal, self.shape, mode, self.patch)
        if np.ptp(self.cells) == 0.0:
            warn(f"{metric}: the saliency map is constant; cells are removed in row-major order and the "
                 "curve says nothing about the map")
        self.n_cells = int(self.cells.size)
        if blur_sigma is None:
            blur_sigma = 5.0 * math.sqrt(h * w) / 224.0
        if not (np.isfinite(blur_sigma) and blur_sigma > 0):
            raise ArgumentError(f"blur_sigma: expected a positive number of pixels, got {blur_sigma!r}")
        self.target = resolve_target(self.scorer, self.x, target, saliency)
        self.settings = dict(mode=mode, substrate=substrate, score=score, order=order,
                             batch_size=int(batch_size), seed=int(seed), target=self.target, metric=metric)
        self.kw = dict(substrate=substrate, target=self.target, batch_size=int(batch_size), seed=int(seed),
                       nli_noise=float(nli_noise), blur_sigma=float(blur_sigma))
        self.attrs = {
            **{k: v for k, v in self.settings.items()},
            "n_cells": self.n_cells,
            "cell": "patch" if mode == "token" else "pixel",
            "patch_size": f"{self.patch[0]}x{self.patch[1]}" if self.patch else "",
            "input_kind": self.input_kind,
            "input_size": f"{h}x{w}",
            "model": model_name(model),
        }
        if substrate == "blur":
            self.attrs["blur_sigma"] = float(blur_sigma)
            self.attrs["blur_radius"] = max(1, int(round(blur_sigma)))
        if substrate == "nli":
            self.attrs["nli_noise"] = float(nli_noise)
        if isinstance(saliency, xr.DataArray) and "recipe_id" in saliency.attrs:
            self.attrs["saliency_recipe_id"] = str(saliency.attrs["recipe_id"])

    def rank(self, order: str) -> np.ndarray:
        return pixel_rank(self.cells, self.shape, order)

    def counts(self, step: int | None) -> tuple[np.ndarray, int]:
        if step is None:
            step = 1 if self.patch else max(1, math.ceil(self.n_cells / 224))
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 1 <= step <= self.n_cells:
            raise ArgumentError(f"step: expected an int number of {self.attrs['cell']}s per step in "
                                f"1..{self.n_cells}, got {step!r}")
        counts = np.arange(0, self.n_cells + step, step)
        counts[-1] = self.n_cells
        return np.unique(counts), int(step)


def _curve(kind: str, model, image, saliency, *, mode, substrate, step, score, order, target, batch_size,
           seed, patch_size, blur_sigma, nli_noise, progress) -> xr.DataArray:
    s = PerturbationSetup(model, image, saliency, mode=mode, substrate=substrate, step=step, score=score, order=order,
               target=target, batch_size=batch_size, seed=seed, patch_size=patch_size, blur_sigma=blur_sigma,
               nli_noise=nli_noise, metric=kind)
    counts, step = s.counts(step)
    y = perturbation_scores(s.scorer, s.x, [s.rank(order)], counts, kind=kind, progress=progress,
                             desc=f"{kind} ({mode}, {substrate})", **s.kw)[0]
    frac = counts / s.n_cells
    attrs = {**s.attrs, "step": step, "n_steps": len(counts) - 1, "auc": area_under_curve(y, frac)}
    return xr.DataArray(y, dims=("fraction",), coords={"fraction": frac, "cells": ("fraction", counts)},
                        name=kind, attrs=attrs)


def deletion(
    model: torch.nn.Module,
    image: object,
    saliency: object,
    target: int | None = None,
    *,
    mode: str = "token",
    substrate: str = "mean",
    step: int | None = None,
    score: str = "prob",
    order: str = "morf",
    batch_size: int = 64,
    seed: int = 0,
    patch_size: int | Sequence[int] | None = None,
    blur_sigma: float | None = None,
    nli_noise: float = 0.01,
    progress: bool | None = None,
) -> xr.DataArray:
    """Deletion curve: the class score as the most relevant cells are removed first (lower AUC = more
    faithful map).

    Args:
        model: a classifier returning logits ``(batch, classes)`` for normalised ``(batch, 3, H, W)``.
        image: a trace, an HxWx3 uint8 array or a normalised float tensor (see :func:`model_input`).
        saliency: 2-D map at the input size, or on the token grid (token mode).
        target: class index; None takes the class of the saliency's recipe (a map from ``vc.cam``
            carries it: an index, or ``topN`` = the N-th highest logit of the intact image), else the
            class the model predicts for the intact image.
        mode: ``"token"`` removes whole patches (ordered by the map averaged per patch), ``"pixel"``
            removes pixels (RISE protocol).
        substrate: ``"mean"`` (zero input), ``"image_mean"``, ``"blur"`` or ``"nli"``.
        step: cells per step; default one patch (token) or ceil(H*W/224) pixels (RISE: 224 at 224 px).
        score: ``"prob"`` (softmax probability, RISE) or ``"logit"``.
        order: ``"morf"`` (most relevant first) or ``"lerf"`` (least relevant first).
        batch_size, seed, progress: inputs per model call; seed of the NLI noise; progress bar
            (None: shown for runs of 256 inputs or more).
        patch_size: token-mode patch size when neither a trace nor ``model.patch_embed`` says it.
        blur_sigma: blur width in pixels (default 5 px at 224 px, scaled); nli_noise: NLI noise std.

    Returns:
        DataArray over ``fraction`` (removed), with coordinate ``cells``; attrs hold ``auc`` and every
        setting.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))
        >>> curve = deletion(net, torch.ones(1, 3, 4, 4), np.eye(4), patch_size=1, progress=False)
        >>> curve.sizes["fraction"], curve.attrs["substrate"]
        (17, 'mean')
    """
    return _curve("deletion", model, image, saliency, mode=mode, substrate=substrate, step=step, score=score,
                  order=order, target=target, batch_size=batch_size, seed=seed, patch_size=patch_size,
                  blur_sigma=blur_sigma, nli_noise=nli_noise, progress=progress)


def insertion(
    model: torch.nn.Module,
    image: object,
    saliency: object,
    target: int | None = None,
    *,
    mode: str = "token",
    substrate: str = "blur",
    step: int | None = None,
    score: str = "prob",
    order: str = "morf",
    batch_size: int = 64,
    seed: int = 0,
    patch_size: int | Sequence[int] | None = None,
    blur_sigma: float | None = None,
    nli_noise: float = 0.01,
    progress: bool | None = None,
) -> xr.DataArray:
    """Insertion curve: the class score as the most relevant cells are put back first onto the substrate
    (higher AUC = more faithful map). Arguments as in :func:`deletion`; the default substrate is
    ``"blur"`` as in RISE.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))
        >>> curve = insertion(net, torch.ones(1, 3, 4, 4), np.eye(4), patch_size=2, progress=False)
        >>> curve.sizes["fraction"], curve.attrs["metric"]
        (5, 'insertion')
    """
    return _curve("insertion", model, image, saliency, mode=mode, substrate=substrate, step=step, score=score,
                  order=order, target=target, batch_size=batch_size, seed=seed, patch_size=patch_size,
                  blur_sigma=blur_sigma, nli_noise=nli_noise, progress=progress)


def lerf_morf_area(
    model: torch.nn.Module,
    image: object,
    saliency: object,
    target: int | None = None,
    *,
    mode: str = "token",
    substrate: str = "mean",
    step: int | None = None,
    score: str = "prob",
    batch_size: int = 64,
    seed: int = 0,
    patch_size: int | Sequence[int] | None = None,
    blur_sigma: float | None = None,
    nli_noise: float = 0.01,
    progress: bool | None = None,
) -> xr.DataArray:
    """Area between the LeRF and MoRF deletion curves (Samek et al. 2017; larger = more faithful).

    Both deletion curves in one batched run: removing the least relevant cells first should keep the
    score up, the most relevant first should drop it. Arguments as in :func:`deletion`.

    Returns:
        DataArray ``(order, fraction)`` with ``order`` = ["morf", "lerf"]; attrs ``area`` =
        AUC(LeRF) - AUC(MoRF), ``morf_auc``, ``lerf_auc`` and every setting.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))
        >>> da = lerf_morf_area(net, torch.ones(1, 3, 4, 4), np.eye(4), patch_size=2, progress=False)
        >>> da["order"].values.tolist(), "area" in da.attrs
        (['morf', 'lerf'], True)
    """
    s = PerturbationSetup(model, image, saliency, mode=mode, substrate=substrate, step=step, score=score, order="morf",
               target=target, batch_size=batch_size, seed=seed, patch_size=patch_size, blur_sigma=blur_sigma,
               nli_noise=nli_noise, metric="lerf_morf_area")
    counts, step = s.counts(step)
    y = perturbation_scores(s.scorer, s.x, [s.rank("morf"), s.rank("lerf")], counts, kind="deletion",
                             progress=progress, desc=f"LeRF-MoRF ({mode}, {substrate})", **s.kw)
    frac = counts / s.n_cells
    morf, lerf = area_under_curve(y[0], frac), area_under_curve(y[1], frac)
    attrs = {**s.attrs, "order": "morf,lerf", "step": step, "n_steps": len(counts) - 1, "morf_auc": morf,
             "lerf_auc": lerf, "area": lerf - morf}
    return xr.DataArray(y, dims=("order", "fraction"),
                        coords={"order": ["morf", "lerf"], "fraction": frac, "cells": ("fraction", counts)},
                        name="lerf_morf", attrs=attrs)


def road(
    model: torch.nn.Module,
    image: object,
    saliency: object,
    target: int | None = None,
    *,
    percentiles: Sequence[float] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
    order: str = "morf",
    substrate: str = "nli",
    mode: str = "pixel",
    score: str = "prob",
    batch_size: int = 64,
    seed: int = 0,
    patch_size: int | Sequence[int] | None = None,
    blur_sigma: float | None = None,
    nli_noise: float = 0.01,
    progress: bool | None = None,
) -> xr.DataArray:
    """ROAD (Rong et al. 2022): the class score after removing the given fractions of pixels by noisy
    linear imputation, most relevant first (``order="morf"``: lower is better) or least relevant first
    (``"lerf"``: higher is better).

    ``percentiles`` are fractions in [0, 1], strictly increasing (default 0.1 ... 0.9). Other arguments
    as in :func:`deletion`.

    Returns:
        DataArray over ``percentile`` with coordinate ``cells``; attrs ``mean`` (mean score over the
        percentiles), ``percentiles`` and every setting.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))
        >>> r = road(net, torch.ones(1, 3, 4, 4), np.eye(4), percentiles=(0.25, 0.5), progress=False)
        >>> r.sizes["percentile"], r.attrs["substrate"]
        (2, 'nli')
    """
    p = np.asarray(percentiles, dtype=np.float64)
    if p.ndim != 1 or p.size == 0 or not np.all((p >= 0) & (p <= 1)) or np.any(np.diff(p) <= 0):
        raise ArgumentError(f"percentiles: expected strictly increasing fractions in [0, 1], "
                            f"got {percentiles!r}")
    s = PerturbationSetup(model, image, saliency, mode=mode, substrate=substrate, step=None, score=score, order=order,
               target=target, batch_size=batch_size, seed=seed, patch_size=patch_size, blur_sigma=blur_sigma,
               nli_noise=nli_noise, metric="road")
    counts = np.rint(p * s.n_cells).astype(np.int64)
    y = perturbation_scores(s.scorer, s.x, [s.rank(order)], counts, kind="deletion", progress=progress,
                             desc=f"ROAD ({order}, {substrate})", **s.kw)[0]
    attrs = {**s.attrs, "percentiles": json.dumps([float(v) for v in p]), "mean": float(y.mean())}
    return xr.DataArray(y, dims=("percentile",), coords={"percentile": p, "cells": ("percentile", counts)},
                        name="road", attrs=attrs)
