"""Helpers of the VLM layout tests (``tests/unit/model/test_vlm_layouts_*.py``): tiny text configs, a marking
projector, and the LM's ``inputs_embeds`` read back after the family's own code scattered the image features.

A mark is written into a feature vector's first channels: channel 0 a flag (1 image cell, -1 a newline), then
whatever coordinates the test encodes. Text embeddings are zeroed so every other position reads flag 0."""

from __future__ import annotations

import torch
from torch import nn


def tiny_llama(vocab: int = 64, width: int = 32):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096)


class Marker(nn.Module):
    """Replaces a projector: maps (..., n, d_in) to (..., n, width) holding [1, index along dim 0, token index]
    (or whatever ``fn`` writes), so each projected vector says which crop and patch it came from."""

    def __init__(self, width: int, fn=None):
        super().__init__()
        self.width, self.fn = width, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fn is not None:
            return self.fn(x)
        out = torch.zeros(x.shape[:-1] + (self.width,), dtype=x.dtype)
        out[..., 0] = 1.0
        if x.dim() == 3:
            out[..., 1] = torch.arange(x.shape[0], dtype=x.dtype)[:, None]
        out[..., 2] = torch.arange(x.shape[-2], dtype=x.dtype)
        return out


def lm_inputs(model, lm: nn.Module, **inputs) -> torch.Tensor:
    """Run ``model(**inputs)`` and return the ``inputs_embeds`` its language model received (batch 0)."""
    seen = {}

    def grab(_mod, args, kwargs):
        seen["e"] = kwargs["inputs_embeds"].detach().clone()

    handle = lm.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    return seen["e"][0]


def zero_text(model) -> None:
    with torch.no_grad():
        model.get_input_embeddings().weight.zero_()


def answer_gradients(logits: torch.Tensor, prompt_len: int, answer: list[int], kept: dict, whole: tuple = (),
                     unbatched: tuple = ()
                     ) -> tuple[dict, dict, torch.Tensor]:
    """The hand-written reference of an answer trace: from the LM's ``logits`` (sequence, vocab) of ``prompt +
    answer``, the entries ``vc.targets.answer`` traces (each answer token's logit at its predicting position, the
    sequence log-prob, each position's logsumexp over the vocabulary; then the expected logit the kit appends), each
    differentiated alone by ``torch.autograd.grad`` with respect to the hooked tensors ``kept``. Returns the
    activations (batch row 0; every row for the keys in ``whole``, e.g. a tower run on crops), the gradients
    (entry, ...) and the entries; the tensors of the keys in ``unbatched`` (a packed vision tower's) have no batch
    dimension and are returned whole too."""
    whole = tuple(whole) + tuple(unbatched)
    rows = torch.arange(prompt_len, prompt_len + len(answer)) - 1  # the position that predicts each answer token
    ids = torch.tensor(answer)
    z = logits[rows].gather(1, ids[:, None])[:, 0]
    z = torch.cat([z, torch.log_softmax(logits[rows], -1).gather(1, ids[:, None]).sum()[None],
                   torch.logsumexp(logits[rows], -1)])
    outputs = torch.cat([z, (torch.softmax(z.detach(), 0) * z).sum()[None]])
    keys = list(kept)
    grads: dict = {k: [] for k in keys}
    for o in outputs:
        got = torch.autograd.grad(o, [kept[k] for k in keys], retain_graph=True, allow_unused=True)
        for k, g in zip(keys, got):
            grads[k].append(torch.zeros_like(kept[k]) if g is None else g)
    return ({k: v.detach().numpy() if k in whole else v.detach()[0].numpy() for k, v in kept.items()},
            {k: torch.stack(v).numpy() if k in whole else torch.stack(v)[:, 0].numpy() for k, v in grads.items()},
            z.detach())
