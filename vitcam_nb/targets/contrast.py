"""Contrast targets: one class's logit minus a weighted sum of other classes' logits, the score FinerCAM
(Zhang et al. 2025, "Finer-CAM: Spotting the Difference Reveals Finer Details for Visual Explanation", CVPR;
pytorch-grad-cam's ``FinerCAM`` and ``FinerWeightedTarget``) differentiates.

The contrast is one score computed from the classifier's logits ``z`` in the traced forward pass; its gradient
comes from the trace's one batched backward (no pass of its own). Two weightings:

- ``weights=None`` (FinerCAM's): ``s = sum_k p_k (z_c - alpha z_k) / (sum_k p_k + 1e-9)``, ``p = softmax(z)``
  over all classes and NOT detached, so the gradient includes the softmax's derivative exactly as pytorch-grad-cam
  differentiates it;
- ``weights=[w_k]``: ``s = z_c - sum_k w_k z_k`` with the given constant weights.

``against="nearest"`` is FinerCAM's choice: the classes are sorted by ``|z_k - z_c|`` (ascending, ties by index)
and the ones at ``ranks`` (FinerCAM's ``comparison_categories``, default ``(1, 2, 3)``: the three classes whose
logits are closest to the class's own) are compared. The trace records which classes and which weights.

Example:
    >>> import torch
    >>> t = contrast(0, against=[1, 2], weights=[0.5, 0.5])
    >>> float(t.scores(lambda x: torch.tensor([[3.0, 1.0, 2.0]]), torch.zeros(1, 3, 2, 2))[0])
    1.5
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vitcam_nb.core.errors import TraceError
from vitcam_nb.targets.base import Target, register_target
from vitcam_nb.targets.classes import class_labels, head_size, model_logits

__all__ = ["Contrast", "contrast", "nearest_classes"]

#: FinerCAM's guard in the denominator of its weighted difference (pytorch-grad-cam's FinerWeightedTarget).
FINER_EPS = 1e-9


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def nearest_classes(logits: Any, class_: int, ranks: Sequence[int] = (1, 2, 3)) -> list[int]:
    """FinerCAM's comparison classes: the classes sorted by ``|z_k - z_c|`` ascending (ties by index), the class
    itself removed from the order and put first (rank 0), then the classes at ``ranks``.

    Example:
        >>> nearest_classes([5.0, 4.0, 0.0, 4.5], 0, ranks=(1, 2))
        [3, 1]
    """
    z = np.asarray(logits, dtype=np.float64).ravel()
    order = [int(i) for i in np.argsort(np.abs(z - z[class_]), kind="stable") if int(i) != class_]
    return [order[r - 1] for r in ranks]


class Contrast(Target):
    """The score ``z_c - sum_k w_k z_k`` (FinerCAM's softmax-weighted form when ``weights`` is None); see
    :func:`contrast`. Its one score is traced as entry 0, so every recipe's default ``class_="top1"`` maps it.

    Example:
        >>> Contrast("top1", "nearest", None, (1, 2, 3), 1.0).kind
        'contrast'
    """

    kind = "contrast"

    def __init__(self, class_: int | str, against: str | list[int], weights: list[float] | None,
                 ranks: tuple[int, ...], alpha: float):
        self.class_, self.against, self.weights, self.ranks, self.alpha = class_, against, weights, ranks, alpha
        self.resolved: tuple[int, list[int], list[float]] | None = None  # (class, comparison classes, weights)
        self.names: list[str] | None = None

    def __repr__(self) -> str:
        weights = "" if self.weights is None else f", weights={self.weights!r}"
        ranks = f", ranks={self.ranks!r}" if self.against == "nearest" else ""
        alpha = f", alpha={self.alpha:g}" if self.weights is None else ""
        return f"vc.targets.contrast({self.class_!r}, against={self.against!r}{weights}{ranks}{alpha})"

    def check(self, model: torch.nn.Module) -> None:
        self.resolved = self.names = None  # a new trace: its image chooses the classes
        n = head_size(model)
        if n <= 0:
            raise TraceError("model: has no classifier head (num_classes=0); a contrast target compares class logits")
        self._check_count(n)

    def _check_count(self, n: int) -> None:
        if _is_int(self.class_) and self.class_ >= n:
            raise TraceError(f"class_: class {self.class_} is out of range; the model has {n} classes (0..{n - 1})")
        if self.against == "nearest":
            if max(self.ranks) > n - 1:
                raise TraceError(f"ranks: rank {max(self.ranks)} needs {max(self.ranks) + 1} classes; the model has "
                                 f"{n}")
        else:
            bad = [c for c in self.against if c >= n]
            if bad:
                raise TraceError(f"against: class(es) {bad} out of range; the model has {n} classes (0..{n - 1})")

    def _resolve(self, z: torch.Tensor) -> tuple[int, list[int]]:
        self._check_count(int(z.shape[0]))
        zd = z.detach().double().cpu().numpy()
        c = int(np.argmax(zd)) if self.class_ == "top1" else int(self.class_)
        if self.against == "nearest":
            return c, nearest_classes(zd, c, self.ranks)
        if c in self.against:
            raise TraceError(f"against: class {c} is the contrasted class itself ({self.class_!r}); compare it "
                             "with other classes")
        return c, list(self.against)

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.batch_scores(model, x)[0]

    def batch_scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The contrast of every image in ``x``. The classes are chosen on the first image a trace scores (the
        traced image) and kept for later calls (``vc.score``'s perturbed inputs), as FinerCAM keeps its target's
        classes; a new ``vc.trace`` chooses them again."""
        logits = model_logits(model(x))
        n = int(x.shape[0])
        if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.shape[0] != n:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TraceError(f"model: expected logits of shape ({n}, classes), got {shape}")
        if self.resolved is None:
            self._choose_classes(model, logits[0])
        c, others, weights = self.resolved
        if self.weights is None:
            p = torch.softmax(logits, dim=-1)[:, others]  # not detached: FinerCAM differentiates through it
            s = (p * (logits[:, c:c + 1] - self.alpha * logits[:, others])).sum(1) / (p.sum(1) + FINER_EPS)
        else:
            w = torch.tensor(weights, dtype=logits.dtype, device=logits.device)
            s = logits[:, c] - (w * logits[:, others]).sum(1)
        return s[:, None]

    def _choose_classes(self, model: torch.nn.Module, z: torch.Tensor) -> None:
        c, others = self._resolve(z)
        if self.weights is None:  # what FinerCAM's weights are at this image (the checklist states them)
            p = torch.softmax(z.detach().double(), dim=-1)[others]
            weights = (self.alpha * p / (p.sum() + FINER_EPS)).cpu().tolist()
        else:
            weights = list(self.weights)
        self.resolved = (c, others, [float(v) for v in weights])
        n = int(z.shape[0])
        names = class_labels(model, n) if isinstance(model, torch.nn.Module) else [f"class {i}" for i in range(n)]
        self.names = [names[c], *(names[k] for k in others)]

    def class_labels(self, model: torch.nn.Module, n: int) -> list[str]:
        return [self.label()]

    def label(self) -> str:
        """The name of the contrast score, once a forward pass has chosen the classes."""
        if self.resolved is None:
            return f"contrast of class {self.class_} against {self.against}"
        c, others, _ = self.resolved
        return f"contrast of class {c} against {', '.join(str(k) for k in others)}"

    def settings(self) -> dict:
        return {"kind": self.kind, "class": self.class_, "against": self.against, "weights": self.weights,
                "ranks": list(self.ranks), "alpha": self.alpha}

    @property
    def description(self) -> str:  # type: ignore[override]  (computed: it names the classes the pass chose)
        if self.resolved is None:
            return "a class logit minus a weighted sum of other classes' logits (classes chosen at trace time)"
        c, others, w = self.resolved
        names = self.names or [str(c), *(str(k) for k in others)]
        terms = " - ".join([f"z_{c} ({names[0]})", *(f"{wk:.6g} z_{k} ({nk})" for k, wk, nk in
                                                      zip(others, w, names[1:]))])
        how = (f"FinerCAM's weighting (Zhang et al. 2025; pytorch-grad-cam FinerWeightedTarget, alpha={self.alpha:g}): "
               "s = sum_k p_k (z_c - alpha z_k) / (sum_k p_k + 1e-9), p = softmax of all logits, differentiated "
               "through p; the weights shown are alpha p_k / (sum p + 1e-9) at this image"
               if self.weights is None else "constant weights given by the user")
        chosen = (f"the classes at ranks {list(self.ranks)} by |z_k - z_c| (FinerCAM's nearest)"
                  if self.against == "nearest" else "the classes given")
        return f"contrast s = {terms}; compared with {chosen}; {how}"

    def attrs(self) -> dict[str, object]:
        out: dict[str, object] = {**super().attrs()}
        if self.resolved is not None:
            c, others, w = self.resolved
            out.update(contrast_class=c, contrast_against=",".join(str(k) for k in others),
                       contrast_weights=",".join(f"{v:.9g}" for v in w),
                       contrast_weighting="finercam" if self.weights is None else "given")
        return out


def _classes(value: Any, argument: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) and not isinstance(value, np.ndarray):
        raise TraceError(f"{argument}: expected 'nearest' or a non-empty list of class indices (ints), got {value!r}")
    items = list(value)
    if not items:
        raise TraceError(f"{argument}: is empty; give 'nearest' or at least one class index to compare with")
    bad = [v for v in items if not _is_int(v) or v < 0]
    if bad:
        raise TraceError(f"{argument}: class indices must be ints >= 0, got {bad!r}")
    if len(set(int(v) for v in items)) != len(items):
        raise TraceError(f"{argument}: lists a class twice ({items!r})")
    return [int(v) for v in items]


@register_target
def contrast(class_: int | str = "top1", against: str | Sequence[int] = "nearest",
             weights: Sequence[float] | None = None, *, ranks: Sequence[int] = (1, 2, 3),
             alpha: float = 1.0) -> Contrast:
    """Target ``class_``'s logit minus a weighted sum of other classes' logits (FinerCAM and contrastive maps).

    Args:
        class_: the class (an int), or "top1": the highest logit at the traced image (FinerCAM's default).
        against: "nearest" (FinerCAM: the classes at ``ranks`` in the order of ``|z_k - z_c|``), or a non-empty
            list of class indices, without ``class_``.
        weights: None for FinerCAM's softmax weighting (differentiated through the softmax, as pytorch-grad-cam
            does), or one constant weight per compared class (``s = z_c - sum_k w_k z_k``).
        ranks: with ``against="nearest"``: the positions compared (FinerCAM's ``comparison_categories``; rank 0 is
            the class itself).
        alpha: FinerCAM's comparison strength (``weights=None`` only).

    Trace with ``vc.trace(model, image, targets=vc.targets.contrast(...))``; the trace's one score (entry 0) is
    the contrast, so every recipe maps it, and the checklist names the classes and weights.

    Example:
        >>> contrast(3, against=[5, 7], weights=[1.0, 0.5]).settings()["against"]
        [5, 7]
    """
    if class_ != "top1" and (not _is_int(class_) or class_ < 0):
        raise TraceError(f"class_: expected a class index (int >= 0) or 'top1', got {class_!r}")
    if isinstance(against, str):
        if against != "nearest":
            raise TraceError(f"against: expected 'nearest' or a list of class indices, got {against!r}")
        others: str | list[int] = "nearest"
    else:
        others = _classes(against, "against")
        if _is_int(class_) and int(class_) in others:
            raise TraceError(f"against: lists class {class_}, the contrasted class itself")
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
        raise TraceError(f"ranks: expected a non-empty list of ranks >= 1, got {ranks!r}")
    if any(not _is_int(r) or r < 1 for r in ranks) or len(set(ranks)) != len(ranks):
        raise TraceError(f"ranks: expected distinct ints >= 1 (rank 0 is the class itself), got {list(ranks)!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha):
        raise TraceError(f"alpha: expected a finite number, got {alpha!r}")
    count = len(ranks) if others == "nearest" else len(others)
    w = None
    if weights is not None:
        if isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, np.ndarray)):
            raise TraceError(f"weights: expected None (FinerCAM's) or {count} numbers, got {weights!r}")
        w = list(weights)
        if len(w) != count:
            raise TraceError(f"weights: {len(w)} weight(s) for {count} compared class(es); give one per class in "
                             "against (or per rank with 'nearest')")
        if any(isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) for v in w):
            raise TraceError(f"weights: expected finite numbers, got {w!r}")
        if alpha != 1.0:
            raise TraceError("alpha: applies to FinerCAM's weighting (weights=None) only; fold it into weights")
        w = [float(v) for v in w]
    return Contrast(class_ if class_ == "top1" else int(class_), others, w, tuple(int(r) for r in ranks),
                    float(alpha))
