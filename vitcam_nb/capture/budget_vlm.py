"""The memory estimate of a generative VLM's answer trace (:class:`~vitcam_nb.adapters.hf_vlm.HfVlmAdapter`, any
registered family): what :func:`vitcam_nb.estimate` and the trace's budget check count for it, from the model's
configs, the adapter and the answer target, before any forward pass.

Every number comes from the plan, not from a per-family table: the vision tower's blocks (the tower config's width,
heads and MLP width; its tokens per crop are the adapter's prefix tokens plus its patch grid, times the crops the
family's ``crop_tiles`` names for this prompt), and on the language side the answer target's sequence (its length
``L``, its answer tokens ``A``) and the family's image-token layout (its ``N`` image tokens). The Dataset stores the
LM sites at the image-token positions only: ``projector`` (N, width), ``lm_resid`` (LM layers, N, width),
``lm_attn`` (LM layers, heads, A, N), each with one gradient per traced entry, so a longer prompt around the same
image leaves them as they are. The pass does not: it captures the LM sites over the whole sequence (``lm_resid``
(L, width), ``lm_attn`` (heads, L, L) per LM layer) with their gradients, and keeps them until the assembly takes
the image-token positions out; the decoder's graph is the eager attention's (heads, L, L) probabilities per layer
beside its token-by-channel tensors; the backward pass holds each entry's gradient of the logits over the whole
vocabulary at every position (the head's backward is dense) or of one layer's attention, whichever is larger. So
the peak grows with the prompt's length squared while the Dataset does not.

Example:
    >>> import vitcam_nb as vc
    >>> from benchmarks.items.vlm_trace_cost import tiny_llava, PROMPT, ANSWER  # doctest: +SKIP
    >>> e = vc.estimate(tiny_llava(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER))  # doctest: +SKIP
    >>> e["parts"]["lm_resid"]  # 2 LM layers x 16 image tokens x 32 channels x 4 bytes  # doctest: +SKIP
    4096
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vitcam_nb.adapters.hf_vlm import LM_SITES, HfVlmAdapter, vlm_family_of
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.prealloc import writes_arrays
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.schema import ATTENTION_SITE, SCORES_SITE

__all__ = ["VlmShape", "is_vlm", "vlm_estimate", "vlm_shape"]

# As in vitcam_nb.capture.budget_peak (the same pass; a VLM trace always takes the plain mode, its extra sites
# being outside the blocks): the pass's own small allocations, the array pass's forward holes, the token x channel
# tensors autograd keeps per block with parameters frozen, the attention-map gradients alive per target.
_PEAK_FIXED = 20e6
_FORWARD_HOLES = 1.6
_GRAPH_TC = 6
_ATTN_GRADS = 2
# A gated MLP (Llama, Gemma, Qwen2: gate and up projections, their activation and product) keeps three tensors of
# its hidden width per token for the backward pass.
_GATED = 3
# Attention-map gradients per target alive at once in a decoder layer's batched backward: the softmax's backward
# holds the gradient it receives and the one it returns, and the lm_attn site's hook takes the one it receives out of
# the batched pass (measured: with two, a 1,220-token prompt's peak was under-predicted by 15 %).
_LM_ATTN_GRADS = 3


def is_vlm(plan: TracePlan) -> bool:
    """Whether ``plan`` traces a generative VLM (its estimate is :func:`vlm_estimate`).

    Example:
        >>> import timm
        >>> is_vlm(TracePlan.for_trace(timm.create_model("vit_tiny_patch16_224", pretrained=False), "top1"))
        False
    """
    return isinstance(plan.adapter, HfVlmAdapter)


@dataclass(frozen=True)
class VlmShape:
    """A VLM answer trace's sizes: the tower (crops, tokens per crop, width, heads, F3 channels, MLP width, blocks),
    the sequence (length, answer tokens, image tokens) and the decoder (layers, width, heads, MLP width, vocabulary).

    Example:
        >>> VlmShape(1, 17, 32, 4, 32, 64, 3, 24, 3, 16, 2, 32, 4, 64, 64, 0).tower_tokens
        17
    """

    crops: int
    tower_tokens: int  # per crop, prefix tokens first
    tower_width: int
    tower_heads: int
    tower_head_width: int  # heads x head_dim: the channels of F3
    tower_hidden: int
    tower_blocks: int
    seq: int  # the prompt and the answer
    answer: int
    image_tokens: int  # the image-token positions the layout keeps (the LM sites' rows in the Dataset)
    lm_layers: int
    lm_width: int
    lm_heads: int
    lm_hidden: int
    vocab: int
    dropped: int  # tokens the projector gives that the layout drops (a class token), still in the pass
    #: the displayed image's size when the input is not one (Qwen2-VL's packed patches): from the patch grid
    image_hw: tuple[int, int] | None = None


def vlm_shape(plan: TracePlan) -> VlmShape:
    """The :class:`VlmShape` of ``plan``; a :class:`TraceError` when its target does not state the sequence.

    Example:
        >>> vlm_shape(plan).image_tokens  # doctest: +SKIP
        16
    """
    model, adapter, target = plan.model, plan.adapter, plan.target
    seq = getattr(target, "sequence", None)
    answer = getattr(target, "answer_positions", None)
    if seq is None or answer is None:
        raise TraceError("model: the memory estimate of a generative VLM needs its answer target "
                         "(vitcam_nb.targets.answer or generated), which states the sequence; this target does not, "
                         "so it is not estimated")
    ids = np.asarray(seq)
    extra = dict(getattr(target, "model_kwargs", None) or {})
    layout = adapter.layout(model, ids, extra)
    fam = vlm_family_of(model)
    crops = len(fam.crop_tiles(model, ids, extra)) if fam.crops and fam.crop_tiles is not None else 1
    tcfg = model.config.text_config
    gh, gw = adapter.tower_grid(model)
    tokens, image_hw = len(adapter.prefix_kinds(model)) + gh * gw, None
    if not gh * gw:
        # A tower whose grid is the image's own (Qwen2-VL: its patches packed, image_grid_thw rows of (t, h, w))
        thw = extra.get("image_grid_thw")
        if thw is None:
            raise TraceError(f"model: the {fam.name} tower's token grid is not fixed by its config and the target's "
                             "model_kwargs do not state it (image_grid_thw); this trace is not estimated")
        rows = np.asarray(thw, dtype=np.int64).reshape(-1, 3)
        tokens = int(np.prod(rows, axis=1).sum())
        patch = int(getattr(adapter.vision_config(model), "patch_size", 1))
        image_hw = (int(rows[0, 1]) * patch, int(rows[0, 2]) * patch)
    # The tower's width and heads under either name a family's vision config gives them (CLIP/SigLIP: hidden_size,
    # num_attention_heads; Qwen2-VL: embed_dim, num_heads, its hidden_size being the LM's)
    vcfg = adapter.vision_config(model)
    width = int(getattr(vcfg, "embed_dim", None) or vcfg.hidden_size)
    heads = int(getattr(vcfg, "num_heads", None) or vcfg.num_attention_heads)
    head_dim = int(getattr(vcfg, "head_dim", None) or width // heads)
    mlp = adapter.blocks(model)[0].get_submodule("mlp")
    first = next((m for name in ("fc1", "gate_proj", "up_proj") if isinstance(m := getattr(mlp, name, None),
                                                                                 torch.nn.Linear)), None)
    hidden = int(first.out_features) if first is not None else 4 * width
    lm_width, lm_heads = int(tcfg.hidden_size), int(tcfg.num_attention_heads)
    return VlmShape(crops=crops, tower_tokens=tokens, tower_width=width,
                    tower_heads=heads, tower_head_width=heads * head_dim,
                    tower_hidden=hidden,
                    tower_blocks=len(adapter.blocks(model)),
                    seq=int(ids.size), answer=int(len(answer)), image_tokens=int(layout.positions.size),
                    lm_layers=len(adapter.lm_layers(model)), lm_width=lm_width, lm_heads=lm_heads,
                    lm_hidden=int(getattr(tcfg, "intermediate_size", 4 * lm_width)), vocab=int(tcfg.vocab_size),
                    dropped=int(sum(layout.dropped.values())), image_hw=image_hw)


def _n_entries(plan: TracePlan) -> int:
    return len(getattr(plan.target, "labels", None) or [None])


def vlm_estimate(plan: TracePlan, hw: tuple[int, int], batch: int = 1) -> dict:
    """:func:`~vitcam_nb.capture.budget_peak.estimate_plan` of a generative VLM's answer trace at input size ``hw``
    (``dataset_bytes``, ``peak_bytes``, ``parts`` per variable, ``tokens`` of the tower, ``targets``,
    ``input_size``, and ``image_tokens`` and ``sequence`` of the LM side).

    Example:
        >>> vlm_estimate(plan, (32, 32))["parts"]["lm_attn"]  # doctest: +SKIP
        1536
    """
    s = vlm_shape(plan)
    hw = s.image_hw or hw
    store = 2 if plan.dtype == "float16" else 4
    compute = torch.finfo(plan.compute_dtype).bits // 8
    k = _n_entries(plan) + 1
    sites, n_traced = plan.site_ids, len(plan.layer_ids)
    # the adapter's extra sites are the LM sites (reading plan.extra_sites finds their modules: slower)
    token_sites = [x for x in sites if x not in (ATTENTION_SITE, SCORES_SITE) and x not in LM_SITES]
    channels = sum(s.tower_head_width if x == "F3" else s.tower_width for x in token_sites)
    t, crops = s.tower_tokens, s.crops
    act = batch * crops * n_traced * t * channels
    attn = batch * crops * n_traced * s.tower_heads * t * t
    n, w = s.image_tokens, s.lm_width
    stored = {"projector": n * w, "lm_resid": s.lm_layers * n * w, "lm_attn": s.lm_layers * s.lm_heads * s.answer * n}
    parts = {"act": act * store, "grad": k * act * store, "attn": 0, "attn_grad": 0}
    if ATTENTION_SITE in sites:
        parts.update(attn=attn * store, attn_grad=k * attn * store)
    if SCORES_SITE in sites:
        parts.update(attn_scores=attn * store, attn_scores_grad=k * attn * store)
    for name, elements in stored.items():
        if name in sites:
            parts.update({name: batch * elements * store, f"{name}_grad": k * batch * elements * store})
    parts["other"] = _coordinates(plan, s, hw, batch, k, len(token_sites))
    dataset = sum(parts.values())
    # The pass captures the LM sites over the whole sequence (the projector's every output token) and keeps them
    # with their gradients until the assembly takes the image-token positions out.
    full = {"projector": (n + s.dropped) * w, "lm_resid": s.lm_layers * s.seq * w,
            "lm_attn": s.lm_layers * s.lm_heads * s.seq * s.seq}
    captured_lm = batch * sum(v for name, v in full.items() if name in sites)
    matrices = sum(x in sites for x in (ATTENTION_SITE, SCORES_SITE))
    captured = act + matrices * attn + captured_lm
    length = s.seq
    tower_block = crops * (t * (_GRAPH_TC * s.tower_width + s.tower_heads * t) + t * s.tower_hidden)
    lm_block = length * (_GRAPH_TC * w + s.lm_heads * length) + _GATED * length * s.lm_hidden
    # The graph starts at the image (sites outside the blocks): every tower block and every decoder layer; the
    # answer rows' logits over the vocabulary (their logsumexp's input).
    graph = batch * (s.tower_blocks * tower_block + s.lm_layers * lm_block + s.answer * s.vocab) * compute
    transient = k * batch * max(crops * (_ATTN_GRADS * s.tower_heads * t * t + t * s.tower_hidden),
                                _LM_ATTN_GRADS * s.lm_heads * length * length + _GATED * length * s.lm_hidden,
                                length * s.vocab) * compute
    logits = batch * length * s.vocab * compute  # the forward's logits at every position, freed once it ends
    fixed = _PEAK_FIXED + parts["other"]
    if writes_arrays(plan):
        # The array pass: at its start, the graph with the forward pass's freed transients between its tensors and
        # the logits; at the end of the backward pass, the tower's Dataset arrays, the LM sites' whole-sequence
        # arrays with their gradients (in the storage dtype), one block's transients and half the graph; then
        # the assembly adds the LM sites' image-token rows beside the whole-sequence arrays.
        start = fixed + _FORWARD_HOLES * graph + transient + logits
        peak = max(start, fixed + dataset + captured_lm * (k + 1) * store + transient + graph / 2)
    else:
        # The tensor pass (a GPU, float32 storage): the captured tensors and their gradients in the compute dtype.
        held = captured * (k + 1) * compute
        peak = fixed + max(graph + captured * compute + transient + logits, held + transient)
    return {"dataset_bytes": int(dataset), "peak_bytes": int(peak), "parts": {x: int(v) for x, v in parts.items()},
            "tokens": t, "targets": k - 1, "input_size": [int(hw[0]), int(hw[1])],
            "image_tokens": n, "sequence": length}


def _coordinates(plan: TracePlan, s: VlmShape, hw: tuple[int, int], batch: int, k: int, n_token_sites: int) -> int:
    """Bytes of the logits, the image and the coordinates: the tower's token axis (index, a five-character kind,
    patch row and column; again for the attention's queries and keys), layer, site, channel and head indices; the
    entries (index and label) and targets; the image-token axis (index, position, tile, row, column), the LM layer
    and head indices and the answer tokens (index, position, string)."""
    labels = list(getattr(plan.target, "labels", None) or [])
    chars = max((len(x) for x in labels), default=0)
    n_labels = len(labels)
    sites = plan.site_ids
    matrices = ATTENTION_SITE in sites or SCORES_SITE in sites
    # A crops family's tower arrays share one token axis (tokens per crop) under their leading ``crop`` dim; its
    # image is each crop as the tower saw it, and each crop has its coordinates (index, tile and group names, box).
    tokens, crop_coords = s.tower_tokens, 0
    if vlm_family_of(plan.model).crops:
        names = plan.adapter.crop_tiles(plan.model, plan.target)
        groups = [t.group_name if t is not None else "" for t in plan.adapter.crop_geometry(plan.model, plan.target)]
        crop_coords = s.crops * (8 + 4 * 8 + 4 * max(map(len, names), default=0) + 4 * max(map(len, groups),
                                                                                         default=0))
    out = batch * (n_labels * 4 + s.crops * hw[0] * hw[1] * 3) + 8 * (hw[0] + hw[1]) + 12 + crop_coords
    out += n_labels * (8 + 4 * chars) + k * (8 + 8 * chars)
    out += (3 if matrices else 1) * tokens * 44 + 8 * len(plan.layer_ids) + 8 * n_token_sites
    out += 8 * s.tower_width if n_token_sites else 0
    out += 8 * s.tower_heads if matrices else 0
    lm = [x for x in ("projector", "lm_resid", "lm_attn") if x in sites]
    if lm:
        out += 5 * 8 * s.image_tokens
    if "lm_resid" in sites or "lm_attn" in sites:
        out += 8 * s.lm_layers
    if "lm_attn" in sites:
        tokens_chars = max((len(x) for x in labels[:s.answer]), default=1)
        out += 8 * s.lm_heads + s.answer * (16 + 4 * tokens_chars)
    return out
