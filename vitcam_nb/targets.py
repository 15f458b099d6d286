"""What a trace differentiates: a vector of scores computed from the model's output, and which of them.

The trace stores that vector as ``logits`` (one entry per "class") and the gradients of the chosen entries
plus the expected score ``E = sum_j p_j s_j`` (``p = softmax(s)`` detached), exactly as for a classifier, so
every recipe (logit, prob, logprob, topN) works unchanged:

- class targets (the default, ``"top5"``, an int or a list of ints): the classifier's logits;
- :func:`similarity`: the similarity of a model's pooled embedding (``num_classes=0``, e.g. a CLIP image
  tower) to given vectors, cosine or dot product, times a stated scale;
- :func:`prompts` (``vitcam_nb[clip]``): :func:`similarity` to the text embeddings of prompts;
- :func:`itm` (``vitcam_nb[vlm]``): BLIP's image-text matching logits (no match, match).

Example:
    >>> import torch, vitcam_nb as vc
    >>> t = vc.targets.similarity(torch.eye(3, 8), labels=["a", "b", "c"])
    >>> t.labels
    ['a', 'b', 'c']
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vitcam_nb.errors import TraceError
from vitcam_nb.provenance import array_sha256


class Target:
    """Base class: ``scores(model, x)`` returns a 1-D tensor of scores for a batch of one image,
    ``choose(scores)`` the indices to trace. Subclasses fill in ``labels`` and ``description``.

    Example:
        >>> class Mean(Target):
        ...     kind = "mean"
        ...     def scores(self, model, x): return model(x)[0]
    """

    kind: str = "custom"
    description: str = "custom scores"

    def check(self, model: torch.nn.Module) -> None:
        """Refuse a model this target cannot use, before the forward pass."""

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def choose(self, scores: torch.Tensor) -> list[int]:
        return list(range(int(scores.shape[0])))

    def class_labels(self, model: torch.nn.Module, n: int) -> list[str]:
        labels = getattr(self, "labels", None)
        return list(labels) if labels is not None and len(labels) == n else [f"class {i}" for i in range(n)]

    def settings(self) -> dict:
        """What, besides the chosen indices, makes two traces with this target differ (for the trace id)."""
        return {"kind": self.kind}

    def attrs(self) -> dict[str, object]:
        """Flat trace attributes describing the scores (read by the checklist)."""
        return {"target_kind": self.kind, "target_scores": self.description}


class ClassTargets(Target):
    """The classifier's logits: ``"topK"`` (the K highest), an int class or a list of ints.

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
        self.check_count(int(getattr(model, "num_classes", 0) or 0))

    def check_count(self, n: int) -> None:
        """Refuse classes outside a head of ``n`` classes (``n = 0``: no head)."""
        if n <= 0:
            raise TraceError("model: has no classifier head (num_classes=0); class targets need logits. For an "
                             "embedding model use targets=vitcam_nb.targets.similarity(vectors, labels)")
        if self.k is not None and self.k > n:
            raise TraceError(f"targets: expected 'topK' with 1 <= K <= {n}, got {self.spec!r}")
        for c in self.classes or []:
            if not 0 <= c < n:
                raise TraceError(f"targets: class {c} is out of range; the model has {n} classes (0..{n - 1})")

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.shape[0] != 1:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TraceError(f"model: expected logits of shape (1, classes), got {shape}")
        return logits[0]

    def choose(self, scores: torch.Tensor) -> list[int]:
        if self.k is not None:
            return [int(c) for c in torch.topk(scores.detach(), self.k).indices]
        return list(self.classes or [])

    def class_labels(self, model: torch.nn.Module, n: int) -> list[str]:
        from vitcam_nb.tracer import _class_labels

        return _class_labels(model, n, self.labels_given)


class Similarity(Target):
    """Similarity of the model's pooled embedding ``e`` (output of shape (1, D)) to vectors ``v_i``:
    ``s_i = scale * cos(e, v_i)`` or ``scale * e . v_i``. Every vector is traced.

    Example:
        >>> Similarity(torch.ones(2, 4), ["x", "y"], "dot", 1.0).description
        'dot product of the pooled image embedding with each of 2 given vectors, times 1'
    """

    kind = "similarity"

    def __init__(self, vectors: torch.Tensor, labels: list[str], metric: str, scale: float, source: str = ""):
        self.vectors, self.labels, self.metric, self.scale = vectors, labels, metric, scale
        what = "cosine similarity" if metric == "cosine" else "dot product"
        self.description = (f"{what} of the pooled image embedding with each of {len(labels)} "
                            f"{source or 'given vectors'}, times {scale:g}")

    def check(self, model: torch.nn.Module) -> None:
        n = int(getattr(model, "num_classes", 0) or 0)
        if n > 0:
            raise TraceError(f"targets: a similarity target needs an embedding model (num_classes=0, e.g. "
                             f"timm.create_model(..., num_classes=0)); this model has a {n}-class head")

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        encode = getattr(model, "encode_image", None)  # whole CLIP-style models: the image embedding
        emb = encode(x) if callable(encode) else model(x)
        if not isinstance(emb, torch.Tensor) or emb.ndim != 2 or emb.shape[0] != 1:
            shape = tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__
            raise TraceError(f"model: expected a pooled embedding of shape (1, D), got {shape}")
        return similarity_scores(emb[0], self.vectors.to(emb.device, emb.dtype), self.metric, self.scale)

    def settings(self) -> dict:
        return {"kind": self.kind, "metric": self.metric, "scale": self.scale, "labels": self.labels,
                "vectors": array_sha256(self.vectors.detach().cpu().float())}

    def attrs(self) -> dict[str, object]:
        return {**super().attrs(), "similarity_metric": self.metric, "similarity_scale": float(self.scale)}


def similarity_scores(emb: torch.Tensor, vectors: torch.Tensor, metric: str, scale: float) -> torch.Tensor:
    """``scale * cos(emb, v_i)`` or ``scale * emb . v_i`` for each row ``v_i`` of ``vectors``.

    Example:
        >>> similarity_scores(torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 0.0]]), "cosine", 2.0)
        tensor([1.2000])
    """
    if metric == "cosine":
        emb = emb / emb.norm().clamp_min(1e-12)
        vectors = vectors / vectors.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return scale * (vectors @ emb)


def similarity(vectors: Any, labels: Sequence[str] | None = None, *, metric: str = "cosine",
               scale: float = 1.0) -> Similarity:
    """Target the similarity of an embedding model's output to each of ``vectors`` (N x D).

    Use it with models that return a pooled embedding (``num_classes=0``), e.g. timm's CLIP image towers.
    The N similarities play the role of logits: recipes pick one with ``class_=i`` and ``target="prob"``
    gives the softmax over the N vectors (CLIP's zero-shot probability when ``scale`` is its logit scale).

    Args:
        vectors: array or tensor of shape (N, D) or (D,), finite, no zero rows for cosine.
        labels: N names (default "vector i").
        metric: "cosine" (default) or "dot".
        scale: a positive factor applied to every similarity (e.g. CLIP's ``logit_scale.exp()``).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", num_classes=0)
        >>> t = vc.targets.similarity(np.random.default_rng(0).normal(size=(2, 192)), ["cat", "dog"])
        >>> vc.trace(m, np.zeros((224, 224, 3), np.uint8), targets=t, sites=["F1"])["target_label"].values
        array(['cat', 'dog', 'expected logit'], dtype='<U14')
    """
    if isinstance(vectors, torch.Tensor):
        v = vectors.detach().to("cpu", torch.float32)
    else:
        try:
            v = torch.as_tensor(np.asarray(vectors, dtype=np.float32))
        except (TypeError, ValueError) as exc:
            raise TraceError(f"vectors: expected an (N, D) array of numbers, got {type(vectors).__name__}") from exc
    if v.ndim == 1:
        v = v[None]
    if v.ndim != 2 or v.shape[0] < 1 or v.shape[1] < 1:
        raise TraceError(f"vectors: expected shape (N, D) with N, D >= 1, got {tuple(v.shape)}")
    if not torch.isfinite(v).all():
        raise TraceError("vectors: contain NaN or inf")
    if metric not in ("cosine", "dot"):
        raise TraceError(f"metric: expected 'cosine' or 'dot', got {metric!r}")
    if metric == "cosine" and (v.norm(dim=1) == 0).any():
        raise TraceError("vectors: a zero vector has no cosine similarity")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
            or not np.isfinite(scale) or scale <= 0:
        raise TraceError(f"scale: expected a finite number > 0, got {scale!r}")
    if labels is None:
        labels = [f"vector {i}" for i in range(v.shape[0])]
    if isinstance(labels, str) or len(labels) != v.shape[0]:
        raise TraceError(f"labels: expected {v.shape[0]} names, one per vector, got {labels!r:.80}")
    return Similarity(v, [str(s) for s in labels], metric, float(scale))


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


def prompts(texts: Sequence[str], *, tokenizer: Any, text_model: Any, logit_scale: bool | float = True
            ) -> Similarity:
    """Target the similarity of an open_clip image embedding to text prompts (needs ``vitcam_nb[clip]``).

    Example:
        >>> t = prompts(["a dog", "a cat"], tokenizer=tok, text_model=clip)  # doctest: +SKIP
    """
    from vitcam_nb.vlm.clip import prompts as _prompts

    return _prompts(texts, tokenizer=tokenizer, text_model=text_model, logit_scale=logit_scale)


def itm(input_ids: Any, attention_mask: Any = None, *, match: bool = True, tokenizer: Any = None) -> Target:
    """Target BLIP's image-text matching score for one text (needs ``vitcam_nb[vlm]``).

    Example:
        >>> t = itm(input_ids=ids, match=True)  # doctest: +SKIP
    """
    from vitcam_nb.vlm.blip import itm as _itm

    return _itm(input_ids, attention_mask, match=match, tokenizer=tokenizer)
