"""The segmentation loss as a target: the cross-entropy of a dense model's (B, C, H, W) logits against a label
map, exactly as ``torch.nn.functional.cross_entropy`` computes it (``ignore_index``, ``reduction``). A trace
differentiates this one score, so a map shows what in the image raises the loss.

Example:
    >>> import torch
    >>> t = segmentation_loss(torch.zeros(4, 4, dtype=torch.long))
    >>> t.batch_scores(lambda x: torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, 4, 4)).shape
    torch.Size([1, 1])
"""

from __future__ import annotations

import numpy as np
import torch

from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.provenance import array_sha256
from vitcam_nb.targets.base import Target, register_target
from vitcam_nb.targets.dense import dense_output

__all__ = ["SegmentationLoss", "segmentation_loss"]

REDUCTIONS = ("mean", "sum")


class SegmentationLoss(Target):
    """``cross_entropy(out, labels, ignore_index=, reduction=)`` of the dense output, one score, traced.

    Example:
        >>> SegmentationLoss(np.zeros((2, 2), int), ignore_index=255).description
        'cross-entropy of the dense output against a 2x2 label map (mean over the 4 labelled pixels; ignore_index 255)'
    """

    kind = "segmentation_loss"

    def __init__(self, labels: object, ignore_index: int = -100, reduction: str = "mean"):
        try:
            arr = np.asarray(labels)
        except (ValueError, TypeError) as exc:  # ragged rows ([[1, 2], [3]]) are no (H, W) map
            raise TraceError(f"labels: expected an (H, W) label map of class indices ({exc})"[:300]) from exc
        if arr.ndim != 2 or arr.size == 0:
            raise TraceError(f"labels: expected an (H, W) label map of class indices, got shape {arr.shape}")
        if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
            raise TraceError(f"labels: expected integer class indices, got dtype {arr.dtype}")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
            raise TraceError(f"ignore_index: expected an int, got {ignore_index!r}")
        negative = (arr < 0) & (arr != ignore_index)
        if negative.any():  # no class has a negative index: refused here, before any model pass
            raise TraceError(f"labels: class {int(arr[negative][0])} is negative; class indices are >= 0 (pixels to "
                             f"skip carry ignore_index {int(ignore_index)})")
        if reduction not in REDUCTIONS:
            raise TraceError(f"reduction: expected one of {list(REDUCTIONS)} (one score to differentiate), "
                             f"got {reduction!r}")
        self.labels_map = torch.as_tensor(arr.astype(np.int64))
        self.ignore_index, self.reduction = int(ignore_index), reduction
        counted = int((self.labels_map != self.ignore_index).sum())
        if counted == 0:
            raise TraceError(f"labels: every pixel is ignore_index {self.ignore_index}; label at least one")
        h, w = arr.shape
        self.labels = ["cross-entropy loss"]
        self.description = (f"cross-entropy of the dense output against a {h}x{w} label map ({reduction} over the "
                            f"{counted} labelled pixels; ignore_index {self.ignore_index})")

    def _labels_for(self, size: tuple[int, int], classes: int) -> torch.Tensor:
        lab = self.labels_map
        if tuple(lab.shape) != size:
            raise TraceError(f"labels: the map is {tuple(lab.shape)[0]}x{tuple(lab.shape)[1]} but the model's output "
                             f"is {size[0]}x{size[1]}; pass a label map of the output's size")
        bad = (lab != self.ignore_index) & ((lab < 0) | (lab >= classes))
        if bool(bad.any()):
            raise TraceError(f"labels: class {int(lab[bad][0])} is out of range; the model has {classes} classes "
                             f"(pixels to skip carry ignore_index {self.ignore_index})")
        return lab

    def batch_scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = dense_output(model(x), int(x.shape[0]))
        lab = self._labels_for((int(out.shape[-2]), int(out.shape[-1])), int(out.shape[1])).to(out.device)
        loss = torch.nn.functional.cross_entropy(out, lab.expand(out.shape[0], -1, -1), ignore_index=self.ignore_index,
                                                 reduction="none")
        kept = (lab != self.ignore_index).to(out.dtype)
        total = loss.sum(dim=(-2, -1))  # ignored pixels contribute 0, as in torch
        score = total / kept.sum() if self.reduction == "mean" else total
        return score[:, None]

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.batch_scores(model, x)[0]

    def settings(self) -> dict:
        return {"kind": self.kind, "ignore_index": self.ignore_index, "reduction": self.reduction,
                "labels": array_sha256(self.labels_map)}

    def attrs(self) -> dict[str, object]:
        return {**super().attrs(), "target_reduce": self.reduction}


@register_target
def segmentation_loss(labels: object, ignore_index: int = -100, reduction: str = "mean") -> SegmentationLoss:
    """The segmentation loss target: ``torch.nn.functional.cross_entropy(out, labels, ignore_index=ignore_index,
    reduction=reduction)`` of a dense model's (B, C, H, W) output against an (H, W) map of class indices of the
    output's size. One score, traced; ``target="logit"`` differentiates the loss itself.

    Example:
        >>> segmentation_loss(np.full((8, 8), 2), ignore_index=255).labels
        ['cross-entropy loss']
    """
    return SegmentationLoss(labels, ignore_index, reduction)
