"""BLIP's image-text matching score as a target (``pip install vitcam_nb[vlm]``): the two ITM logits (no
match, match) for one text, with its tokens named so that cross-attention maps can pick text rows.

Example:
    >>> t = itm([101, 1037, 3899, 102])
    >>> t.labels, t.tokens[:2]
    (['no match', 'match'], ['[101]', '[1037]'])
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.blip import is_blip_itm
from vitcam_nb.core.errors import TraceError
from vitcam_nb.targets.base import Target, register_target

__all__ = ["ItmTarget", "itm"]


def as_token_ids(value: Any, field: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a 1-D or (1, L) tensor, array or list of ints (``field`` names the argument in
    a refusal).

    Example:
        >>> as_token_ids([[1, 2, 3]], "input_ids").tolist()
        [1, 2, 3]
    """
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
    else:
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{field}: expected a 1-D or (1, L) tensor of ints, got {type(value).__name__}") from exc
        if arr.dtype.kind not in "biufc":
            raise TraceError(f"{field}: expected a 1-D or (1, L) tensor of ints, got {value!r:.80}")
        t = torch.from_numpy(arr) if arr.size else torch.zeros(arr.shape, dtype=torch.int64)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TraceError(f"{field}: expected integer token ids, got dtype {t.dtype}")
    shape = tuple(t.shape)
    if t.ndim == 2 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 1:
        raise TraceError(f"{field}: expected shape (L,) or (1, L) for one text, got {shape}")
    if t.numel() == 0:
        raise TraceError(f"{field}: is empty; expected at least one token")
    return t.to(torch.int64)


_as_ids = as_token_ids  # the name this module's own callers use


class ItmTarget(Target):
    """BLIP's image-text matching head logits (no match, match) for one text; built by :func:`itm`.

    Example:
        >>> t = ItmTarget(torch.tensor([101, 2003, 102]), torch.ones(3, dtype=torch.int64), True, None)
        >>> t.labels, t.tokens
        (['no match', 'match'], ['[101]', '[2003]', '[102]'])
    """

    kind = "itm"
    labels = ["no match", "match"]

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, match: bool, tokenizer: Any):
        self.input_ids, self.attention_mask, self.match, self.tokenizer = input_ids, attention_mask, match, tokenizer
        ids = [int(i) for i in input_ids]
        tokens = None
        if tokenizer is not None and hasattr(tokenizer, "convert_ids_to_tokens"):
            tokens = [str(s) for s in tokenizer.convert_ids_to_tokens(ids)]
        self.tokens = tokens if tokens is not None and len(tokens) == len(ids) else [f"[{i}]" for i in ids]
        kept = [i for i, m in zip(ids, attention_mask.tolist()) if m]
        text = None
        if tokenizer is not None and hasattr(tokenizer, "decode"):
            with contextlib.suppress(Exception):  # a user's tokenizer may not take these arguments
                text = str(tokenizer.decode(kept, skip_special_tokens=True))
        if text is None:
            text = " ".join(s for s, m in zip(self.tokens, attention_mask.tolist()) if m)
        self.text = text if len(text) <= 120 else text[:117] + "..."
        self.description = f"BLIP image-text matching head logits (no match, match) for the text {self.text!r}"

    def _special_ids(self, model: torch.nn.Module | None) -> set[int]:
        special = getattr(self.tokenizer, "all_special_ids", None)
        if special is not None:
            return {int(i) for i in special}
        if model is None:
            return set()
        cfg = model.config.text_config
        ids = (getattr(cfg, name, None) for name in ("pad_token_id", "bos_token_id", "sep_token_id",
                                                     "eos_token_id"))
        return {int(i) for i in ids if isinstance(i, (int, np.integer))}

    def check(self, model: torch.nn.Module) -> None:
        if not is_blip_itm(model):
            raise TraceError(f"targets: itm() needs a transformers BlipForImageTextRetrieval, got "
                             f"{type(model).__module__}.{type(model).__name__}")
        cfg = model.config.text_config
        vocab = int(cfg.vocab_size)
        if int(self.input_ids.max()) >= vocab or int(self.input_ids.min()) < 0:
            raise TraceError(f"input_ids: token ids must lie in 0..{vocab - 1} (the text encoder's vocabulary), "
                             f"got {self.input_ids.tolist()}")
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        if limit and len(self.input_ids) > limit:
            raise TraceError(f"input_ids: {len(self.input_ids)} tokens but the text encoder takes at most {limit}")
        special = self._special_ids(model)
        kept = [int(i) for i, m in zip(self.input_ids, self.attention_mask) if m]
        if special and all(i in special for i in kept):
            raise TraceError(f"input_ids: holds only special tokens {kept} (ids {sorted(special)} are special); "
                             "give the text to match")
        if not any(hasattr(layer, "crossattention") for layer in model.text_encoder.encoder.layer):
            raise TraceError("model: its text encoder has no cross-attention layers (text_config.is_decoder is "
                             "False), so it cannot score image-text matching")

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(pixel_values=x, input_ids=self.input_ids[None].to(x.device),
                    attention_mask=self.attention_mask[None].to(x.device), use_itm_head=True)
        logits = getattr(out, "itm_score", None)
        if logits is None and isinstance(out, (tuple, list)):
            logits = out[0]
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (1, 2):
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TraceError(f"model: expected ITM logits of shape (1, 2), got {shape}")
        return logits[0]

    def choose(self, scores: torch.Tensor) -> list[int]:
        # Both ITM logits are traced (the chosen one first), so class_="top1" works whichever one is higher.
        return [1, 0] if self.match else [0, 1]

    def settings(self) -> dict:
        return {"kind": self.kind, "input_ids": [int(i) for i in self.input_ids],
                "attention_mask": [int(i) for i in self.attention_mask], "match": bool(self.match)}

    def attrs(self) -> dict[str, object]:
        return {**super().attrs(), "itm_match": int(self.match), "itm_text": self.text}


@register_target
def itm(input_ids: Any, attention_mask: Any = None, *, match: bool = True, tokenizer: Any = None) -> ItmTarget:
    """Target BLIP's image-text matching head for one text: the two ITM logits (no match, match).

    The trace differentiates both logits, the chosen one first (``match=True``: "match", class 1), plus the
    expected logit, so ``Recipe(target="prob", class_=1)`` gives the ITM match probability and
    ``class_="top1"`` works whichever logit is higher.

    Args:
        input_ids: token ids of one text, shape (L,) or (1, L), L >= 1 (e.g. ``processor.tokenizer(text,
            return_tensors="pt").input_ids``).
        attention_mask: 0/1 mask of the same shape (default: all ones).
        match: differentiate the "match" logit (True) or the "no match" logit (False).
        tokenizer: optional; its ``convert_ids_to_tokens`` names the text tokens (else "[id]") and its
            ``all_special_ids`` lets a text of only special tokens be refused.

    Example:
        >>> t = itm([101, 1037, 3899, 102])
        >>> t.tokens, t.choose(None)
        (['[101]', '[1037]', '[3899]', '[102]'], [1, 0])
    """
    if not isinstance(match, (bool, np.bool_)):
        raise TraceError(f"match: expected True or False, got {match!r}")
    ids = _as_ids(input_ids, "input_ids")
    if attention_mask is None:
        mask = torch.ones_like(ids)
    else:
        given = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else None
        mask = _as_ids(attention_mask, "attention_mask")
        if mask.shape != ids.shape:
            raise TraceError(f"attention_mask: shape {given or tuple(mask.shape)} does not match input_ids "
                             f"{tuple(getattr(input_ids, 'shape', ids.shape))}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise TraceError(f"attention_mask: expected 0/1 values, got {mask.tolist()}")
        if not bool(mask.any()):
            raise TraceError("attention_mask: masks every token; at least one must be 1")
    target = ItmTarget(ids, mask, bool(match), tokenizer)
    special = target._special_ids(None)
    kept = [int(i) for i, m in zip(ids, mask) if m]
    if special and all(i in special for i in kept):
        raise TraceError(f"input_ids: holds only special tokens {kept}; give the text to match")
    return target

