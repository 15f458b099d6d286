"""Dense targets: scores of a model whose output is a (B, C, H, W) map (semantic segmentation).

- :func:`region`: per class c, the sum (or mean) of ``out[b, c]`` over a pixel region; the traced class is
  ``class_``. With ``reduce="sum"`` this is pytorch-grad-cam's ``SemanticSegmentationTarget`` and the usual
  "segmentation loss" target; the other classes' region scores are stored too (``logits``), so the expected-score
  gradient and prob/logprob recipes work as for a classifier.
- :func:`dense`: any scores the user defines from the output, ``fn(out) -> (B,)`` or ``(B, N)``.

Example:
    >>> import torch
    >>> t = region(torch.ones(2, 2), 1)
    >>> t.batch_scores(lambda x: torch.ones(1, 3, 4, 4), torch.zeros(1, 3, 4, 4)).tolist()
    [[16.0, 16.0, 16.0]]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

from vitcam_nb.core.errors import ArgumentTypeError, TraceError, user_stacklevel
from vitcam_nb.core.provenance import array_sha256
from vitcam_nb.targets.base import Target, register_target
from vitcam_nb.targets.classes import model_logits

__all__ = ["DenseScores", "Region", "dense", "dense_output", "region"]

REDUCES = ("sum", "mean")


def dense_output(out: object, n: int) -> torch.Tensor:
    """The (n, classes, H, W) float output of a dense model (a Hugging Face segmenter's ``.logits`` too); refuses
    anything else with a TraceError.

    Example:
        >>> dense_output(torch.zeros(1, 2, 3, 3), 1).shape
        torch.Size([1, 2, 3, 3])
    """
    out = model_logits(out)  # a Hugging Face segmenter returns its (B, C, H, W) map as ``.logits``
    if not isinstance(out, torch.Tensor) or out.ndim != 4 or out.shape[0] != n or not out.is_floating_point():
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise TraceError(f"model: a dense target needs a ({n}, classes, H, W) float output, got {shape}")
    return out


class Region(Target):
    """Per class, the sum (or mean) of the dense output over a pixel region; ``class_`` is traced.

    Example:
        >>> m = torch.zeros(4, 4); m[:2, :2] = 1
        >>> Region(m, 0, "mean").description
        'mean of each class score over a 4-pixel region (of 4x4); class 0 traced'
    """

    kind = "region"

    def __init__(self, mask: object, class_: int, reduce: str = "sum", labels: Sequence[str] | None = None):
        m = torch.as_tensor(np.asarray(mask))
        if m.ndim != 2:
            raise TraceError(f"mask: expected an (H, W) array, got shape {tuple(m.shape)}")
        if m.dtype == torch.bool or not m.is_floating_point():
            m = m.to(torch.float32)
        if not torch.isfinite(m).all() or (m < 0).any():
            raise TraceError("mask: expected finite weights >= 0 (a boolean or 0/1 region)")
        if float(m.sum()) == 0:
            raise TraceError("mask: the region is empty; mark at least one pixel")
        if isinstance(class_, bool) or not isinstance(class_, (int, np.integer)) or class_ < 0:
            raise TraceError(f"class_: expected a class index >= 0, got {class_!r}")
        if reduce not in REDUCES:
            raise TraceError(f"reduce: expected one of {list(REDUCES)}, got {reduce!r}")
        self.mask, self.class_, self.reduce = m, int(class_), reduce
        self.labels = list(labels) if labels is not None else None
        h, w = m.shape
        self.description = (f"{reduce} of each class score over a {int((m > 0).sum())}-pixel region (of {h}x{w}); "
                            f"class {self.class_} traced")

    def _mask_for(self, size: tuple[int, int]) -> torch.Tensor:
        m = self.mask
        if tuple(m.shape) == size:
            return m
        (h, w), (H, W) = m.shape, size
        if not ((H % h == 0 and W % w == 0) or (h % H == 0 and w % W == 0)):
            raise TraceError(f"mask: {h}x{w} does not fit the model's {H}x{W} output, and neither size divides "
                             "the other exactly; pass a mask of the output's size")
        warnings.warn(f"mask: {h}x{w} resized to the model's {H}x{W} output (nearest neighbour, exact multiple)",
                      UserWarning, stacklevel=user_stacklevel())
        out = torch.nn.functional.interpolate(m[None, None], size=size, mode="nearest")[0, 0]
        if float(out.sum()) == 0:
            raise TraceError("mask: the region is empty at the model's output size")
        return out

    def batch_scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = dense_output(model(x), int(x.shape[0]))
        if self.class_ >= out.shape[1]:
            raise TraceError(f"class_: {self.class_} is out of range; the model has {out.shape[1]} classes")
        m = self._mask_for((int(out.shape[-2]), int(out.shape[-1]))).to(out.device, out.dtype)
        s = (out * m).sum(dim=(-2, -1))
        return s / m.sum() if self.reduce == "mean" else s

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.batch_scores(model, x)[0]

    def choose(self, scores: torch.Tensor) -> list[int]:
        return [self.class_]

    def settings(self) -> dict:
        return {"kind": self.kind, "class": self.class_, "reduce": self.reduce, "mask": array_sha256(self.mask)}

    def attrs(self) -> dict[str, object]:
        return {**super().attrs(), "target_reduce": self.reduce}


class DenseScores(Target):
    """Scores a user function computes from the dense output: ``fn(out) -> (B,)`` or ``(B, N)``.

    Example:
        >>> t = DenseScores(lambda out: out[:, 1].amax(dim=(-2, -1)), ["max of class 1"])
        >>> t.batch_scores(lambda x: torch.ones(2, 3, 4, 4), torch.zeros(2, 3, 4, 4)).shape
        torch.Size([2, 1])
    """

    kind = "dense"

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], labels: Sequence[str]):
        if not callable(fn):
            raise ArgumentTypeError(f"fn: expected a function of the model output, got {type(fn).__name__}")
        if isinstance(labels, str) or not isinstance(labels, Sequence) or not labels:
            raise TraceError(f"labels: expected a non-empty list of score names, got {labels!r}")
        self.fn, self.labels = fn, [str(v) for v in labels]
        self.description = f"user scores of the dense output: {', '.join(self.labels)}"

    def batch_scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[0])
        s = self.fn(dense_output(model(x), n))
        if isinstance(s, torch.Tensor) and s.ndim == 1:
            s = s[:, None]
        if not isinstance(s, torch.Tensor) or s.shape != (n, len(self.labels)):
            shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise TraceError(f"fn: expected ({n},) or ({n}, {len(self.labels)}) scores (one per label), got {shape}")
        return s

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.batch_scores(model, x)[0]

    def settings(self) -> dict:
        return {"kind": self.kind, "labels": self.labels}


@register_target
def region(mask: object, class_: int, reduce: str = "sum", labels: Sequence[str] | None = None) -> Region:
    """The region target: per class c, ``sum`` (default; ``mean`` divides by the region's weight) of
    ``out[b, c, y, x] * mask[y, x]`` over the dense output; ``class_`` is traced. A mask of another size is
    resized (nearest neighbour, with a warning) only when one size is an exact multiple of the other.

    Example:
        >>> region(np.ones((4, 4), bool), 2).choose(torch.zeros(3))
        [2]
    """
    return Region(mask, class_, reduce, labels)


@register_target
def dense(fn: Callable[[torch.Tensor], torch.Tensor], labels: Sequence[str]) -> DenseScores:
    """A target from any scores ``fn(out)`` of the dense (B, C, H, W) output, one per label, all traced.

    Example:
        >>> dense(lambda out: out.mean(dim=(1, 2, 3)), ["mean output"]).labels
        ['mean output']
    """
    return DenseScores(fn, labels)
