"""The memory of a trace before it is run, from the model's config, sites, layers, targets, dtype and the pass's memory
mode (``TracePlan.recompute``, ``TracePlan.target_groups``): the arithmetic :mod:`vitcam_nb.capture.budget` chooses
the mode and checks the budget with.

The Dataset size is exact arithmetic over the schema (``act``, ``grad``, ``attn``, ``attn_grad``, logits, image and
coordinates). The peak follows from how the pass holds memory (parameters frozen, freed memory handed back as it
goes: :mod:`vitcam_nb.capture.runtime`; the graph starts at the lowest traced layer:
:mod:`vitcam_nb.capture.graph_start`, so only the blocks from there up count): after the forward pass, autograd's
graph (per block, with parameters frozen, about six token-by-channel tensors, the MLP's hidden input and the softmax
attention) plus the captured tensors; at the end of the batched backward, every captured tensor and its gradients in
the compute dtype; in between, the backward's transients (two attention-map and one MLP-hidden gradient per target);
the assembly then frees each tensor as it copies it, so it never holds more. The peak is the larger of the two plus
the transients and a fixed 20 MB (the tensor pass, which a GPU with float32 storage runs). On the CPU, and with
storage narrower than the computation (float16), the pass writes into the Dataset's arrays as it goes
(:mod:`vitcam_nb.capture.prealloc`): at the end, the Dataset, one block's transients and half the graph; at the
start of the backward pass, the graph with the forward pass's freed transients between its tensors. A pass that
recomputes each block holds the Dataset, every graphed block's input, one block's graph and one target's
transients instead of all the targets' (the blocks go back one target at a time).
``benchmarks/memsizes.py`` measures the peak for twelve cases and ``tests/integration/test_reliability_memory.py``
checks the estimate against those measurements.

The shapes come from :mod:`vitcam_nb.capture.budget_shapes`: flat token layouts (ViT, DeiT, DINOv2, BEiT, EVA);
hierarchical Swin (timm V1/V2, Hugging Face Swin/Swinv2), summed per block over its stage's grid, with F2 stored
per window (``attn_window``, its gradients and the int64 ``attn_window_key``; the pass holds the padded windows,
and putting a windowed site back in raster order copies it while the windowed original is still held); BLIP, the
vision tower plus the text encoder and the cross-attention ``xattn`` over the text the target names
(:func:`vitcam_nb.targets.itm`); the video families (VideoMAE, ViViT, TimeSformer), one clip's (t, y, x) token
grid with its frames and TimeSformer's ``attn_time`` and ``attn_space``; a generative VLM's answer trace (every
registered family) from :mod:`vitcam_nb.capture.budget_vlm`. Any other model, a BLIP target that does not state its
text, or a VLM target that does not state its sequence, is not estimated (:func:`estimate_plan` raises).

Example:
    >>> import timm
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    >>> e = estimate_plan(TracePlan.for_trace(m, "top1", sites=["F1"], layers=[-1]), (224, 224))
    >>> e["parts"]["act"], e["parts"]["grad"]  # 1 layer x 1 site x 197 tokens x 192 channels x 4 bytes
    (151296, 302592)
"""

from __future__ import annotations

import numpy as np
import torch

from vitcam_nb.adapters.swin import WINDOWED
from vitcam_nb.capture.budget_shapes import BlockShape, Shapes, TextShape, model_shapes
from vitcam_nb.capture.budget_vlm import is_vlm, vlm_estimate
from vitcam_nb.capture.plan import TracePlan, group_bounds
from vitcam_nb.capture.prealloc import writes_arrays
from vitcam_nb.capture.rules import rule_extra_names
from vitcam_nb.core.schema import ATTENTION_SITE, SCORES_SITE
from vitcam_nb.targets.classes import ClassTargets

__all__ = ["estimate_plan", "n_targets"]

# Beyond the tensors the arithmetic counts: the pass's own small allocations (hooks, coordinates, xarray).
_PEAK_FIXED = 20e6
# The array pass's heap after the forward pass, as a multiple of the graph (its freed transients between the graph's
# tensors): see estimate_plan.
_FORWARD_HOLES = 1.6
# The array pass's resident memory beyond the Dataset, the blocks' inputs and one block's graph when it recomputes
# each block, as a multiple of one target's transients in one block, since the blocks go back one target at a time
# (see estimate_plan).
_ONE_TARGET_HOLES = 0.5
# Token x channel tensors autograd keeps per block with parameters frozen: the qkv output (3), the scaled
# queries (1) and both LayerNorm inputs (2).
_GRAPH_TC = 6
# Attention-map gradients per target alive at once in a block's batched backward: the softmax's backward holds
# the gradient it receives and the one it returns. Counting one under-predicted the measured peak by 8-16 %
# where attention dominates (ViT-Ti at 640 px, DINOv2-S with registers at 322 px, 4-block ViT-B and BEiT).
_ATTN_GRADS = 2


def n_targets(plan: TracePlan) -> int:
    """How many targets ``plan`` differentiates (its backward pass has one output more: the expected logit under
    the softmax, the trace's last target).

    Example:
        >>> import timm
        >>> n_targets(TracePlan.for_trace(timm.create_model("vit_tiny_patch16_224", pretrained=False), "top5"))
        5
    """
    target = plan.target
    if isinstance(target, ClassTargets):
        return target.k if target.k is not None else len(target.classes or [])
    return len(getattr(target, "labels", None) or [None])


def estimate_plan(plan: TracePlan, hw: tuple[int, int], batch: int = 1) -> dict:
    """:func:`estimate` of a resolved plan at input size ``hw`` (``batch`` images in one pass).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> estimate_plan(TracePlan.for_trace(m, "top1", sites=["F2"], layers=[0]), (224, 224))["parts"]["attn"]
        465708
    """
    if is_vlm(plan):  # a generative VLM's answer: the tower, and the LM sites at the image tokens (budget_vlm)
        return vlm_estimate(plan, hw, batch)
    shapes = model_shapes(plan, hw)
    store = 2 if plan.dtype == "float16" else 4
    compute = torch.finfo(plan.compute_dtype).bits // 8
    k = n_targets(plan) + 1
    traced = [shapes.blocks[i] for i in plan.layer_ids]
    sites = plan.site_ids
    token_sites = [s for s in sites if s not in (ATTENTION_SITE, SCORES_SITE) and s not in plan.extra_layers]
    matrices = sum(s in sites for s in (ATTENTION_SITE, SCORES_SITE))  # (head, query, key) sites

    def channels(b: BlockShape) -> int:
        return sum(b.head_width if s == "F3" else b.width for s in token_sites)

    act = batch * sum(b.tokens * channels(b) for b in traced) * store
    attn = batch * sum(b.heads * b.tokens * b.keys for b in traced) * store
    # The pass holds the windows padded to a window multiple; the Dataset only the raster tokens.
    attn_pass = batch * sum(b.heads * b.rows * b.keys for b in traced) * store
    parts = {"act": act, "grad": k * act, "attn": 0, "attn_grad": 0}
    if shapes.windowed and ATTENTION_SITE in sites:
        parts.update(attn_window=attn, attn_window_grad=k * attn,
                     attn_window_key=sum(b.tokens * b.keys for b in traced) * 8)
    elif ATTENTION_SITE in sites:
        parts.update(attn=attn, attn_grad=k * attn)
        parts.update({name: k * attn for name in rule_extra_names(plan.rule, plan.adapter)})  # chefer_lrp's dA
    if SCORES_SITE in sites:
        parts.update(attn_scores=attn, attn_scores_grad=k * attn)
    extra = batch * sum(shapes.site_elements.values()) * store  # TimeSformer's attn_time, attn_space
    for name, n in shapes.site_elements.items():
        parts.update({name: batch * n * store, f"{name}_grad": k * batch * n * store})
    text = shapes.text
    xattn = 0
    if text is not None and "xattn" in sites:
        xattn = batch * text.xattn_layers * text.xattn_heads * text.tokens * text.keys * store
        parts.update(xattn=xattn, xattn_grad=k * xattn)
    parts["other"] = _coordinates(plan, shapes, hw, batch, k, token_sites)
    dataset = sum(parts.values())
    captured = act + matrices * attn_pass + xattn + extra  # in the store dtype, as the pass captures them
    # Only the blocks from the lowest traced layer up have a graph (capture.graph_start).
    graphed = shapes.blocks[plan.graph_start:]
    graph = batch * (sum(b.rows * (_GRAPH_TC * b.width + b.heads * b.keys) + b.tokens * b.hidden
                         for b in graphed) + shapes.extra_graph + _text_graph(text)) * compute
    transient = k * batch * max(_ATTN_GRADS * b.heads * b.rows * b.keys + b.tokens * b.hidden
                                for b in graphed) * compute
    held = captured * (k + 1) * compute / store  # captured tensors and their gradients, in the compute dtype
    # The backward's transients come on top of the graph (released only once the backward is done) and of the
    # held tensors. After the backward, a windowed site (Swin's F2, F3, attn_out) is put back in raster order
    # into a copy while the pass still holds its windowed original and gradients: that copy replaces them.
    copy = (k + 1) * batch * _windowed_elements(shapes, traced, sites) * compute
    peak = _PEAK_FIXED + parts["other"] + max(graph + captured * compute / store + transient,
                                              held + max(transient, copy))
    if writes_arrays(plan):
        # The array pass (the CPU, or narrower storage) never holds the gradients twice, and hands freed memory back
        # when it has added more than its cap (capture.resident). At the end of the backward pass, beside the Dataset:
        # one block's transients and the part of the graph still alive, half of it on average as the backward pass frees
        # it block by block (fitted to the ViT-B/16 and ViT-S/16 float16 rows measured in this pass; the float32 rows
        # and ViT-Ti/16 held out). At its start: the graph (which holds most captured tensors) and the first transients,
        # plus the forward pass's freed transients, which stay in the heap between the graph's tensors since nothing is
        # handed back during the forward pass (_FORWARD_HOLES, fitted to the one-layer, one-site ViT-B/16 row, where
        # that start is the peak; both ViT-S/16 rows held out; Swin leaves fewer, and is overestimated there). Windowed
        # sites go into their arrays one block at a time: no copy of them all.
        start = _PEAK_FIXED + parts["other"] + _FORWARD_HOLES * graph + transient
        peak = max(start, dataset + transient + graph / 2)
        if plan.recompute:
            # Recomputing each block in the backward pass (capture.block_major): the forward pass keeps only each
            # graphed block's input, the backward pass one block's graph at a time beside the Dataset, whose values
            # are written when the forward pass ends, and one target's transients, since the blocks go back one
            # target at a time. Without the graph's tensors between them, the transients fragment the heap: some
            # of them stay resident (_ONE_TARGET_HOLES: the recomputing rows of benchmarks/MEMORY.json, whose base
            # alone is within a tenth).
            inputs = batch * sum(b.rows * b.width for b in graphed) * compute
            block = batch * max(b.rows * (_GRAPH_TC * b.width + b.heads * b.keys) + b.tokens * b.hidden
                                for b in graphed) * compute
            holes = _ONE_TARGET_HOLES * transient / k
            # The head's batched backward holds its group's gradients at the top block's output: all the targets'
            # in one group, two or three in groups (plan.target_groups).
            top = graphed[-1]
            largest = int(np.diff(group_bounds(k, plan.target_groups)).max())
            head = largest * batch * top.rows * top.width * compute
            peak = _PEAK_FIXED + parts["other"] + dataset + inputs + block + holes + head
    tokens = [b.tokens for b in shapes.blocks]
    return {"dataset_bytes": int(dataset), "peak_bytes": int(peak),
            "parts": {n: int(v) for n, v in parts.items()},
            "tokens": tokens[0] if len(set(tokens)) == 1 else [g[0] * g[1] for g in shapes.grids],
            "targets": k - 1, "input_size": [int(hw[0]), int(hw[1])]}


def _windowed_elements(shapes: Shapes, traced: list[BlockShape], sites: list[str]) -> int:
    """Elements of one image's windowed sites as the blocks compute them (padded windows)."""
    if not shapes.windowed:
        return 0
    per_site = {ATTENTION_SITE: lambda b: b.heads * b.rows * b.keys, "F3": lambda b: b.rows * b.head_width,
                "attn_out": lambda b: b.rows * b.width}
    return sum(per_site[s](b) for s in sites if s in WINDOWED for b in traced)


def _text_graph(text: TextShape | None) -> int:
    """Elements autograd keeps in the text encoder: per layer, the self-attention as in a vision block, the
    cross-attention's queries, keys and values over the vision tokens with its probabilities, the MLP."""
    if text is None:
        return 0
    n = text.tokens
    per_layer = (_GRAPH_TC * n * text.width + text.heads * n * n + n * text.hidden
                 + 4 * n * text.width + 2 * text.keys * text.width)
    return text.layers * per_layer + text.xattn_layers * text.xattn_heads * n * text.keys


def _coordinates(plan: TracePlan, shapes: Shapes, hw: tuple[int, int], batch: int, k: int,
                 token_sites: list[str]) -> int:
    """Bytes of the logits, the image and the coordinates: each token axis carries an index, a kind (4-byte
    unicode, five characters) and a patch row and column; y and x index the image; classes carry an index and a
    label; a Swin stage is a Dataset of its own with its token axis."""
    labels = plan.class_labels or getattr(plan.target, "labels", None) or []
    n_classes = int(getattr(plan.model, "num_classes", 0) or 0) or len(labels)
    blocks = [shapes.blocks[i] for i in plan.layer_ids]
    heads = max(b.heads for b in blocks)
    out = (batch * (n_classes * 4 + shapes.frames * hw[0] * hw[1] * 3) + 8 * (hw[0] + hw[1]) + n_classes * 8
           + k * 128 + len(labels) * 4 * max((len(s) for s in labels), default=0) + shapes.coords)
    matrices = ATTENTION_SITE in plan.site_ids or SCORES_SITE in plan.site_ids
    if not shapes.windowed:
        tokens = blocks[0].tokens
        out += (3 if matrices else 1) * tokens * 44 + 8 * (len(blocks) + heads)
    else:
        for stage in sorted({b.stage for b in blocks}):
            members = [b for b in blocks if b.stage == stage]
            b = members[0]
            out += 8 * len(members) + b.tokens * 44 + (8 * b.width if token_sites else 0)
            # nbytes counts again in every stage the root's index coordinates it inherits (class, y, x, rgb, target)
            out += 8 * (n_classes + hw[0] + hw[1]) + 12 + 56 * k
            if ATTENTION_SITE in plan.site_ids:  # head, query and window-key indices
                out += 8 * (b.heads + b.tokens + b.keys)
    text = shapes.text
    if text is not None and "xattn" in plan.site_ids:
        # xattn layer, head, text token (index, string, mask) and, when F2 did not write them, the key axis
        out += (8 * (text.xattn_layers + text.xattn_heads) + text.tokens * (16 + 4 * text.token_chars)
                + (0 if matrices else 44 * text.keys))
    return out
