"""Text prompts as targets for open_clip models (``pip install vitcam_nb[clip]``): the similarity of the image
embedding to the text embeddings of prompts, times CLIP's logit scale — the zero-shot classification logits.

open_clip itself is never imported here: the tokenizer and text model come from the caller.

Example:
    >>> import open_clip, numpy as np, vitcam_nb as vc  # doctest: +SKIP
    >>> model, _, _ = open_clip.create_model_and_transforms("ViT-B-32", pretrained="openai")  # doctest: +SKIP
    >>> t = vc.targets.prompts(["a dog", "a cat"], tokenizer=open_clip.get_tokenizer("ViT-B-32"),
    ...                        text_model=model)  # doctest: +SKIP
    >>> tr = vc.trace(model, np.zeros((224, 224, 3), np.uint8), targets=t)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.open_clip import image_embedding_dim, is_whole_clip
from vitcam_nb.core.errors import ArgumentTypeError, TraceError
from vitcam_nb.targets.base import register_target
from vitcam_nb.targets.embedding import Similarity, pooled_embedding, similarity, similarity_scores
from vitcam_nb.targets.hf_prompts import hf_text_embeddings, is_hf_text_model

__all__ = ["ClipPrompts", "prompts"]


class ClipPrompts(Similarity):
    """:class:`~vitcam_nb.targets.Similarity` to prompt embeddings that calls ``encode_image`` for a whole CLIP
    model and the tower itself for ``model.visual``.

    Example:
        >>> t = prompts(["a dog"], tokenizer=tok, text_model=clip_model)  # doctest: +SKIP
        >>> t.scores(clip_model, x).shape  # doctest: +SKIP
        torch.Size([1])
    """

    def __init__(self, vectors: torch.Tensor, labels: list[str], scale: float, scale_source: str,
                 library: str = "open_clip"):
        super().__init__(vectors, labels, "cosine", scale, source=f"{library} text embeddings of the prompts")
        self.scale_source = scale_source
        self.description = f"{self.description} ({scale_source})"

    def check(self, model: torch.nn.Module) -> None:
        try:
            dim = image_embedding_dim(model)
        except TypeError:
            super().check(model)  # another embedding model: the generic rules apply
            return
        if dim is not None and dim != self.vectors.shape[1]:
            raise TraceError(f"text_model: its text embeddings have {self.vectors.shape[1]} dimensions but the image "
                             f"tower returns {dim}; use the text model of the same CLIP model")

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        # The input size was checked by the adapter (trace() calls check_input before the forward pass).
        if is_whole_clip(model):
            emb = model.encode_image(x)
        else:  # an image tower, or a Hugging Face two-tower model (its image features)
            encode = getattr(model, "get_image_features", None)
            emb = pooled_embedding(encode(pixel_values=x) if callable(encode) else model(x))
        if isinstance(emb, (tuple, list)):  # output_tokens=True returns (pooled, tokens)
            emb = emb[0]
        if not isinstance(emb, torch.Tensor) or emb.ndim != 2 or emb.shape[0] != 1:
            shape = tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__
            raise TraceError(f"model: expected an image embedding of shape (1, D), got {shape}")
        if emb.shape[1] != self.vectors.shape[1]:
            raise TraceError(f"text_model: its text embeddings have {self.vectors.shape[1]} dimensions but the image "
                             f"model returns {emb.shape[1]}; use the text model of the same CLIP model")
        return similarity_scores(emb[0], self.vectors.to(emb.device, emb.dtype), self.metric, self.scale)

    def settings(self) -> dict:
        return {**super().settings(), "prompts": list(self.labels)}

    def attrs(self) -> dict[str, object]:
        return {**super().attrs(), "similarity_scale_source": self.scale_source}


def _tokens(texts: list[str], tokenizer: Any) -> torch.Tensor:
    if not callable(tokenizer):
        raise ArgumentTypeError(f"tokenizer: expected an open_clip tokenizer (e.g. open_clip.get_tokenizer(name)), "
                                f"got {type(tokenizer).__name__}")
    try:
        tokens = tokenizer(texts)
    except Exception as exc:  # a wrong object can fail in any way; say which argument it was
        raise ArgumentTypeError(f"tokenizer: calling it on the prompts failed ({type(exc).__name__}: {exc}); expected "
                                f"an open_clip tokenizer") from exc
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.shape[0] != len(texts) \
            or tokens.dtype.is_floating_point:
        got = f"shape {tuple(tokens.shape)}, dtype {tokens.dtype}" if isinstance(tokens, torch.Tensor) \
            else type(tokens).__name__
        raise ArgumentTypeError(f"tokenizer: expected it to return an integer tensor of shape ({len(texts)}, context), "
                                f"got {got}; expected an open_clip tokenizer")
    return tokens


def _resolve_scale(logit_scale: bool | float, text_model: Any) -> tuple[float, str]:
    if logit_scale is True:
        ls = getattr(text_model, "logit_scale", None)
        if not isinstance(ls, torch.Tensor) or ls.numel() != 1:
            raise TraceError("logit_scale: True takes text_model.logit_scale.exp(), but text_model has no scalar "
                             "logit_scale; pass logit_scale=False or a number")
        scale = float(ls.detach().float().exp())
        return scale, f"text_model.logit_scale.exp() = {scale:g}"
    if logit_scale is False:
        return 1.0, "unscaled (logit_scale=False)"
    if isinstance(logit_scale, (int, float, np.integer, np.floating)) and np.isfinite(logit_scale) \
            and logit_scale > 0:
        return float(logit_scale), f"scale {float(logit_scale):g} given as logit_scale"
    raise TraceError(f"logit_scale: expected True, False or a finite number > 0, got {logit_scale!r}")


@register_target
def prompts(texts: Sequence[str], *, tokenizer: Any, text_model: Any, logit_scale: bool | float = True
            ) -> ClipPrompts:
    """Target the similarity of an open_clip image embedding to the text embeddings of ``texts``.

    The scores are ``scale * cos(image_emb, encode_text(tokenizer(texts))_i)``: CLIP's zero-shot logits when
    ``scale`` is the model's own ``logit_scale.exp()`` (``logit_scale=True``), so ``target="prob"`` recipes
    give the zero-shot probability. The labels are the prompt texts.

    Args:
        texts: a non-empty list of prompts, each with some text after tokenisation.
        tokenizer: an open_clip tokenizer (``open_clip.get_tokenizer(name)``), or a Hugging Face tokenizer.
        text_model: an open_clip model with ``encode_text`` (usually the same CLIP model that is traced), or a
            Hugging Face ``CLIPModel`` / ``SiglipModel`` (``get_text_features``; SigLIP's ``logit_bias``, the
            same shift for every prompt, is left out: it changes neither the gradients nor the softmax).
        logit_scale: True: ``text_model.logit_scale.exp()``; False: 1; a number: that scale.

    Example:
        >>> import open_clip, vitcam_nb as vc  # doctest: +SKIP
        >>> t = vc.targets.prompts(["a photo of a dog", "a photo of a cat"],
        ...                        tokenizer=open_clip.get_tokenizer("ViT-B-32"), text_model=model)  # doctest: +SKIP
        >>> t.labels  # doctest: +SKIP
        ['a photo of a dog', 'a photo of a cat']
    """
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise ArgumentTypeError(f"texts: expected a list of prompt strings, got {type(texts).__name__}"
                                + ("; wrap a single prompt in a list" if isinstance(texts, str) else ""))
    texts = list(texts)
    if not texts:
        raise TraceError("texts: expected at least one prompt, got an empty list")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ArgumentTypeError(f"texts: prompt {i} is a {type(t).__name__}, expected a string")
    dupes = sorted({t for t in texts if texts.count(t) > 1})
    if dupes:
        raise TraceError(f"texts: duplicate prompts {dupes}; each prompt labels one score")
    if is_hf_text_model(text_model):
        scale, scale_source = _resolve_scale(logit_scale, text_model)
        base = similarity(hf_text_embeddings(texts, tokenizer, text_model), texts, metric="cosine", scale=scale)
        return ClipPrompts(base.vectors, base.labels, base.scale, scale_source, library="transformers")
    if not callable(getattr(text_model, "encode_text", None)) or not isinstance(text_model, torch.nn.Module):
        raise ArgumentTypeError(f"text_model: expected an open_clip model with encode_text (e.g. the CLIP model from "
                                f"open_clip.create_model_and_transforms), got {type(text_model).__name__}")
    scale, scale_source = _resolve_scale(logit_scale, text_model)

    tokens = _tokens(texts, tokenizer)
    # Whatever ids the empty prompt produces (start/end of text, padding) carry no text.
    specials = set(_tokens([""], tokenizer)[0].tolist())
    empty = [texts[i] for i, row in enumerate(tokens.tolist()) if set(row) <= specials]
    if empty:
        raise TraceError(f"texts: {empty} tokenise to nothing but start/end tokens; give each prompt some text")

    params = list(text_model.parameters())
    device = params[0].device if params else torch.device("cpu")
    modes = [(m, m.training) for m in text_model.modules()]
    text_model.eval()
    try:
        with torch.no_grad():
            emb = text_model.encode_text(tokens.to(device))
    except Exception as exc:
        raise ArgumentTypeError(f"text_model: encode_text failed on the tokenizer's output ({type(exc).__name__}: "
                                f"{exc}); are tokenizer and text_model from the same open_clip model?") from exc
    finally:
        for m, mode in modes:
            m.training = mode
    if not isinstance(emb, torch.Tensor) or emb.ndim != 2 or emb.shape[0] != len(texts):
        got = tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__
        raise ArgumentTypeError(f"text_model: encode_text returned {got}, expected ({len(texts)}, D)")
    base = similarity(emb, texts, metric="cosine", scale=scale)  # validates finiteness and zero vectors
    return ClipPrompts(base.vectors, base.labels, base.scale, scale_source)
