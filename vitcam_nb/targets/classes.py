"""Class targets, the default: the classifier's logits — the K highest (``"topK"``), one class or a list —
and the names of the classes.

Example:
    >>> as_target("top3").k
    3
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import torch

from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.provenance import untrained
from vitcam_nb.targets.base import Target

__all__ = ["ClassTargets", "as_target", "class_labels", "head_size", "model_logits"]


def model_logits(output: object) -> object:
    """The logits in a model's output: the tensor itself, or the ``logits`` of a Hugging Face model output.

    Example:
        >>> class Out: logits = torch.ones(1, 3)
        >>> tuple(model_logits(Out()).shape), tuple(model_logits(torch.ones(1, 2)).shape)
        ((1, 3), (1, 2))
    """
    logits = getattr(output, "logits", None)
    return logits if not isinstance(output, torch.Tensor) and isinstance(logits, torch.Tensor) else output


def hf_config(model: object) -> object | None:
    """The Hugging Face config of a ``transformers`` model (one with ``id2label``), else None.

    Example:
        >>> hf_config(torch.nn.Identity()) is None
        True
    """
    cfg = getattr(model, "config", None)
    return cfg if cfg is not None and hasattr(cfg, "id2label") and hasattr(cfg, "num_labels") else None


def head_size(model: object) -> int:
    """Classes of the model's classifier head: timm's ``num_classes``, or a Hugging Face classifier's
    ``config.num_labels`` (0 for a backbone without a head).

    Example:
        >>> head_size(torch.nn.Identity())
        0
    """
    n = getattr(model, "num_classes", None)
    if n is not None:
        return int(n or 0)
    cfg = hf_config(model)
    if cfg is not None and any(hasattr(model, h) for h in ("classifier", "cls_classifier")):
        return int(cfg.num_labels)
    return 0


def _is_detector(model: object) -> bool:
    """Whether ``model`` is a Hugging Face object detector (a ``...ForObjectDetection`` class: YOLOS, OWL-ViT, ...).

    Example:
        >>> _is_detector(torch.nn.Identity())
        False
    """
    return any(c.__name__.endswith("ForObjectDetection") for c in type(model).__mro__)


def _is_vlm(model: object) -> bool:
    """Whether ``model`` is a generative VLM class the kit knows (read or refused by name).

    Example:
        >>> _is_vlm(torch.nn.Identity())
        False
    """
    from vitcam_nb.adapters.hf_vlm import HfVlmAdapter  # lazy: the class list, no transformers import

    names = set(HfVlmAdapter.classes)
    return any(c.__name__ in names and c.__module__.startswith("transformers") for c in type(model).__mro__)


class ClassTargets(Target):
    """The classifier's logits: ``"topK"`` (the K highest), an int class or a list of ints. The default
    ``"top5"`` traces ``min(5, num_classes)`` classes; any other K above the class count is refused.

    Example:
        >>> ClassTargets("top3").k
        3
    """

    kind = "class"
    description = "classifier logits"

    def __init__(self, spec: str | int | Sequence[int] = "top5", labels: Sequence[str] | None = None):
        self.spec, self.labels_given = spec, labels
        self.k: int | None = None
        self.classes: list[int] | None = None
        if isinstance(spec, str):
            m = re.fullmatch(r"top(\d+)", spec)
            if not m or int(m.group(1)) < 1:
                raise TraceError(f"targets: expected 'topK' with K >= 1, an int class or a list of ints, "
                                 f"got {spec!r}")
            self.k = int(m.group(1))
            return
        items = [spec] if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool) else spec
        if not isinstance(items, Sequence) or len(items) == 0:
            raise TraceError(f"targets: expected 'top5', 'topK', an int class, a non-empty list of ints or a "
                             f"vitcam_nb.targets target, got {spec!r}")
        classes: list[int] = []
        for c in items:
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
                raise TraceError(f"targets: class indices must be ints, got {c!r}")
            if int(c) not in classes:
                classes.append(int(c))
        self.classes = classes

    def check(self, model: torch.nn.Module) -> None:
        n = head_size(model)
        if n <= 0 and _is_detector(model):
            raise TraceError(f"model: {type(model).__name__} is a detector (no classifier head): class targets need "
                             "a classifier's logits. Explain a detection with targets=vitcam_nb.targets.detection("
                             "box=(x0, y0, x1, y1)) or detection(query=i, class_=c) (OWL: text=[...], tokenizer=)")
        if n <= 0 and _is_vlm(model):
            raise TraceError(f"targets: {self.spec!r} ranks a classifier's logits, but {type(model).__name__} is a "
                             "generative VLM (no classifier head): explain its answer with targets=vitcam_nb.targets."
                             "answer(input_ids=..., answer_ids=...) (or prompt=, answer=, processor=), or "
                             "vitcam_nb.targets.generated(...) for what model.generate produced")
        self.check_count(n)

    def check_count(self, n: int) -> None:
        """Refuse classes outside a head of ``n`` classes (``n = 0``: no head)."""
        if n <= 0:
            raise TraceError("model: has no classifier head (num_classes=0); class targets need logits. For an "
                             "embedding model use targets=vitcam_nb.targets.similarity(vectors, labels); for a "
                             "segmentation model (a (B, classes, H, W) output) vitcam_nb.targets.region(mask, class_) "
                             "or vitcam_nb.targets.dense(fn, labels)")
        if self.spec == "top5" and self.k is not None and self.k > n:
            self.k = n  # the default means "up to five": a 3-class head traces its 3 classes
        if self.k is not None and self.k > n:
            raise TraceError(f"targets: expected 'topK' with 1 <= K <= {n}, got {self.spec!r}")
        for c in self.classes or []:
            if not 0 <= c < n:
                raise TraceError(f"targets: class {c} is out of range; the model has {n} classes (0..{n - 1})")

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.batch_scores(model, x)[0]

    def batch_scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        logits = model_logits(model(x))
        n = int(x.shape[0])
        if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.shape[0] != n:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TraceError(f"model: expected logits of shape ({n}, classes), got {shape}")
        return logits

    def choose(self, scores: torch.Tensor) -> list[int]:
        if self.k is not None:
            return [int(c) for c in torch.topk(scores.detach(), self.k).indices]
        return list(self.classes or [])

    def class_labels(self, model: torch.nn.Module, n: int) -> list[str]:
        return class_labels(model, n, self.labels_given)


def class_labels(model: torch.nn.Module, num_classes: int, labels: Sequence[str] | None = None) -> list[str]:
    """Names of a classifier's classes: ``labels`` when given (checked), else the model's
    ``pretrained_cfg["label_names"]``, else a Hugging Face model's ``config.id2label``, else ImageNet's for a
    1000-class timm head, else "class i". A Hugging Face model never gets ImageNet's names: its labels are its
    config's. An untrained timm model (:func:`vitcam_nb.core.provenance.untrained`) gets "class i": its classes
    mean nothing yet.

    Example:
        >>> import torch
        >>> class_labels(torch.nn.Identity(), 2)
        ['class 0', 'class 1']
    """
    if labels is not None:
        if isinstance(labels, str) or len(labels) != num_classes:
            raise TraceError(f"labels: expected a sequence of {num_classes} class names, got {labels!r:.80}")
        return [str(v) for v in labels]
    hf = hf_config(model)
    if hf is not None:  # the config's labels are the user's own statement, trained or not
        id2label = {int(k): str(v) for k, v in (hf.id2label or {}).items()}
        return [id2label.get(i, f"class {i}") for i in range(num_classes)]
    if untrained(model):
        return [f"class {i}" for i in range(num_classes)]
    cfg = getattr(model, "pretrained_cfg", None) or {}
    names = cfg.get("label_names") if isinstance(cfg, dict) else None
    if names is not None and len(names) == num_classes:
        return [str(v) for v in names]
    if num_classes == 1000:
        from timm.data import ImageNetInfo

        info = ImageNetInfo()
        return [info.index_to_description(i).split(",")[0] for i in range(1000)]
    return [f"class {i}" for i in range(num_classes)]


def as_target(targets: object, labels: Sequence[str] | None = None) -> Target:
    """The :class:`Target` for the ``targets`` argument of :func:`vitcam_nb.trace`.

    Example:
        >>> as_target("top2").k
        2
    """
    if isinstance(targets, Target):
        if labels is not None:
            raise TraceError("labels: give labels to the target itself (e.g. similarity(vectors, labels)), "
                             "not to trace()")
        return targets
    return ClassTargets(targets, labels)
