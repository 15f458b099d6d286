"""A generative VLM's answer as a target (``vitcam_nb[hf]``): the answer tokens scored by teacher forcing in one
forward pass of the prompt with the answer appended.

The traced "classes" are the answer tokens: class ``k`` is the logit of answer token ``k`` at the position that
predicts it (the position before it), labelled with the decoded token (or ``[id]`` without a tokenizer); one more
entry, the last, is the sequence score: the sum over the answer tokens of their log-probabilities over the whole
vocabulary; after it, one entry per answer token: the logsumexp over the vocabulary at its predicting position
(``lse_k``), so ``target="prob"``/``"logprob"`` are the model's own softmax over its vocabulary, ``log p_k = z_k -
lse_k``, derived exactly from the stored gradients. ``Recipe(class_=0)`` explains the first answer token.

Example:
    >>> t = answer(input_ids=[1, 9, 9, 9, 9, 5], answer_ids=[7, 8])
    >>> t.labels, t.answer_positions.tolist()
    (['[7]', '[8]', 'sequence log-prob', 'logsumexp@[7]', 'logsumexp@[8]'], [6, 7])
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.hf_vlm import HfVlmAdapter, image_token_id, unused_tower_layers, vlm_family_of
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, TraceError
from vitcam_nb.targets.base import Target, register_target
from vitcam_nb.targets.blip_matching import as_token_ids

__all__ = ["AnswerTarget", "LSE_LABEL", "SEQUENCE_LABEL", "answer", "generated"]

SEQUENCE_LABEL = "sequence log-prob"
#: label prefix of the entries holding each answer position's logsumexp over the vocabulary
LSE_LABEL = "logsumexp"


class AnswerTarget(Target):
    """The answer tokens of one prompt (teacher forcing) and the sequence log-prob; built by :func:`answer` or
    :func:`generated`.

    Example:
        >>> t = AnswerTarget(torch.tensor([1, 9, 5]), torch.tensor([7]), None)
        >>> t.sequence.tolist(), t.labels
        ([1, 9, 5, 7], ['[7]', 'sequence log-prob', 'logsumexp@[7]'])
    """

    kind = "answer"

    def __init__(self, input_ids: torch.Tensor, answer_ids: torch.Tensor, tokenizer: Any,
                 model_kwargs: Mapping[str, Any] | None = None):
        self.input_ids, self.answer_ids, self.tokenizer = input_ids, answer_ids, tokenizer
        if model_kwargs is not None and not isinstance(model_kwargs, Mapping):
            raise ArgumentTypeError(f"model_kwargs: expected a dict of forward arguments, got "
                                    f"{type(model_kwargs).__name__}")
        #: extra keyword arguments of the model's forward (e.g. ``image_sizes``), passed as given
        self.model_kwargs = dict(model_kwargs or {})
        self.sequence = torch.cat([input_ids, answer_ids])
        self.answer_positions = np.arange(len(input_ids), len(self.sequence), dtype=np.int64)
        ids = [int(i) for i in answer_ids]
        tokens = None
        if tokenizer is not None and hasattr(tokenizer, "decode"):
            with contextlib.suppress(Exception):  # a user's tokenizer may not take these arguments
                tokens = [str(tokenizer.decode([i])) for i in ids]
        self.tokens = tokens if tokens is not None and len(tokens) == len(ids) else [f"[{i}]" for i in ids]
        self.labels = [*self.tokens, SEQUENCE_LABEL, *(f"{LSE_LABEL}@{t}" for t in self.tokens)]
        self.layout_text, self.unused_text, self.zero_cause, self.types_text = "", "", "", ""
        words = " ".join(repr(s) for s in self.tokens)
        self.description = (f"answer-token logits by teacher forcing (each token's logit at the position before it) "
                            f"of the answer {words[:200]}, then the sequence log-prob (sum of the answer tokens' "
                            "log-softmax over the vocabulary), then each answer position's logsumexp over the "
                            "vocabulary (so prob/logprob are the softmax over the whole vocabulary)")

    def check(self, model: torch.nn.Module) -> None:
        vlm_family_of(model)  # a classifier, or a known VLM family not read yet, is refused by name
        vocab = int(getattr(model.config, "text_config", model.config).vocab_size)
        seq = self.sequence.tolist()  # plain ints: a few checks, not tensor ops
        if seq and (max(seq) >= vocab or min(seq) < 0):
            raise TraceError(f"input_ids: token ids must lie in 0..{vocab - 1} (the LM's vocabulary), got ids "
                             f"{min(seq)}..{max(seq)}")
        if int(image_token_id(model)) in set(self.answer_ids.tolist()):
            raise TraceError("answer_ids: holds the image placeholder token; the answer must be text")
        adapter = _vlm_adapter(model)
        self.layout_text = adapter.layout(model, self.sequence.numpy(), self.model_kwargs).description
        n_tower = len(adapter.blocks(model))
        chosen = self.model_kwargs.get("vision_feature_layer")
        self.unused_text = ", ".join(map(str, unused_tower_layers(model, n_tower, chosen)))
        fam_row = vlm_family_of(model)
        self.types_text = "" if fam_row.token_types is None else (
            "given in model_kwargs" if fam_row.token_types_key in self.model_kwargs else fam_row.token_types_text)
        layer = chosen if chosen is not None else getattr(model.config, "vision_feature_layer", -1)
        fam = vlm_family_of(model).name
        # the cause a zero-gradient verdict states (the classifier's "CLS pooling" text would be false here)
        self.zero_cause = (f"{fam}'s projector reads the tower's hidden states of vision_feature_layer={layer}, so "
                           f"the language model never reads tower layer(s) {self.unused_text}" if self.unused_text
                           else f"in {fam}, the answer does not reach these tokens through this site")

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        seq = self.sequence[None].to(x.device)
        extra = {k: v.to(x.device) if isinstance(v, torch.Tensor) else v for k, v in self.model_kwargs.items()}
        fam = vlm_family_of(model)
        if fam.token_types is not None and fam.token_types_key not in extra:
            # the attention mask the family's processor and generate give (PaliGemma's bidirectional prefix):
            # without it the forward would be plain causal, another model than the one that answered
            extra[fam.token_types_key] = fam.token_types(model, seq[0], len(self.input_ids))[None]
        out = model(input_ids=seq, pixel_values=x, attention_mask=torch.ones_like(seq), use_cache=False, **extra)
        logits = getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or logits.shape[1] != seq.shape[1]:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TraceError(f"model: expected logits of shape (1, {seq.shape[1]}, vocab), got {got}")
        ids = self.answer_ids.to(x.device)
        # (n_answer, vocab): the positions predicting each answer token, one after the other (a view, not a gather)
        at = logits[0, len(self.input_ids) - 1:len(self.sequence) - 1]
        token_logits = at.gather(1, ids[:, None])[:, 0]
        lse = torch.logsumexp(at.float(), dim=-1)  # (n_answer,): log p_k = z_k - lse_k over the vocabulary
        seq_score = (token_logits.float() - lse).sum().to(at.dtype)
        return torch.cat([token_logits, seq_score[None], lse.to(at.dtype)])

    def settings(self) -> dict:
        extra = {k: v.tolist() if isinstance(v, (torch.Tensor, np.ndarray)) else repr(v)
                 for k, v in sorted(self.model_kwargs.items())}
        # "entries": the score vector's layout (tokens, sequence log-prob, vocabulary logsumexps), so a trace made
        # before the logsumexps were traced never shares an id with one made after
        input_ids, answer_ids = ([int(i) for i in t.tolist()] for t in (self.input_ids, self.answer_ids))
        return {"kind": self.kind, "entries": "tokens,sequence,lse", "input_ids": input_ids, "answer_ids": answer_ids,
                **({"model_kwargs": extra} if extra else {})}

    def attrs(self) -> dict[str, object]:
        items = {"answer tokens": ", ".join(f"{k}: {s!r} (id {int(i)}, position {int(p)})" for k, (s, i, p) in
                                           enumerate(zip(self.tokens, self.answer_ids.tolist(),
                                                         self.answer_positions.tolist()))),
                 "image-token layout": self.layout_text or "not known (the target was not checked on a model)"}
        if self.types_text:
            items["token types"] = self.types_text
        if self.unused_text:
            items["tower layers the LM never reads"] = (
                f"{self.unused_text} (above the vision_feature_layer the projector reads): gradients there are "
                "exactly zero, so their maps are degenerate")
        return {**super().attrs(), "answer_ids": ",".join(str(int(i)) for i in self.answer_ids.tolist()),
                "answer_tokens": json.dumps(self.tokens), "image_token_layout": self.layout_text,
                **({"zero_gradient_cause": self.zero_cause} if self.zero_cause else {}),
                "target_checklist": json.dumps(items)}


def _vlm_adapter(model: torch.nn.Module) -> HfVlmAdapter:
    """The adapter registered for ``model`` when it is a generative-VLM one (a family with its own tower, e.g.
    Qwen2-VL, subclasses :class:`HfVlmAdapter`), else the plain one (which refuses the model by name)."""
    from vitcam_nb.adapters.registry import find_adapter

    try:
        adapter = find_adapter(model)
    except TypeError:
        adapter = None
    return adapter if isinstance(adapter, HfVlmAdapter) else HfVlmAdapter()


def _tokenizer_of(processor: Any, tokenizer: Any) -> Any:
    return tokenizer if tokenizer is not None else getattr(processor, "tokenizer", None)


def _prompt_ids(prompt: str, processor: Any, model_kwargs: Mapping[str, Any] | None = None) -> torch.Tensor:
    """The processor's ids of ``prompt``, its image placeholder expanded as for an image of its own size, or, for
    a processor that sizes the expansion by the image (Qwen2-VL: it returns ``image_grid_thw``), as for an image
    of the ``image_grid_thw`` given in ``model_kwargs``."""
    from PIL import Image  # the processor needs an image to expand the placeholder; only its size matters

    image_processor = getattr(processor, "image_processor", None)
    size = getattr(image_processor, "crop_size", None) or {}
    h, w = int(size.get("height", 336)), int(size.get("width", 336))
    grid = (model_kwargs or {}).get("image_grid_thw")
    if grid is not None:
        grid = np.asarray(grid.tolist() if isinstance(grid, torch.Tensor) else grid, dtype=np.int64).reshape(-1, 3)
        patch = int(getattr(image_processor, "patch_size", 14))
        h, w = int(grid[0, 1]) * patch, int(grid[0, 2]) * patch
    try:
        enc = processor(images=Image.new("RGB", (w, h)), text=prompt, return_tensors="pt")
    except Exception as exc:
        raise ArgumentTypeError(f"processor: calling it on the prompt failed ({type(exc).__name__}: {exc}); "
                                "expected the model's transformers processor") from exc
    got = enc.get("image_grid_thw") if hasattr(enc, "get") else None
    if got is not None and grid is None:
        raise ArgumentError("model_kwargs: this processor expands the image placeholder by the image's size (it "
                            "returns image_grid_thw); give model_kwargs={'image_grid_thw': ...} from the processor's "
                            "output for your image")
    if got is not None and np.asarray(got).reshape(-1, 3)[:1].tolist() != grid[:1].tolist():
        raise ArgumentError(f"model_kwargs: image_grid_thw {grid[:1].tolist()} is not what the processor gives an "
                            f"image of {h}x{w} px ({np.asarray(got).reshape(-1, 3)[:1].tolist()}); give the "
                            "processor's own image_grid_thw for your image")
    return as_token_ids(enc["input_ids"], "prompt")


@register_target
def answer(input_ids: Any = None, answer_ids: Any = None, *, prompt: str | None = None, answer: str | None = None,
           processor: Any = None, tokenizer: Any = None, model_kwargs: Mapping[str, Any] | None = None
           ) -> AnswerTarget:
    """Target a generative VLM's answer: its tokens' logits (teacher forcing) and the sequence log-prob.

    Give either ``input_ids`` (the prompt's ids holding the model's image placeholder tokens, as its processor
    makes them) and ``answer_ids``, or ``prompt`` and ``answer`` text with the model's ``processor``.
    ``model_kwargs``: extra keyword arguments of the model's forward that the image needs (e.g. ``image_sizes``
    of an any-resolution model), passed to it as given; the image-token layout reads them too.

    Example:
        >>> answer(input_ids=[1, 9, 9, 9, 9], answer_ids=[5]).labels
        ['[5]', 'sequence log-prob', 'logsumexp@[5]']
    """
    if prompt is not None or answer is not None:
        if input_ids is not None or answer_ids is not None:
            raise ArgumentError("prompt: give either prompt/answer text or input_ids/answer_ids, not both")
        if not isinstance(prompt, str) or not isinstance(answer, str) or not answer.strip():
            raise ArgumentTypeError("prompt: prompt and answer must both be non-empty strings")
        tok = _tokenizer_of(processor, tokenizer)
        if processor is None or tok is None:
            raise ArgumentError("processor: prompt/answer text needs the model's processor (with its tokenizer)")
        ids = _prompt_ids(prompt, processor, model_kwargs)
        ans = as_token_ids(tok(answer, add_special_tokens=False, return_tensors="pt")["input_ids"], "answer")
        return AnswerTarget(ids, ans, tok, model_kwargs)
    if input_ids is None or answer_ids is None:
        raise ArgumentError("input_ids: give input_ids and answer_ids (or prompt, answer and processor)")
    return AnswerTarget(as_token_ids(input_ids, "input_ids"), as_token_ids(answer_ids, "answer_ids"),
                        _tokenizer_of(processor, tokenizer), model_kwargs)


@register_target
def generated(sequences: Any, input_ids: Any, *, processor: Any = None, tokenizer: Any = None,
              stop_ids: Any = (), model_kwargs: Mapping[str, Any] | None = None) -> AnswerTarget:
    """Target what ``model.generate`` produced: ``sequences`` (its output, prompt included) after ``input_ids``.

    Trailing ids in ``stop_ids`` (e.g. the end-of-sequence and pad ids) are left out of the answer;
    ``model_kwargs`` as in :func:`answer`.

    Example:
        >>> generated([[1, 9, 9, 5, 6, 2]], [1, 9, 9], stop_ids=[2]).answer_ids.tolist()
        [5, 6]
    """
    seq, prompt = as_token_ids(sequences, "sequences"), as_token_ids(input_ids, "input_ids")
    n = len(prompt)
    if len(seq) <= n or not torch.equal(seq[:n], prompt):
        raise ArgumentError("sequences: does not start with input_ids followed by generated tokens; pass the "
                            "output of model.generate(input_ids=..., ...) for this prompt")
    stops = {int(i) for i in np.asarray(stop_ids, dtype=np.int64).ravel()}
    new = seq[n:]
    while len(new) and int(new[-1]) in stops:
        new = new[:-1]
    if not len(new):
        raise ArgumentError("sequences: generated only stop tokens; there is no answer to explain")
    return AnswerTarget(prompt, new, _tokenizer_of(processor, tokenizer), model_kwargs)
