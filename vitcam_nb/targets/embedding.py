"""Similarity targets: the similarity of a model's pooled embedding (``num_classes=0``, e.g. a CLIP image
tower) to given vectors, cosine or dot product, times a stated scale.

Example:
    >>> import torch
    >>> similarity(torch.eye(3, 8), labels=["a", "b", "c"]).labels
    ['a', 'b', 'c']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.provenance import array_sha256
from vitcam_nb.targets.base import Target, register_target
from vitcam_nb.targets.classes import head_size

__all__ = ["Similarity", "pooled_embedding", "similarity", "similarity_scores"]


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
        n = head_size(model)
        if n > 0:
            raise TraceError(f"targets: a similarity target needs an embedding model (num_classes=0, e.g. "
                             f"timm.create_model(..., num_classes=0)); this model has a {n}-class head")
        width = getattr(model, "num_features", None)
        if not callable(getattr(model, "encode_image", None)) and isinstance(width, int):
            self._check_width(width)

    def _check_width(self, width: int) -> None:
        if int(self.vectors.shape[1]) != width:
            raise TraceError(f"vectors: {int(self.vectors.shape[1])}-wide vectors cannot be compared with the "
                             f"model's {width}-wide pooled embedding; give vectors of shape (N, {width})")

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        # Whole CLIP-style models: the image embedding (open_clip's encode_image, transformers' get_image_features).
        encode = getattr(model, "encode_image", None) or getattr(model, "get_image_features", None)
        emb = pooled_embedding(encode(x) if callable(encode) else model(x))
        if not isinstance(emb, torch.Tensor) or emb.ndim != 2 or emb.shape[0] != 1:
            shape = tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__
            raise TraceError(f"model: expected a pooled embedding of shape (1, D), got {shape}")
        self._check_width(int(emb.shape[1]))
        return similarity_scores(emb[0], self.vectors.to(emb.device, emb.dtype), self.metric, self.scale)

    def settings(self) -> dict:
        return {"kind": self.kind, "metric": self.metric, "scale": self.scale, "labels": self.labels,
                "vectors": array_sha256(self.vectors.detach().cpu().float())}

    def attrs(self) -> dict[str, object]:
        return {**super().attrs(), "similarity_metric": self.metric, "similarity_scale": float(self.scale)}


def pooled_embedding(output: object) -> object:
    """The pooled embedding in a model's output: the tensor itself, or a Hugging Face output's
    ``image_embeds`` (projected, CLIP-style) or ``pooler_output``.

    Example:
        >>> class Out: pooler_output = torch.ones(1, 4)
        >>> tuple(pooled_embedding(Out()).shape)
        (1, 4)
    """
    if isinstance(output, torch.Tensor):
        return output
    for name in ("image_embeds", "pooler_output"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return output


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


@register_target
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
