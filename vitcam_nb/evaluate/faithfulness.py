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
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import xarray as xr

from vitcam_nb.evaluate._common import as_map, recipe_fields, warn

__all__ = ["SUBSTRATES", "deletion", "insertion", "lerf_morf_area", "model_input", "noisy_linear_imputation",
           "road"]

SUBSTRATES = ("mean", "image_mean", "blur", "nli")
_MODES = ("token", "pixel")
_SCORES = ("prob", "logit")
_ORDERS = ("morf", "lerf")
_AUTO_PROGRESS_INPUTS = 256  # show a progress bar by default when a run scores this many inputs


# --------------------------------------------------------------------------------------------------
# inputs


def model_input(model: torch.nn.Module, image: object) -> tuple[torch.Tensor, str]:
    """The model input ``(1, 3, H, W)`` for ``image`` and a word on how it was made.

    * a trace (``xarray.Dataset``): its ``image`` (the display copy the maps are aligned to),
      normalised with the mean and std recorded in the trace; no resize or crop.
    * an HxWx3 uint8 array at the model's input size: normalised with the model's timm data config,
      no resize or crop (re-running the eval transform would crop it again and misalign the map);
      any other size goes through the model's timm eval transform, as in ``vc.trace``.
    * a float tensor ``(1, 3, H, W)`` or ``(3, H, W)``: used as given (already normalised).

    Example:
        >>> x, how = model_input(torch.nn.Identity(), torch.zeros(3, 8, 8))
        >>> tuple(x.shape), how
        ((1, 3, 8, 8), 'tensor (used as given)')
    """
    if isinstance(image, xr.Dataset):
        if "image" not in image:
            raise ValueError("image: the trace has no 'image' variable")
        pixels = np.asarray(image["image"].transpose("y", "x", "rgb").values)
        facts = json.loads(image.attrs.get("preprocessing", "{}") or "{}")
        if "mean" in facts and "std" in facts:
            mean, std = facts["mean"], facts["std"]
        else:
            mean, std = _mean_std(model)
        return _normalise(pixels, mean, std), "trace image, normalised as recorded"
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
            raise ValueError(f"image: expected an HxWx3 uint8 array, got shape {image.shape} "
                             f"dtype {image.dtype}")
        size = _input_size(model)
        if size is None or tuple(image.shape[:2]) == size:
            return _normalise(image, *_mean_std(model)), "uint8 array, normalised at its size"
        from vitcam_nb.preprocess import prepare_input

        return prepare_input(model, image).tensor, "uint8 array, timm eval transform"
    if isinstance(image, torch.Tensor):
        t = image.detach()
        if t.ndim == 3:
            t = t.unsqueeze(0)
        if t.ndim != 4 or t.shape[:2] != (1, 3) or not t.is_floating_point():
            raise ValueError(f"image: expected a float tensor (1,3,H,W) or (3,H,W), got {tuple(image.shape)} "
                             f"{image.dtype}")
        if not torch.isfinite(t).all():
            raise ValueError("image: contains NaN or inf")
        return t.to(torch.float32).clone(), "tensor (used as given)"
    raise ValueError("image: expected a trace, an HxWx3 uint8 array or a float tensor, "
                     f"got {type(image).__name__}")


def _data_config(model: torch.nn.Module) -> dict | None:
    if not any(hasattr(model, a) for a in ("pretrained_cfg", "default_cfg", "patch_embed")):
        return None  # timm would answer ImageNet defaults at 224 px for any module: do not guess
    try:
        from vitcam_nb.preprocess import data_config

        return data_config(model)
    except Exception:  # a plain torch module without a timm config
        return None


def _mean_std(model: torch.nn.Module) -> tuple[Sequence[float], Sequence[float]]:
    cfg = _data_config(model)
    if cfg is None:
        raise ValueError("image: cannot normalise a uint8 array for a model without a timm data config; "
                         "pass a normalised float tensor")
    return cfg["mean"], cfg["std"]


def _input_size(model: torch.nn.Module) -> tuple[int, int] | None:
    cfg = _data_config(model)
    return None if cfg is None else tuple(int(v) for v in cfg["input_size"][1:])


def _model_name(model: torch.nn.Module) -> str:
    cfg = getattr(model, "pretrained_cfg", None)
    arch = cfg.get("architecture") if isinstance(cfg, dict) else None
    return str(arch or type(model).__name__)


def _normalise(pixels: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
    m = torch.tensor([float(v) for v in mean]).view(1, 3, 1, 1)
    s = torch.tensor([float(v) for v in std]).view(1, 3, 1, 1)
    return (t - m) / s


def _patch_size(
    model: torch.nn.Module, image: object, patch_size: int | Sequence[int] | None
) -> tuple[int, int]:
    value: object = patch_size
    if value is None and isinstance(image, xr.Dataset) and "patch_size" in image.attrs:
        value = image.attrs["patch_size"]
        if isinstance(value, str):
            value = tuple(int(v) for v in value.split("x"))
    if value is None:
        pe = getattr(model, "patch_embed", None)
        value = getattr(pe, "patch_size", None)
    if value is None:
        raise ValueError("patch_size: token mode needs the patch size; pass patch_size=, a trace, or a model "
                         "with patch_embed.patch_size")
    if isinstance(value, (int, np.integer)):
        value = (int(value), int(value))
    ph, pw = (int(v) for v in value)
    if ph < 1 or pw < 1:
        raise ValueError(f"patch_size: expected positive sizes, got {value!r}")
    return ph, pw


# --------------------------------------------------------------------------------------------------
# removal order


def _cell_scores(
    sal: np.ndarray, shape: tuple[int, int], mode: str, patch: tuple[int, int] | None
) -> np.ndarray:
    h, w = shape
    if mode == "pixel":
        if sal.shape != (h, w):
            raise ValueError(f"saliency: pixel mode needs a map of the input size {(h, w)}, got {sal.shape}; "
                             "use the upsampled map (vc.cam(tr, recipe)) or mode='token'")
        return sal
    ph, pw = patch
    if h % ph or w % pw:
        raise ValueError(f"patch_size: {ph}x{pw} patches do not tile the {h}x{w} input")
    gh, gw = h // ph, w // pw
    if sal.shape == (gh, gw):
        return sal
    if sal.shape == (h, w):
        return sal.reshape(gh, ph, gw, pw).mean(axis=(1, 3))
    raise ValueError(f"saliency: token mode needs a map on the token grid {(gh, gw)} or at the input size "
                     f"{(h, w)}, got {sal.shape}")


def _pixel_rank(cells: np.ndarray, shape: tuple[int, int], order: str) -> np.ndarray:
    """Position of each pixel's cell in the removal order (0 = removed first), at pixel resolution."""
    flat = cells.ravel()
    idx = np.argsort(-flat if order == "morf" else flat, kind="stable")
    rank = np.empty(flat.size, dtype=np.int64)
    rank[idx] = np.arange(flat.size)
    rank = rank.reshape(cells.shape)
    fy, fx = shape[0] // cells.shape[0], shape[1] // cells.shape[1]
    return np.repeat(np.repeat(rank, fy, axis=0), fx, axis=1)


# --------------------------------------------------------------------------------------------------
# substrates


def _blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    radius = max(1, int(round(sigma)))
    t = torch.arange(-radius, radius + 1, dtype=torch.float32)
    k = torch.exp(-(t**2) / (2.0 * sigma**2))
    k = k / k.sum()
    c = x.shape[1]
    horizontal = k.view(1, 1, 1, -1).repeat(c, 1, 1, 1)
    vertical = k.view(1, 1, -1, 1).repeat(c, 1, 1, 1)
    y = torch.nn.functional.conv2d(x, horizontal, padding=(0, radius), groups=c)
    return torch.nn.functional.conv2d(y, vertical, padding=(radius, 0), groups=c)


_NEIGHBOURS = [(-1, 0, 1 / 6), (1, 0, 1 / 6), (0, -1, 1 / 6), (0, 1, 1 / 6),
               (-1, -1, 1 / 12), (-1, 1, 1 / 12), (1, -1, 1 / 12), (1, 1, 1 / 12)]


def noisy_linear_imputation(
    image: np.ndarray, removed: np.ndarray, noise: float = 0.01, seed: int | np.random.SeedSequence = 0
) -> np.ndarray:
    """Fill the ``removed`` pixels of ``image`` (C, H, W) by noisy linear imputation (ROAD).

    Each removed pixel is set to the weighted mean of its 8 neighbours (1/6 for edge, 1/12 for corner
    neighbours, renormalised at the border), removed neighbours being unknowns too: one sparse linear
    system for all channels. Gaussian noise of std ``noise`` is added to the imputed pixels. When every
    pixel is removed there is nothing to interpolate from: they become 0 (the model's mean colour) plus
    noise.

    Example:
        >>> img = np.ones((3, 5, 5)); hole = np.zeros((5, 5), bool); hole[2, 2] = True
        >>> float(noisy_linear_imputation(img, hole, noise=0.0)[0, 2, 2])
        1.0
    """
    from scipy import sparse
    from scipy.sparse.linalg import splu

    x = np.asarray(image, dtype=np.float64)
    rem = np.asarray(removed, dtype=bool)
    if x.ndim != 3 or rem.shape != x.shape[1:]:
        raise ValueError(f"removed: expected a mask of shape {x.shape[1:]}, got {rem.shape}")
    out = x.copy()
    n = int(rem.sum())
    if n == 0:
        return out
    rng = np.random.default_rng(seed)
    if n == rem.size:
        return rng.normal(0.0, noise, size=x.shape) if noise > 0 else np.zeros_like(x)
    h, w = rem.shape
    unknown = np.full(rem.shape, -1, dtype=np.int64)
    ys, xs = np.nonzero(rem)
    unknown[ys, xs] = np.arange(n)
    diag = np.zeros(n)
    rhs = np.zeros((n, x.shape[0]))
    rows, cols, vals = [], [], []
    for dy, dx, wgt in _NEIGHBOURS:
        ny, nx = ys + dy, xs + dx
        inside = (ny >= 0) & (ny < h) & (nx >= 0) & (nx < w)
        i = np.nonzero(inside)[0]
        ny, nx = ny[inside], nx[inside]
        diag[i] += wgt
        j = unknown[ny, nx]
        is_unknown = j >= 0
        rows.append(i[is_unknown])
        cols.append(j[is_unknown])
        vals.append(np.full(int(is_unknown.sum()), -wgt))
        known = ~is_unknown
        np.add.at(rhs, i[known], wgt * x[:, ny[known], nx[known]].T)
    ii = np.concatenate([np.arange(n), *rows])
    jj = np.concatenate([np.arange(n), *cols])
    a = sparse.csc_matrix((np.concatenate([diag, *vals]), (ii, jj)), shape=(n, n))
    filled = splu(a).solve(rhs)
    if noise > 0:
        filled = filled + rng.normal(0.0, noise, size=filled.shape)
    out[:, ys, xs] = filled.T
    return out


# --------------------------------------------------------------------------------------------------
# the engine: scores of perturbed inputs, batched


def _check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")


def _progress(show: bool | None, n_inputs: int) -> bool:
    return n_inputs >= _AUTO_PROGRESS_INPUTS if show is None else bool(show)


class _Scorer:
    """Calls the model on batches in eval mode without gradients, restoring every module's mode."""

    def __init__(self, model: torch.nn.Module, score: str):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.model, self.score = model, score
        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self.dtype = params[0].dtype if params else torch.float32

    def logits(self, batch: torch.Tensor) -> torch.Tensor:
        modes = [(m, m.training) for m in self.model.modules()]
        try:
            self.model.eval()
            with torch.no_grad():
                out = self.model(batch.to(self.device, self.dtype))
        finally:
            for m, mode in modes:
                m.training = mode
        if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != batch.shape[0]:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"model: expected logits of shape (batch, classes), got {shape}")
        return out.detach().to("cpu", torch.float32)

    def __call__(self, batch: torch.Tensor, target: int) -> np.ndarray:
        z = self.logits(batch)
        if self.score == "prob":
            z = torch.softmax(z, dim=1)
        return z[:, target].numpy().astype(np.float64)


def _resolve_target(scorer: _Scorer, x: torch.Tensor, target: int | None, saliency: object) -> int:
    """The class to score: ``target``, else the class the saliency's recipe names, else the prediction."""
    logits = scorer.logits(x)
    n_classes = logits.shape[1]
    if target is None:
        cls = recipe_fields(saliency).get("class_", "top1")
        if isinstance(cls, int) and not isinstance(cls, bool) and 0 <= cls < n_classes:
            return cls
        rank = int(cls[3:]) if isinstance(cls, str) and cls[3:].isdigit() and cls.startswith("top") else 1
        return int(torch.argsort(logits[0], descending=True, stable=True)[min(rank, n_classes) - 1])
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= target < n_classes:
        raise ValueError(f"target: expected a class index in 0..{n_classes - 1} or None (the predicted "
                         f"class), got {target!r}")
    return int(target)


def _substrate_fixed(x: torch.Tensor, substrate: str, blur_sigma: float) -> torch.Tensor | None:
    if substrate == "mean":
        return torch.zeros_like(x)
    if substrate == "image_mean":
        return x.mean(dim=(2, 3), keepdim=True).expand_as(x).clone()
    if substrate == "blur":
        return _blur(x, blur_sigma)
    return None  # nli depends on what is removed


def _perturbation_scores(
    scorer: _Scorer, x: torch.Tensor, ranks: Sequence[np.ndarray], counts: np.ndarray, *, kind: str,
    substrate: str, target: int, batch_size: int, seed: int, nli_noise: float, blur_sigma: float,
    progress: bool | None, desc: str,
) -> np.ndarray:
    """Scores (n_maps, n_counts): for each removal rank map, the input with the first ``count`` cells
    removed (deletion) or only the first ``count`` cells kept on the substrate (insertion)."""
    from tqdm.auto import tqdm

    fixed = _substrate_fixed(x, substrate, blur_sigma)
    x_np = x[0].numpy().astype(np.float64)
    n_cells = int(max(int(r.max()) for r in ranks)) + 1 if len(ranks) else 0

    def removed(rank_t: torch.Tensor, count: int) -> torch.Tensor:
        return rank_t < count if kind == "deletion" else rank_t >= count

    # Inputs that do not depend on the order (nothing or everything removed) are scored once and shared.
    def shared(count: int) -> bool:
        nothing = (count == 0) if kind == "deletion" else (count >= n_cells)
        return nothing or (fixed is not None and count in (0, n_cells))

    jobs = [(mi, ci) for mi in range(len(ranks)) for ci, c in enumerate(counts)
            if mi == 0 or not shared(int(c))]

    def inputs() -> Iterator[torch.Tensor]:
        for mi, ci in jobs:
            gone = removed(torch.from_numpy(ranks[mi]), int(counts[ci]))
            if not gone.any():
                yield x[0]
            elif fixed is not None:
                yield torch.where(gone, fixed[0], x[0])
            else:
                seq = np.random.SeedSequence([seed, mi, ci])
                filled = noisy_linear_imputation(x_np, gone.numpy(), nli_noise, seq)
                yield torch.from_numpy(filled.astype(np.float32))

    total = len(jobs)
    scores = np.empty(total)
    n_batches = math.ceil(total / batch_size)
    stream = inputs()
    with tqdm(total=n_batches, desc=desc, disable=not _progress(progress, total), leave=False) as bar:
        for b in range(n_batches):
            batch = [next(stream) for _ in range(min(batch_size, total - b * batch_size))]
            scores[b * batch_size: b * batch_size + len(batch)] = scorer(torch.stack(batch), target)
            bar.update(1)
    out = np.full((len(ranks), len(counts)), np.nan)
    for (mi, ci), v in zip(jobs, scores, strict=True):
        out[mi, ci] = v
    for ci, c in enumerate(counts):
        if shared(int(c)):
            out[1:, ci] = out[0, ci]
    return out.reshape(len(ranks), len(counts))


def _auc(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sum((y[1:] + y[:-1]) / 2.0 * np.diff(x)))


class _Setup:
    """Validated settings shared by deletion, insertion, lerf_morf_area and road."""

    def __init__(self, model, image, saliency, *, mode, substrate, step, score, order, target, batch_size,
                 seed, patch_size, blur_sigma, nli_noise, metric):
        _check_choice("mode", mode, _MODES)
        _check_choice("substrate", substrate, SUBSTRATES)
        _check_choice("score", score, _SCORES)
        _check_choice("order", order, _ORDERS)
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
        if not (np.isfinite(nli_noise) and nli_noise >= 0):
            raise ValueError(f"nli_noise: expected a non-negative number, got {nli_noise!r}")
        self.scorer = _Scorer(model, score)
        self.x, self.input_kind = model_input(model, image)
        h, w = self.x.shape[-2:]
        self.shape = (int(h), int(w))
        self.patch = _patch_size(model, image, patch_size) if mode == "token" else None
        sal = as_map(saliency, "saliency")
        self.cells = _cell_scores(sal, self.shape, mode, self.patch)
        if np.ptp(self.cells) == 0.0:
            warn(f"{metric}: the saliency map is constant; cells are removed in row-major order and the "
                 "curve says nothing about the map")
        self.n_cells = int(self.cells.size)
        if blur_sigma is None:
            blur_sigma = 5.0 * math.sqrt(h * w) / 224.0
        if not (np.isfinite(blur_sigma) and blur_sigma > 0):
            raise ValueError(f"blur_sigma: expected a positive number of pixels, got {blur_sigma!r}")
        self.target = _resolve_target(self.scorer, self.x, target, saliency)
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
            "model": _model_name(model),
        }
        if substrate == "blur":
            self.attrs["blur_sigma"] = float(blur_sigma)
            self.attrs["blur_radius"] = max(1, int(round(blur_sigma)))
        if substrate == "nli":
            self.attrs["nli_noise"] = float(nli_noise)
        if isinstance(saliency, xr.DataArray) and "recipe_id" in saliency.attrs:
            self.attrs["saliency_recipe_id"] = str(saliency.attrs["recipe_id"])

    def rank(self, order: str) -> np.ndarray:
        return _pixel_rank(self.cells, self.shape, order)

    def counts(self, step: int | None) -> tuple[np.ndarray, int]:
        if step is None:
            step = 1 if self.patch else max(1, math.ceil(self.n_cells / 224))
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 1 <= step <= self.n_cells:
            raise ValueError(f"step: expected an int number of {self.attrs['cell']}s per step in "
                             f"1..{self.n_cells}, got {step!r}")
        counts = np.arange(0, self.n_cells + step, step)
        counts[-1] = self.n_cells
        return np.unique(counts), int(step)


def _curve(kind: str, model, image, saliency, *, mode, substrate, step, score, order, target, batch_size,
           seed, patch_size, blur_sigma, nli_noise, progress) -> xr.DataArray:
    s = _Setup(model, image, saliency, mode=mode, substrate=substrate, step=step, score=score, order=order,
               target=target, batch_size=batch_size, seed=seed, patch_size=patch_size, blur_sigma=blur_sigma,
               nli_noise=nli_noise, metric=kind)
    counts, step = s.counts(step)
    y = _perturbation_scores(s.scorer, s.x, [s.rank(order)], counts, kind=kind, progress=progress,
                             desc=f"{kind} ({mode}, {substrate})", **s.kw)[0]
    frac = counts / s.n_cells
    attrs = {**s.attrs, "step": step, "n_steps": len(counts) - 1, "auc": _auc(y, frac)}
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
    s = _Setup(model, image, saliency, mode=mode, substrate=substrate, step=step, score=score, order="morf",
               target=target, batch_size=batch_size, seed=seed, patch_size=patch_size, blur_sigma=blur_sigma,
               nli_noise=nli_noise, metric="lerf_morf_area")
    counts, step = s.counts(step)
    y = _perturbation_scores(s.scorer, s.x, [s.rank("morf"), s.rank("lerf")], counts, kind="deletion",
                             progress=progress, desc=f"LeRF-MoRF ({mode}, {substrate})", **s.kw)
    frac = counts / s.n_cells
    morf, lerf = _auc(y[0], frac), _auc(y[1], frac)
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
        raise ValueError(f"percentiles: expected strictly increasing fractions in [0, 1], "
                         f"got {percentiles!r}")
    s = _Setup(model, image, saliency, mode=mode, substrate=substrate, step=None, score=score, order=order,
               target=target, batch_size=batch_size, seed=seed, patch_size=patch_size, blur_sigma=blur_sigma,
               nli_noise=nli_noise, metric="road")
    counts = np.rint(p * s.n_cells).astype(np.int64)
    y = _perturbation_scores(s.scorer, s.x, [s.rank(order)], counts, kind="deletion", progress=progress,
                             desc=f"ROAD ({order}, {substrate})", **s.kw)[0]
    attrs = {**s.attrs, "percentiles": json.dumps([float(v) for v in p]), "mean": float(y.mean())}
    return xr.DataArray(y, dims=("percentile",), coords={"percentile": p, "cells": ("percentile", counts)},
                        name="road", attrs=attrs)
