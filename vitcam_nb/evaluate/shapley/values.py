"""Exact Shapley values of patch groups: the image cut into a ``gy x gx`` grid of groups, the model scored on all
``2^n`` inputs where each group is either the image's or the baseline's, and every group's Shapley value computed
from those ``2^n`` scores by the closed formula

``phi_i = sum over S not containing i of |S|! (n - |S| - 1)! / n! * (v(S + i) - v(S))``.

No sampling, no approximation: the values are a ground truth a heatmap can be ranked against
(:func:`~vitcam_nb.evaluate.shapley.agreement.shapley_agreement`). They satisfy efficiency exactly (up to float
rounding): ``sum(phi) = v(all groups) - v(no group)``.

Example:
    >>> exact_shapley(np.array([0.0, 1.0, 2.0, 3.0])).tolist()  # v = 1 * [group 0] + 2 * [group 1]
    [1.0, 2.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from vitcam_nb.capture.budget import BUDGET_FRACTION, available_bytes
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.provenance import array_sha256, weights_origin, weights_sha256
from vitcam_nb.evaluate.faithfulness.perturbation import (
    SCORES,
    Scorer,
    check_choice,
    model_input,
    model_name,
    resolve_target,
    show_progress,
)
from vitcam_nb.evaluate.faithfulness.substrates import blur
from vitcam_nb.targets.classes import class_labels

__all__ = ["BASELINES", "check_shapley", "coalition_masks", "exact_shapley", "shapley_bytes", "shapley_patches"]

BASELINES = ("blur", "mean")
#: Groups scored without ``max_passes``: 2^20 = 1,048,576 forward passes (minutes on a small model); more take
#: hours or days whatever the memory, and are run only when asked for by number.
MAX_GROUPS = 20
#: How far the scores of one batch scored twice may differ (relative to the largest score): a deterministic model
#: gives the same numbers on the same inputs (same batch, same kernels); a model random in eval mode does not.
REPEAT_RTOL = 1e-5
# Bytes held per coalition besides the model: its score (float64), the masks and indices of the Shapley sum
# (int64 and bool temporaries of the closed formula, at most about four of them alive at once).
_BYTES_PER_COALITION = 8 * 5


def exact_shapley(v: np.ndarray) -> np.ndarray:
    """The Shapley value of every player from the values ``v`` of all ``2^n`` coalitions (``v[m]``: the coalition
    whose members are the set bits of ``m``; player ``i`` is bit ``i``), by the closed formula, vectorised per player.

    Example:
        >>> exact_shapley(np.array([0.0, 0.0, 0.0, 1.0])).tolist()  # only both together score: split evenly
        [0.5, 0.5]
    """
    v = np.asarray(v, dtype=np.float64)
    n = int(v.size).bit_length() - 1
    if v.ndim != 1 or n < 1 or v.size != 1 << n:
        raise ArgumentError(f"v: expected the values of all 2^n coalitions (n >= 1), got shape {v.shape}")
    idx = np.arange(v.size, dtype=np.int64)
    size = np.zeros(v.size, dtype=np.int64)
    for b in range(n):
        size += (idx >> b) & 1
    # |S|! (n - |S| - 1)! / n! = 1 / (n * C(n - 1, |S|)): no factorial overflows for large n
    weight = np.array([1.0 / (n * math.comb(n - 1, s)) for s in range(n)])
    phi = np.empty(n)
    for i in range(n):
        without = idx[((idx >> i) & 1) == 0]
        phi[i] = float(np.dot(weight[size[without]], v[without | (1 << i)] - v[without]))
    return phi


def coalition_masks(coalitions: np.ndarray, grid: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Boolean pixel masks ``(B, 1, H, W)``, True where a coalition's groups are present (group ``k`` = row-major
    cell ``(k // gx, k % gx)`` of the grid = bit ``k`` of the coalition).

    Example:
        >>> coalition_masks(np.array([1]), (1, 2), (1, 4))[0, 0].tolist()
        [[True, True, False, False]]
    """
    gy, gx = grid
    h, w = shape
    bits = (np.asarray(coalitions, np.int64)[:, None] >> np.arange(gy * gx)) & 1
    cells = torch.from_numpy(bits.astype(bool)).view(-1, 1, gy, gx)
    return cells.repeat_interleave(h // gy, dim=2).repeat_interleave(w // gx, dim=3)


def _check_grid(grid: object, shape: tuple[int, int]) -> tuple[int, int]:
    ok = (isinstance(grid, (tuple, list)) and len(grid) == 2
          and all(isinstance(g, (int, np.integer)) and not isinstance(g, bool) and g >= 1 for g in grid))
    if not ok:
        raise ArgumentError(f"grid: expected (rows, columns) of positive ints, e.g. (3, 3) or (4, 4), got {grid!r}")
    gy, gx = int(grid[0]), int(grid[1])
    h, w = shape
    if h % gy or w % gx or gy * gx < 2:
        rows = [g for g in range(1, 9) if h % g == 0]
        cols = [g for g in range(1, 9) if w % g == 0]
        raise ArgumentError(f"grid: {gy}x{gx} groups do not tile the {h}x{w} model input into equal groups of at least "
                            f"two; rows must divide {h} (up to 8: {rows}), columns must divide {w} (up to 8: {cols})")
    return gy, gx


def _baseline(baseline: object, x: torch.Tensor, blur_sigma: float) -> tuple[torch.Tensor, str]:
    """The input every absent group takes, and how it is named in the attrs."""
    if isinstance(baseline, str):
        check_choice("baseline", baseline, BASELINES)
        if baseline == "mean":  # a zero model input is the normalisation mean colour
            return torch.zeros_like(x), "mean (zero model input: the normalisation mean colour)"
        return blur(x, blur_sigma), f"blur (Gaussian, sigma {blur_sigma:.3g} px, zero padding)"
    if isinstance(baseline, (bool, np.bool_)):
        raise ArgumentError(f"baseline: expected one of {list(BASELINES)}, a number or a tensor, got {baseline!r}")
    if isinstance(baseline, (int, float, np.integer, np.floating)):
        if not np.isfinite(baseline):
            raise ArgumentError(f"baseline: expected a finite number, got {baseline!r}")
        return torch.full_like(x, float(baseline)), f"value {float(baseline):.6g} (model-input units)"
    try:
        t = torch.as_tensor(np.asarray(baseline, dtype=np.float32) if not isinstance(baseline, torch.Tensor)
                            else baseline.detach().cpu().float())
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"baseline: expected one of {list(BASELINES)}, a number or a tensor, got "
                            f"{type(baseline).__name__}") from e
    if t.ndim == 1 and t.numel() == x.shape[1]:
        t = t.view(1, -1, 1, 1)
    try:
        out = torch.broadcast_to(t, x.shape).clone()
    except RuntimeError as e:
        raise ArgumentError(f"baseline: a tensor of shape {tuple(t.shape)} does not broadcast to the model input "
                            f"{tuple(x.shape)}; give one value per channel ({x.shape[1]},) or the whole input") from e
    if not torch.isfinite(out).all():
        raise ArgumentError("baseline: contains NaN or inf")
    return out, f"tensor of shape {tuple(t.shape)} (model-input units)"


def shapley_bytes(n_groups: int, batch_size: int, shape: tuple[int, int], channels: int = 3) -> int:
    """Bytes :func:`shapley_patches` holds besides the model's own activations: the ``2^n`` scores and the closed
    formula's temporaries, plus one batch of masked inputs (input, mask and result, float32).

    Example:
        >>> shapley_bytes(16, 256, (64, 64))
        31981568
    """
    return (1 << n_groups) * _BYTES_PER_COALITION + batch_size * (2 * channels + 1) * shape[0] * shape[1] * 4


def _check_budget(n: int, batch_size: int, shape: tuple[int, int], channels: int, max_bytes: float | None) -> None:
    need = shapley_bytes(n, batch_size, shape, channels)
    if max_bytes is None:
        free = available_bytes()
        limit = None if free is None else BUDGET_FRACTION * free
        said = "" if free is None else f"{BUDGET_FRACTION:.0%} of the {free / 1e9:.2f} GB available"
    else:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, float)) or not max_bytes > 0:
            raise ArgumentError(f"max_bytes: expected a positive number of bytes or None, got {max_bytes!r}")
        limit, said = float(max_bytes), f"max_bytes {float(max_bytes):.3g}"
    if limit is None or need <= limit:
        return
    scores = (1 << n) * _BYTES_PER_COALITION
    arg = "grid" if scores > limit else "batch_size"  # no batch size fits when the scores alone do not
    raise ArgumentError(f"{arg}: {n} groups take 2^{n} = {1 << n:,} forward passes and would hold about "
                        f"{need / 1e9:.3g} GB ({scores / 1e9:.3g} GB of scores, {(need - scores) / 1e9:.3g} GB for a "
                        f"batch of {batch_size}), over the budget ({said}); use fewer groups or a smaller batch_size")


def _check_passes(n: int, max_passes: object) -> None:
    """Refuse a grid whose ``2^n`` forward passes exceed ``max_passes`` (default: ``2^MAX_GROUPS``), by time, not
    memory: the scores of 28 groups fit in a few GB but take 2^28 passes."""
    if max_passes is not None and (isinstance(max_passes, bool) or not isinstance(max_passes, (int, np.integer))
                                   or max_passes < 1):
        raise ArgumentError(f"max_passes: expected a positive int number of forward passes or None, got {max_passes!r}")
    cap = 1 << MAX_GROUPS if max_passes is None else int(max_passes)
    if 1 << n > cap:
        said = (f"the default cap of 2^{MAX_GROUPS} = {cap:,} (pass max_passes= to allow more)" if max_passes is None
                else f"max_passes={cap:,}")
        raise ArgumentError(f"grid: {n} groups take 2^{n} = {1 << n:,} forward passes, over {said}; use fewer groups")


def _still_image_model(model: torch.nn.Module) -> None:
    """Refuse a video family's model before any pass: the groups cut one still image, a clip model takes clips."""
    from vitcam_nb.adapters.registry import find_adapter
    from vitcam_nb.core.errors import VitcamError
    try:
        adapter = find_adapter(model)
    except VitcamError:
        return  # a plain module (no family): scored as the image classifier it is called as
    if getattr(adapter, "video", False):
        raise ArgumentError(f"model: a video model ({getattr(adapter, 'name', 'video')} family) takes clips; "
                            "shapley_patches cuts one still image into groups and scores an image classifier")


def _finite_scores(v: np.ndarray, base_said: str) -> None:
    """Refuse a baseline whose masked inputs the model scores as NaN or inf (a huge value overflows in the model):
    no Shapley value is defined from non-finite scores."""
    bad = ~np.isfinite(v)
    if bad.any():
        raise ArgumentError(f"baseline: the model scores {int(bad.sum()):,} of the {v.size:,} masked inputs as NaN or "
                            f"inf with this baseline ({base_said}); use a baseline in the range of the model's "
                            "inputs")


def check_shapley(model: torch.nn.Module, image: object, grid: Sequence[int], baseline: object, batch_size: int, *,
                  score: str = "logit", max_bytes: float | None = None, blur_sigma: float | None = None,
                  max_passes: int | None = None) -> tuple:
    """Every check of :func:`shapley_patches`, with no model call: ``(scorer, model input, input kind, grid,
    baseline input, baseline description)``; bad input raises ``ValueError`` naming the argument.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))
        >>> check_shapley(net, torch.ones(1, 3, 4, 4), (2, 2), "mean", 16)[3]
        (2, 2)
    """
    check_choice("score", score, SCORES)
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ArgumentError(f"batch_size: expected a positive int, got {batch_size!r}")
    _still_image_model(model)
    scorer = Scorer(model, score)
    x, input_kind = model_input(model, image)
    if x.ndim != 4 or x.shape[0] != 1:
        raise ArgumentError(f"image: expected one image, got a model input of shape {tuple(x.shape)}")
    h, w = (int(v) for v in x.shape[-2:])
    gy, gx = _check_grid(grid, (h, w))
    _check_passes(gy * gx, max_passes)
    if blur_sigma is None:
        blur_sigma = 5.0 * math.sqrt(h * w) / 224.0
    if isinstance(blur_sigma, bool) or not isinstance(blur_sigma, (int, float)) or not 0 < blur_sigma <= max(h, w):
        # beyond the input's side the kernel is flat over the whole image; inf or 1e300 would not fit in memory
        raise ArgumentError(f"blur_sigma: expected a positive number of pixels up to the input's side ({max(h, w)}), "
                            f"got {blur_sigma!r}")
    base, base_said = _baseline(baseline, x, float(blur_sigma))
    _check_budget(gy * gx, int(batch_size), (h, w), int(x.shape[1]), max_bytes)
    return scorer, x, input_kind, (gy, gx), base, base_said


def shapley_patches(
    model: torch.nn.Module,
    image: object,
    grid: Sequence[int] = (4, 4),
    baseline: str | float | object = "mean",
    target: int | None = None,
    *,
    score: str = "logit",
    batch_size: int = 256,
    max_bytes: float | None = None,
    blur_sigma: float | None = None,
    progress: bool | None = None,
    max_passes: int | None = None,
) -> xr.DataArray:
    """Exact Shapley values of the ``grid``'s patch groups for the model's ``target`` score, from all ``2^n``
    masked forward passes (``n = rows x columns``; a group absent = its pixels taken from the baseline).

    Args:
        model: a classifier returning logits ``(batch, classes)``; put in eval mode while scored, without
            gradients, every module's mode restored afterwards (parameters never touched).
        image: a trace, an HxWx3 uint8 array or a normalised float tensor (as :func:`~vitcam_nb.evaluate.deletion`).
        grid: ``(rows, columns)`` of equal groups tiling the model input (e.g. ``(4, 4)``: 65,536 passes).
        baseline: ``"mean"`` (a zero model input, the normalisation mean colour; the deletion metrics' default),
            ``"blur"`` (Gaussian blur of the image, RISE's width: 5 px at 224 px, scaled; on small images it hides
            little), a number (model-input units) or a tensor broadcastable to the model input (one value per
            channel, or a whole input).
        target: class index; None = the class the model predicts for the intact image (one more pass).
        score: ``"logit"`` (default) or ``"prob"`` (softmax probability) of the class.
        batch_size: masked inputs per forward call; max_bytes: refuse (naming the size) when the scores and one
            batch would hold more (default half the available memory; the model's activations are not counted).
        blur_sigma: blur width in pixels; progress: progress bar (None: shown from 256 passes on).
        max_passes: the most forward passes allowed (refused before any, naming ``grid``); default ``2^20``
            (20 groups), whatever the memory: 2^n passes take time, not only memory.

    The last batch (it holds the intact image) is scored a second time and must give the same scores (within
    :data:`REPEAT_RTOL` of the largest): a model random in eval mode (dropout left on, noise) is refused, as its
    "exact" values would change from run to run.

    Returns:
        DataArray ``(gy, gx)`` of the Shapley values; attrs: grid, group size, baseline, score, target, class and
        its name, ``n_forwards``, ``v_all`` and ``v_none`` (so ``sum = v_all - v_none``), the model, weights origin
        and hash, device, input kind and size.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))
        >>> phi = shapley_patches(net, torch.ones(1, 3, 4, 4), grid=(2, 2), baseline="mean", target=0)
        >>> phi.shape, phi.attrs["n_forwards"]
        ((2, 2), 16)
        >>> bool(np.isclose(float(phi.sum()), phi.attrs["v_all"] - phi.attrs["v_none"]))
        True
    """
    from vitcam_nb.core.progress import progress_bar as tqdm

    scorer, x, input_kind, (gy, gx), base, base_said = check_shapley(
        model, image, grid, baseline, batch_size, score=score, max_bytes=max_bytes, blur_sigma=blur_sigma,
        max_passes=max_passes)
    h, w = (int(v) for v in x.shape[-2:])
    n = gy * gx
    # Validation done: from here on the model is called.
    cls = resolve_target(scorer, x, target, None)
    total = 1 << n
    v = np.empty(total)
    n_batches = math.ceil(total / batch_size)
    with tqdm(total=total, desc=f"Shapley {gy}x{gx} ({total:,} passes)", disable=not show_progress(progress, total),
              leave=False) as bar:
        for b in range(n_batches):
            coalitions = np.arange(b * batch_size, min(total, (b + 1) * batch_size), dtype=np.int64)
            present = coalition_masks(coalitions, (gy, gx), (h, w))
            v[coalitions] = scorer(torch.where(present, x, base), cls)
            bar.update(len(coalitions))
    _finite_scores(v, base_said)
    _check_repeat(scorer, x, base, cls, coalitions, v, (gy, gx))
    phi = exact_shapley(v).reshape(gy, gx)
    attrs = {
        "metric": "shapley_patches", "grid": f"{gy}x{gx}", "n_groups": n, "group_size": f"{h // gy}x{w // gx}",
        "group_order": "row-major; group k is bit k of a coalition", "baseline": base_said, "score": score,
        "target": "predicted class of the intact image" if target is None else int(target), "class": cls,
        "class_name": _class_name(model, cls), "n_forwards": total + (target is None),
        "repeat_check": f"the last batch ({len(coalitions)} inputs, the intact image among them) scored twice: the "
                        f"same scores within {REPEAT_RTOL:g} of the largest",
        "v_all": float(v[-1]), "v_none": float(v[0]), "batch_size": int(batch_size),
        "method": "exact: all 2^n coalitions, closed Shapley formula (no sampling)",
        "input_kind": input_kind, "input_size": f"{h}x{w}", "model": model_name(model),
        "weights_origin": weights_origin(model), "weights_sha256": weights_sha256(model),
        "device": str(scorer.device), "input_sha256": array_sha256(x),  # shapley_agreement compares it with the map's
        **_of_trace(image, cls),
    }
    return xr.DataArray(phi, dims=("gy", "gx"), coords={"gy": np.arange(gy), "gx": np.arange(gx)},
                        name="shapley", attrs=attrs)


def _of_trace(image: object, cls: int) -> dict:
    """The trace's id and the rank of ``cls`` by its logits (as ``vc.cam`` ranks ``topN``), when ``image`` is one."""
    if not isinstance(image, xr.Dataset) or "logits" not in image.variables:
        return {}
    order = np.argsort(-np.asarray(image["logits"].values, np.float64).ravel(), kind="stable")
    rank = int(np.flatnonzero(order == cls)[0]) + 1 if cls in order else 0
    return {"trace_id": str(image.attrs.get("trace_id", "")), "class_rank": rank}


def _check_repeat(scorer: Scorer, x: torch.Tensor, base: torch.Tensor, cls: int, coalitions: np.ndarray,
                  v: np.ndarray, grid: tuple[int, int]) -> None:
    """Score the last batch (with the intact image) again: the same inputs in the same batch must give the same
    scores, else the model is random in eval mode and no value computed from its scores is exact."""
    again = np.asarray(scorer(torch.where(coalition_masks(coalitions, grid, tuple(x.shape[-2:])), x, base), cls))
    first = v[coalitions]
    diff = float(np.max(np.abs(again - first)))
    if not diff <= REPEAT_RTOL * max(1.0, float(np.max(np.abs(first)))):
        raise ArgumentError(f"model: the model is not deterministic in eval mode: the same {len(coalitions)} masked "
                            f"inputs (the intact image among them) scored twice differ by up to {diff:.3g} (the intact "
                            f"image: {first[-1]:.6g}, then {again[-1]:.6g}); exact Shapley values need the same score "
                            "for the same input (dropout or noise active in eval mode?)")


def _class_name(model: torch.nn.Module, cls: int) -> str:
    """The class's name as the model states it (``class_labels``), or ``"class i"``."""
    head = getattr(model, "num_classes", None)
    if isinstance(head, int) and 0 <= cls < head:
        return class_labels(model, head)[cls]
    return f"class {cls}"
