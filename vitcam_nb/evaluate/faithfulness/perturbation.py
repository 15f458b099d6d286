"""The perturbation engine behind the faithfulness metrics: the model's scores of an input with cells removed in
the order a map ranks them — what the input is, in which order cells go, and the batched, mode-restoring calls.

Example:
    >>> rank = pixel_rank(np.array([[0.0, 1.0]]), (1, 4), "morf")
    >>> rank.tolist()
    [[1, 1, 0, 0]]
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import xarray as xr

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.provenance import weights_sha256
from vitcam_nb.evaluate._common import recipe_fields
from vitcam_nb.evaluate.faithfulness.substrates import fixed_substrate, noisy_linear_imputation
from vitcam_nb.preprocess import data_config, prepare_input, to_pixels

__all__ = ["MODES", "ORDERS", "SCORES", "Scorer", "area_under_curve", "cell_scores", "check_choice", "model_input",
           "model_name", "patch_size_of", "perturbation_scores", "pixel_rank", "resolve_target", "show_progress"]

MODES = ("token", "pixel")
SCORES = ("prob", "logit")
ORDERS = ("morf", "lerf")
_AUTO_PROGRESS_INPUTS = 256  # show a progress bar by default when a run scores this many inputs


def model_input(model: torch.nn.Module, image: object) -> tuple[torch.Tensor, str]:
    """The model input ``(1, 3, H, W)`` for ``image`` and a word on how it was made.

    * a trace (``xarray.Dataset``), refused when its ``weights_sha256`` is not the model's: its ``image``
      (the display copy the maps are aligned to),
      normalised with the mean and std recorded in the trace; no resize or crop.
    * any image :func:`vitcam_nb.preprocess.to_pixels` accepts (PIL, arrays, integer tensors), read by that
      one rule; at the model's input size normalised with the model's timm data config, no resize or crop
      (re-running the eval transform would crop it again and misalign the map); any other size goes
      through the model's timm eval transform, as in ``vc.trace``.
    * a float tensor ``(1, 3, H, W)`` or ``(3, H, W)``: used as given (already normalised).

    Example:
        >>> x, how = model_input(torch.nn.Identity(), torch.zeros(3, 8, 8))
        >>> tuple(x.shape), how
        ((1, 3, 8, 8), 'tensor (used as given)')
    """
    if isinstance(image, xr.Dataset):
        if "image" not in image:
            raise ArgumentError("image: the trace has no 'image' variable")
        traced = image.attrs.get("weights_sha256")
        if isinstance(traced, str) and traced and traced != weights_sha256(model):
            raise ArgumentError(f"image: the trace was made with other weights (sha256 {traced[:12]}...) than this "
                                f"model's ({weights_sha256(model)[:12]}...); score a trace with the model that made it")
        pixels = np.asarray(image["image"].transpose("y", "x", "rgb").values)
        facts = json.loads(image.attrs.get("preprocessing", "{}") or "{}")
        if "mean" in facts and "std" in facts:
            mean, std = facts["mean"], facts["std"]
        else:
            mean, std = _mean_std(model)
        return _normalise(pixels, mean, std), "trace image, normalised as recorded"
    # The one input rule of every entry point (vitcam_nb.preprocess.to_pixels): PIL, arrays, tensors.
    pixels, how = to_pixels(image)
    if isinstance(pixels, torch.Tensor):
        return pixels, how["input_kind"]
    size = _input_size(model)
    if size is None or tuple(pixels.shape[:2]) == size:
        return _normalise(pixels, *_mean_std(model)), f"{how['input_kind']}, normalised at its size"
    return prepare_input(model, pixels).tensor, f"{how['input_kind']}, timm eval transform"


def _data_config(model: torch.nn.Module) -> dict | None:
    if not any(hasattr(model, a) for a in ("pretrained_cfg", "default_cfg", "patch_embed")):
        return None  # timm would answer ImageNet defaults at 224 px for any module: do not guess
    try:
        return data_config(model)
    except Exception:  # a plain torch module without a timm config
        return None


def _mean_std(model: torch.nn.Module) -> tuple[Sequence[float], Sequence[float]]:
    cfg = _data_config(model)
    if cfg is None:
        raise ArgumentError("image: cannot normalise a uint8 array for a model without a timm data config; "
                            "pass a normalised float tensor")
    return cfg["mean"], cfg["std"]


def _input_size(model: torch.nn.Module) -> tuple[int, int] | None:
    cfg = _data_config(model)
    return None if cfg is None else tuple(int(v) for v in cfg["input_size"][1:])


def model_name(model: torch.nn.Module) -> str:
    """The model's architecture name (timm config) or class name, for the results' attrs.

    Example:
        >>> model_name(torch.nn.Linear(1, 1))
        'Linear'
    """
    cfg = getattr(model, "pretrained_cfg", None)
    arch = cfg.get("architecture") if isinstance(cfg, dict) else None
    return str(arch or type(model).__name__)


def _normalise(pixels: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
    m = torch.tensor([float(v) for v in mean]).view(1, 3, 1, 1)
    s = torch.tensor([float(v) for v in std]).view(1, 3, 1, 1)
    return (t - m) / s


def patch_size_of(
    model: torch.nn.Module, image: object, patch_size: int | Sequence[int] | None
) -> tuple[int, int]:
    """The patch size of token mode: given, else the trace's ``patch_size`` attr, else the model's.

    Example:
        >>> patch_size_of(torch.nn.Identity(), None, 8), patch_size_of(torch.nn.Identity(), None, (4, 2))
        ((8, 8), (4, 2))
    """
    value: object = patch_size
    if value is None and isinstance(image, xr.Dataset) and "patch_size" in image.attrs:
        value = image.attrs["patch_size"]
        if isinstance(value, str):
            value = tuple(int(v) for v in value.split("x"))
    if value is None:
        pe = getattr(model, "patch_embed", None)
        value = getattr(pe, "patch_size", None)
    if value is None:
        raise ArgumentError("patch_size: token mode needs the patch size; pass patch_size=, a trace, or a model "
                            "with patch_embed.patch_size")
    if isinstance(value, (int, np.integer)):
        value = (int(value), int(value))
    ph, pw = (int(v) for v in value)
    if ph < 1 or pw < 1:
        raise ArgumentError(f"patch_size: expected positive sizes, got {value!r}")
    return ph, pw


def cell_scores(
    sal: np.ndarray, shape: tuple[int, int], mode: str, patch: tuple[int, int] | None
) -> np.ndarray:
    """The saliency of each removable cell: pixels in pixel mode, patches (the map averaged per patch, or the
    token-grid map itself) in token mode.

    Example:
        >>> cell_scores(np.arange(16.0).reshape(4, 4), (4, 4), "token", (2, 2)).tolist()
        [[2.5, 4.5], [10.5, 12.5]]
    """
    h, w = shape
    if mode == "pixel":
        if sal.shape != (h, w):
            raise ArgumentError(f"saliency: pixel mode needs a map of the input size {(h, w)}, got {sal.shape}; "
                                "use the upsampled map (vc.cam(tr, recipe)) or mode='token'")
        return sal
    ph, pw = patch
    if h % ph or w % pw:
        raise ArgumentError(f"patch_size: {ph}x{pw} patches do not tile the {h}x{w} input")
    gh, gw = h // ph, w // pw
    if sal.shape == (gh, gw):
        return sal
    if sal.shape == (h, w):
        return sal.reshape(gh, ph, gw, pw).mean(axis=(1, 3))
    raise ArgumentError(f"saliency: token mode needs a map on the token grid {(gh, gw)} or at the input size "
                        f"{(h, w)}, got {sal.shape}")


def pixel_rank(cells: np.ndarray, shape: tuple[int, int], order: str) -> np.ndarray:
    """Position of each pixel's cell in the removal order (0 = removed first), at pixel resolution.

    Example:
        >>> pixel_rank(np.array([[0.0, 1.0]]), (2, 4), "lerf").tolist()
        [[0, 0, 1, 1], [0, 0, 1, 1]]
    """
    flat = cells.ravel()
    idx = np.argsort(-flat if order == "morf" else flat, kind="stable")
    rank = np.empty(flat.size, dtype=np.int64)
    rank[idx] = np.arange(flat.size)
    rank = rank.reshape(cells.shape)
    fy, fx = shape[0] // cells.shape[0], shape[1] // cells.shape[1]
    return np.repeat(np.repeat(rank, fy, axis=0), fx, axis=1)


def check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    """Refuse ``value`` unless it is one of ``allowed``, naming the argument.

    Example:
        >>> check_choice("mode", "pixel", MODES)
    """
    if value not in allowed:
        raise ArgumentError(f"{name}: expected one of {list(allowed)}, got {value!r}")


def show_progress(show: bool | None, n_inputs: int) -> bool:
    """Whether to show a progress bar: as asked, or by default when the run scores many inputs.

    Example:
        >>> show_progress(None, 10), show_progress(None, 10_000), show_progress(False, 10_000)
        (False, True, False)
    """
    return n_inputs >= _AUTO_PROGRESS_INPUTS if show is None else bool(show)


class Scorer:
    """Calls the model on batches in eval mode without gradients, restoring every module's mode.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3, 2)).train()
        >>> scores = Scorer(net, "prob")(torch.zeros(4, 3, 1, 1), target=1)
        >>> scores.shape, net.training
        ((4,), True)
    """

    def __init__(self, model: torch.nn.Module, score: str):
        if not isinstance(model, torch.nn.Module):
            raise ArgumentError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
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
            raise ArgumentError(f"model: expected logits of shape (batch, classes), got {shape}")
        return out.detach().to("cpu", torch.float32)

    def __call__(self, batch: torch.Tensor, target: int) -> np.ndarray:
        z = self.logits(batch)
        if self.score == "prob":
            z = torch.softmax(z, dim=1)
        return z[:, target].numpy().astype(np.float64)


def resolve_target(scorer: Scorer, x: torch.Tensor, target: int | None, saliency: object) -> int:
    """The class to score: ``target``, else the class the saliency's recipe names, else the prediction.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3, 2))
        >>> resolve_target(Scorer(net, "logit"), torch.zeros(1, 3, 1, 1), 1, None)
        1
    """
    logits = scorer.logits(x)
    n_classes = logits.shape[1]
    if target is None:
        cls = recipe_fields(saliency).get("class_", "top1")
        if isinstance(cls, int) and not isinstance(cls, bool) and 0 <= cls < n_classes:
            return cls
        rank = int(cls[3:]) if isinstance(cls, str) and cls[3:].isdigit() and cls.startswith("top") else 1
        return int(torch.argsort(logits[0], descending=True, stable=True)[min(rank, n_classes) - 1])
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= target < n_classes:
        raise ArgumentError(f"target: expected a class index in 0..{n_classes - 1} or None (the predicted "
                            f"class), got {target!r}")
    return int(target)


def perturbation_scores(
    scorer: Scorer, x: torch.Tensor, ranks: Sequence[np.ndarray], counts: np.ndarray, *, kind: str,
    substrate: str, target: int, batch_size: int, seed: int, nli_noise: float, blur_sigma: float,
    progress: bool | None, desc: str,
) -> np.ndarray:
    """Scores (n_maps, n_counts): for each removal rank map, the input with the first ``count`` cells
    removed (deletion) or only the first ``count`` cells kept on the substrate (insertion).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 2))
        >>> rank = pixel_rank(np.array([[0.0, 1.0]]), (2, 2), "morf")
        >>> perturbation_scores(Scorer(net, "logit"), torch.ones(1, 3, 2, 2), [rank], np.array([0, 1, 2]),
        ...                     kind="deletion", substrate="mean", target=0, batch_size=4, seed=0, nli_noise=0.0,
        ...                     blur_sigma=1.0, progress=False, desc="").shape
        (1, 3)
    """
    from vitcam_nb.core.progress import progress_bar as tqdm

    fixed = fixed_substrate(x, substrate, blur_sigma)
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
    with tqdm(total=n_batches, desc=desc, disable=not show_progress(progress, total), leave=False) as bar:
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


def area_under_curve(y: np.ndarray, x: np.ndarray) -> float:
    """Trapezoidal area under the curve y(x).

    Example:
        >>> area_under_curve(np.array([1.0, 0.0]), np.array([0.0, 1.0]))
        0.5
    """
    return float(np.sum((y[1:] + y[:-1]) / 2.0 * np.diff(x)))
