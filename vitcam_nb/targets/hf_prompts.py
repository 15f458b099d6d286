"""Text embeddings of prompts from a Hugging Face two-tower model (CLIP, SigLIP): the tokenizer and the text
model come from the caller (``vitcam_nb[hf]``), and :func:`vitcam_nb.targets.prompts` uses them as it uses
open_clip's.

Example:
    >>> is_hf_text_model(torch.nn.Linear(1, 1))
    False
"""

from __future__ import annotations

from typing import Any

import torch

from vitcam_nb.core.errors import ArgumentTypeError
from vitcam_nb.targets.embedding import pooled_embedding

__all__ = ["hf_text_embeddings", "is_hf_text_model"]


def is_hf_text_model(text_model: object) -> bool:
    """Whether ``text_model`` is a Hugging Face model with ``get_text_features`` (CLIPModel, SiglipModel, ...).

    Example:
        >>> is_hf_text_model(object())
        False
    """
    return isinstance(text_model, torch.nn.Module) and callable(getattr(text_model, "get_text_features", None)) \
        and type(text_model).__module__.startswith("transformers")


def hf_text_embeddings(texts: list[str], tokenizer: Any, text_model: torch.nn.Module) -> torch.Tensor:
    """(N, D) text embeddings: ``text_model.get_text_features`` on the tokenizer's ids, without gradients, the
    text model's train/eval modes restored. SigLIP models are tokenised padded to the maximum length, as they
    were trained; others padded to the longest prompt.

    Example:
        >>> hf_text_embeddings(["a dog"], tok, clip_model).shape  # doctest: +SKIP
        torch.Size([1, 512])
    """
    if not callable(tokenizer):
        raise ArgumentTypeError(f"tokenizer: expected a Hugging Face tokenizer (AutoTokenizer.from_pretrained(...)), "
                                f"got {type(tokenizer).__name__}")
    padding = "max_length" if type(text_model).__name__.startswith("Siglip") else True
    try:
        enc = tokenizer(texts, padding=padding, return_tensors="pt")
    except Exception as exc:
        raise ArgumentTypeError(f"tokenizer: calling it on the prompts failed ({type(exc).__name__}: {exc}); expected "
                                f"a Hugging Face tokenizer") from exc
    ids = enc["input_ids"] if hasattr(enc, "__getitem__") else None
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] != len(texts):
        raise ArgumentTypeError(f"tokenizer: expected input_ids of shape ({len(texts)}, length), got "
                                f"{type(ids).__name__}; expected a Hugging Face tokenizer")
    params = list(text_model.parameters())
    device = params[0].device if params else torch.device("cpu")
    inputs = {k: enc[k].to(device) for k in ("input_ids", "attention_mask") if k in enc}
    modes = [(m, m.training) for m in text_model.modules()]
    text_model.eval()
    try:
        with torch.no_grad():
            emb = pooled_embedding(text_model.get_text_features(**inputs))
    except Exception as exc:
        raise ArgumentTypeError(f"text_model: get_text_features failed on the tokenizer's output "
                                f"({type(exc).__name__}: {exc}); are tokenizer and text_model from the same "
                                "model?") from exc
    finally:
        for m, mode in modes:
            m.training = mode
    if not isinstance(emb, torch.Tensor) or emb.ndim != 2 or emb.shape[0] != len(texts):
        got = tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__
        raise ArgumentTypeError(f"text_model: get_text_features returned {got}, expected ({len(texts)}, D)")
    return emb.detach()
