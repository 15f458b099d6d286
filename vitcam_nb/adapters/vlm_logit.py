"""The ``lm_logit`` site of a generative VLM (:class:`~vitcam_nb.adapters.hf_vlm.HfVlmAdapter`): the language
model's "logit lens" read at the image tokens and at the text context, what the token activation map (TAM; Li et
al., ICCV 2025; :mod:`vitcam_nb.compute.tam`) is computed from.

The hook reads the output of the LM's final norm (the sibling ``norm`` of its decoder layer list: the last hidden
state ``h`` exactly as the LM head reads it) at every sequence position. From it, with the model's output embedding
``W`` (``model.get_output_embeddings()``, its bias if any), the assembly keeps only what TAM reads, no hidden state:

- slots: the text tokens TAM weighs as context. The prompt slots are the prompt's text tokens after the last image
  token, but its last token; then one slot per answer token ``m``, at the position that predicts it (``P_m - 1``,
  the first one being the prompt's last token). A slot's class is its token's id (for an answer slot, the answer
  token ``a_m``).
- ``lm_logit`` (lm_slot, image_token): ``(W h_p + b)[class of the slot]`` at every image-token position ``p``, the
  slot's class activated over the image;
- ``lm_logit_text`` (answer_token, lm_slot): ``(W h_q + b)[a_k]`` at every slot's position ``q``, answer token k's
  class activated over the text context.

Both are raw logits (no ReLU; TAM's ReLU is the method's step). No gradient is stored: TAM reads none. A family with
``final_logit_softcapping`` (Gemma 3) has its logits capped after the head; the logits here are the head's, as TAM's
code reads them (``model.lm_head(hidden_states[-1])``), and the attrs say so.

Example:
    >>> slots_of(np.array([1, 9, 9, 4, 5, 6, 7, 8]), np.array([1, 2]), np.array([6, 7]), 9)[0].tolist()
    [3, 4, 5, 6]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vitcam_nb.core.errors import TraceError

__all__ = ["assemble_lm_logit", "final_norm_path", "lm_logit_hook", "slots_of"]


def final_norm_path(lm_layers: str) -> str:
    """The LM's final norm: the ``norm`` beside its decoder layer list (``model.language_model.layers`` ->
    ``model.language_model.norm``), as in every transformers decoder (Llama, Gemma, Qwen2, Idefics3's text model).

    Example:
        >>> final_norm_path("model.language_model.layers")
        'model.language_model.norm'
    """
    parent = lm_layers.rsplit(".", 1)[0] if "." in lm_layers else ""
    return f"{parent}.norm" if parent else "norm"


def lm_logit_hook(model: torch.nn.Module, lm_layers: str) -> list[tuple[torch.nn.Module, str]]:
    """The ``lm_logit`` site's hook: the output of the LM's final norm (one "layer").

    Example:
        >>> lm = torch.nn.Module(); lm.norm = torch.nn.LayerNorm(2)
        >>> model = torch.nn.Module(); model.lm = lm
        >>> lm_logit_hook(model, "lm.layers")[0][1]
        'output'
    """
    path = final_norm_path(lm_layers)
    try:
        return [(model.get_submodule(path), "output")]
    except AttributeError as exc:
        raise TraceError(f"sites: 'lm_logit' reads the LM's final norm at {path!r}, which "
                         f"{type(model).__name__} lacks") from exc


def slots_of(ids: np.ndarray, image_pos: np.ndarray, answer_pos: np.ndarray, image_id: int
             ) -> tuple[np.ndarray, np.ndarray, int]:
    """TAM's context slots of the sequence ``ids``: (positions read for the text scores, each slot's class, the
    number of prompt slots). Prompt slots: the text tokens after the last image token and before the prompt's last
    token; answer slots: each answer token's predicting position (``P_m - 1``) with the answer token's id.

    Example:
        >>> pos, cls, n = slots_of(np.array([1, 9, 9, 4, 5, 6, 7, 8]), np.array([1, 2]), np.array([6, 7]), 9)
        >>> pos.tolist(), cls.tolist(), n
        ([3, 4, 5, 6], [4, 5, 7, 8], 2)
    """
    ids = np.asarray(ids)
    answer_pos = np.asarray(answer_pos, dtype=np.int64)
    last_prompt = int(answer_pos[0]) - 1
    start = int(np.max(image_pos)) + 1 if len(image_pos) else 0
    prompt = np.array([q for q in range(start, last_prompt) if int(ids[q]) != image_id], dtype=np.int64)
    positions = np.concatenate([prompt, answer_pos - 1])
    classes = np.concatenate([ids[prompt], ids[answer_pos]]).astype(np.int64)
    return positions, classes, int(prompt.size)


def _head(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TraceError(f"sites: 'lm_logit' projects the last hidden state with the LM head, but "
                         f"{type(model).__name__} has no output embedding (get_output_embeddings)")
    name = next((n for n, m in model.named_modules() if m is head), "the output embedding")
    bias = getattr(head, "bias", None)
    return head.weight.detach(), (bias.detach() if isinstance(bias, torch.Tensor) else None), name


def _logits(hidden: np.ndarray, weight: torch.Tensor, bias: torch.Tensor | None, classes: np.ndarray
            ) -> np.ndarray:
    """(len(classes), positions): the head's logits of ``classes`` at each row of ``hidden``, in float32."""
    with torch.no_grad():
        w = weight[torch.as_tensor(classes, dtype=torch.long)].to("cpu", torch.float32)
        out = w @ torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32)).T
        if bias is not None:
            out += bias[torch.as_tensor(classes, dtype=torch.long)].to("cpu", torch.float32)[:, None]
    return out.numpy()


def assemble_lm_logit(model: torch.nn.Module, hidden: np.ndarray, ids: np.ndarray, answer_pos: np.ndarray,
                      image_pos: np.ndarray, image_id: int, labels: list[str], lm_layers: str,
                      layout_attrs: dict[str, str], image_coords: dict[str, Any]) -> tuple[dict, dict]:
    """The variables and coordinates of the ``lm_logit`` site from ``hidden`` (sequence, channel), the final
    norm's output of one sequence (see the module's docstring); ``image_coords``: the image tokens' coordinates
    (position, tile, row, col), kept beside the slots'.

    Example:
        >>> class M(torch.nn.Module):  # a head reading hidden channel c as the logit of token c
        ...     config = type("C", (), {})()
        ...     def __init__(self):
        ...         super().__init__(); self.head = torch.nn.Linear(4, 4, bias=False)
        ...         torch.nn.init.eye_(self.head.weight)
        ...     def get_output_embeddings(self): return self.head
        >>> hidden = np.arange(24, dtype=np.float32).reshape(6, 4)  # positions 0..5, channels 0..3
        >>> out, _ = assemble_lm_logit(M(), hidden, np.array([1, 3, 3, 0, 2, 1]), np.array([5]), np.array([1, 2]),
        ...                            3, ["a"], "lm.layers", {}, {})
        >>> out["lm_logit"][1].tolist()  # slot classes 0 (position 3) and 1 (answer) at positions 1, 2
        [[4.0, 8.0], [5.0, 9.0]]
        >>> out["lm_logit_text"][1].tolist()  # answer class 1 at the slots' positions 3 and 4
        [[13.0, 17.0]]
    """
    if hidden.ndim != 2 or hidden.shape[0] != len(ids):
        raise TraceError(f"sites: 'lm_logit' expected the final norm's output over the {len(ids)} sequence "
                         f"positions, got shape {tuple(hidden.shape)}")
    weight, bias, head_name = _head(model)
    answer_pos = np.asarray(answer_pos, dtype=np.int64)
    slot_pos, slot_class, n_prompt = slots_of(ids, image_pos, answer_pos, image_id)
    answer_ids = np.asarray(ids)[answer_pos].astype(np.int64)
    # computed in float32, stored in the trace's storage dtype (that of the hidden state handed over)
    image_logit = _logits(hidden[np.asarray(image_pos)], weight, bias, slot_class).astype(hidden.dtype)
    text_logit = _logits(hidden[slot_pos], weight, bias, answer_ids).astype(hidden.dtype)
    cap = getattr(getattr(model.config, "text_config", model.config), "final_logit_softcapping", None)
    attrs = {"hook": f"{final_norm_path(lm_layers)}:output", "head": head_name,
             "meaning": "logit lens of the LM: the head's logit of each slot's token at the image-token positions "
                        "(lm_logit) and of each answer token at the slots' positions (lm_logit_text), from the "
                        "final norm's output; raw logits (no ReLU)",
             "softcap": (f"the model caps its logits (final_logit_softcapping={cap}) after the head; these are the "
                         "head's logits before the cap, as TAM's code reads them") if cap else "", **layout_attrs}
    kinds = np.array(["prompt"] * n_prompt + ["answer"] * answer_pos.size)
    n = answer_pos.size
    coords: dict[str, Any] = {
        **image_coords,
        "lm_slot": ("lm_slot", np.arange(slot_pos.size, dtype=np.int64)),
        "lm_slot_pos": ("lm_slot", slot_pos),
        "lm_slot_class": ("lm_slot", slot_class),
        "lm_slot_kind": ("lm_slot", kinds),
        "answer_token": ("answer_token", np.arange(n, dtype=np.int64)),
        "answer_token_pos": ("answer_token", answer_pos),
        "answer_token_str": ("answer_token", np.array(list(labels)[:n] or [str(i) for i in range(n)], dtype=str)),
    }
    return {"lm_logit": (("lm_slot", "image_token"), image_logit, attrs),
            "lm_logit_text": (("answer_token", "lm_slot"), text_logit, attrs)}, coords
