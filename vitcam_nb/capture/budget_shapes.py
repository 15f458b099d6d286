"""The shapes a trace's memory estimate (:mod:`vitcam_nb.capture.budget`) is made of, read from the model's
modules and config before any forward pass: per block, the tokens it stores and the rows its attention holds in
the pass, its width, heads and MLP width; for a cross-attention model, the text side.

Four layouts: flat (ViT, DeiT, DINOv2, BEiT, EVA: one token grid, every query attends to every token),
hierarchical (timm and Hugging Face Swin: a grid per stage, halved by each patch merging, attention per window,
the grid padded to a window multiple in the pass and stored per raster token with the window's keys) and
cross-attention (BLIP: a flat vision tower plus the text encoder, whose cross-attention ``xattn`` has the text
tokens as queries over the vision tokens as keys) and video (Hugging Face VideoMAE, ViViT, TimeSformer: one clip's
(t, y, x) token grid after the prefix tokens; TimeSformer's ``attn_time`` and ``attn_space`` matrices).

Example:
    >>> import timm
    >>> from vitcam_nb.capture.plan import TracePlan
    >>> m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1), num_heads=(2, 4),
    ...                       embed_dim=16, img_size=56, window_size=7)
    >>> s = model_shapes(TracePlan.for_trace(m, "top1"), (56, 56))
    >>> [(b.tokens, b.keys, b.width) for b in s.blocks]
    [(196, 49, 16), (49, 49, 32)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vitcam_nb.adapters.blip import BlipAdapter
from vitcam_nb.adapters.hf_swin import HfSwinAdapter
from vitcam_nb.adapters.hf_video import HfTimesformerAdapter
from vitcam_nb.adapters.swin import SwinAdapter
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.schema import ATTENTION_SITE, SCORES_SITE

__all__ = ["BlockShape", "Shapes", "TextShape", "model_shapes"]


@dataclass(frozen=True)
class BlockShape:
    """One block as the trace sees it.

    Example:
        >>> BlockShape(tokens=197, width=192, heads=3, head_width=192, hidden=768, keys=197, rows=197).keys
        197
    """

    tokens: int  # tokens stored per site (raster order; prefix tokens first)
    width: int  # residual channels
    heads: int
    head_width: int  # heads x head_dim: the channels of F3
    hidden: int  # the MLP's hidden width
    keys: int  # attention keys per query as stored: every token (flat) or the window's area (Swin)
    rows: int  # attention query rows in the pass: the tokens, or the padded windows' tokens (Swin)
    stage: int = 0


@dataclass(frozen=True)
class TextShape:
    """The text encoder of a cross-attention model for one text.

    Example:
        >>> TextShape(tokens=8, width=32, heads=2, hidden=64, layers=2, xattn_layers=2, xattn_heads=2, keys=17).keys
        17
    """

    tokens: int
    width: int
    heads: int
    hidden: int
    layers: int
    xattn_layers: int  # layers with a traceable cross-attention (the ``xattn`` site)
    xattn_heads: int
    keys: int  # vision tokens each text token attends to
    token_chars: int = 0  # longest token string (the ``text_token_str`` coordinate)


@dataclass
class Shapes:
    """Every block of the model (traced or not: all of them are in the forward graph), the prefix tokens,
    whether attention is stored per window, the text side and graph elements outside the blocks.

    Example:
        >>> Shapes(blocks=[], prefix=1).windowed
        False
    """

    blocks: list[BlockShape]
    prefix: int
    windowed: bool = False
    text: TextShape | None = None
    grids: list[tuple[int, int]] = field(default_factory=list)  # (h, w) of each stage
    # Elements autograd keeps outside the blocks (the patch mergings' LayerNorm inputs; TimeSformer's temporal
    # attention, which the per-block formula does not count).
    extra_graph: int = 0
    frames: int = 1  # frames of the input: a clip's display copy holds every frame (video families)
    # Per input, the elements of each matrix an extra site stores over every block (TimeSformer's attn_time and
    # attn_space are captured in all blocks, whichever layers are traced).
    site_elements: dict[str, int] = field(default_factory=dict)
    coords: int = 0  # bytes of coordinates beyond an image trace's (a clip's frame axis, patch_frame, ...)


def _hidden(block: torch.nn.Module, width: int) -> int:
    for path in ("mlp.fc1", "intermediate.dense"):
        try:
            return int(block.get_submodule(path).out_features)
        except AttributeError:
            continue
    return 4 * width


def _flat(plan: TracePlan, hw: tuple[int, int]) -> Shapes:
    model, adapter = plan.model, plan.adapter
    facts = adapter.describe(model)
    pe = getattr(model, "patch_embed", None)
    if pe is None or "embed_dim" not in facts or "num_heads" not in facts or plan.extra_layers:
        raise TraceError(f"model: the memory estimate covers timm's flat token layouts (ViT, DeiT, DINOv2, BEiT, "
                         "EVA), timm and Hugging Face Swin, BLIP with an image-text target and the Hugging Face "
                         f"video families (VideoMAE, ViViT, TimeSformer); this {adapter.family} model is not estimated")
    ph, pw = (int(v) for v in pe.patch_size)
    rounding = math.ceil if getattr(pe, "dynamic_img_pad", False) else math.floor
    tokens = len(adapter.prefix_kinds(model)) + rounding(hw[0] / ph) * rounding(hw[1] / pw)
    width, heads = int(facts["embed_dim"]), int(facts["num_heads"])
    head_width = heads * int(facts.get("head_dim", width // heads))
    blocks = adapter.blocks(model)
    hidden = _hidden(blocks[0], width)
    one = BlockShape(tokens=tokens, width=width, heads=heads, head_width=head_width, hidden=hidden, keys=tokens,
                     rows=tokens)
    return Shapes(blocks=[one] * len(blocks), prefix=len(adapter.prefix_kinds(model)))


def _swin(plan: TracePlan, hw: tuple[int, int]) -> Shapes:
    model, adapter = plan.model, plan.adapter
    hf = isinstance(adapter, HfSwinAdapter)
    if hf:
        patch = int(adapter.vision_config(model).patch_size)  # a UperNet's own config is its head's
        # Hugging Face pads the image to a patch multiple; a stage's patch merging comes at its end.
        h, w = math.ceil(hw[0] / patch), math.ceil(hw[1] / patch)
        stages = list(adapter.backbone(model).encoder.layers)
        merge_before = [False] + [stage.downsample is not None for stage in stages[:-1]]
    else:
        pe = model.patch_embed
        ph, pw = (int(v) for v in pe.patch_size)
        rounding = math.ceil if getattr(pe, "dynamic_img_pad", False) else math.floor
        h, w = rounding(hw[0] / ph), rounding(hw[1] / pw)
        stages = list(model.layers)
        merge_before = [not isinstance(stage.downsample, torch.nn.Identity) for stage in stages]
    blocks, grids, extra = [], [], 0
    layer = 0
    for s, stage in enumerate(stages):
        if merge_before[s]:
            # The merging pads to an even grid and normalises 2x2 patches: its LayerNorm keeps the padded grid.
            extra += (h + h % 2) * (w + w % 2) * blocks[-1].width
            h, w = math.ceil(h / 2), math.ceil(w / 2)
        grids.append((h, w))
        for blk in stage.blocks:
            facts = adapter.block_facts(model, layer)
            if not hf:
                wh, ww = (int(v) for v in blk.window_size)
            elif adapter.is_v2(model) or adapter.pads_windows:
                wh = ww = int(blk.window_size)
            else:  # a Swin V1 layer clamps its window to the grid when the grid is not larger (set at run time)
                wh = ww = min(h, w) if min(h, w) <= int(blk.window_size) else int(blk.window_size)
            rows = math.ceil(h / wh) * wh * math.ceil(w / ww) * ww
            width = int(facts["stage_dim"])
            blocks.append(BlockShape(tokens=h * w, width=width, heads=int(facts["num_heads"]),
                                     head_width=int(facts["num_heads"]) * int(facts["head_dim"]),
                                     hidden=_hidden(blk, width), keys=wh * ww, rows=rows, stage=s))
            layer += 1
    return Shapes(blocks=blocks, prefix=0, windowed=True, grids=grids, extra_graph=extra)


def _blip(plan: TracePlan) -> Shapes:
    model, adapter, target = plan.model, plan.adapter, plan.target
    ids = getattr(target, "input_ids", None)
    if ids is None:
        raise TraceError("model: the memory estimate of a BLIP model needs the text its target feeds the text "
                         "encoder (vitcam_nb.targets.itm); this target does not state it, so it is not estimated")
    vcfg, tcfg = model.config.vision_config, model.config.text_config
    gh, gw = adapter.expected_grid(model)  # any other input size is refused by the pass
    tokens = 1 + gh * gw
    width, heads = int(vcfg.hidden_size), int(vcfg.num_attention_heads)
    one = BlockShape(tokens=tokens, width=width, heads=heads, head_width=width, hidden=int(vcfg.intermediate_size),
                     keys=tokens, rows=tokens)
    xattn = plan.extra_sites.get("xattn", [])
    names = getattr(target, "tokens", None) or []
    text = TextShape(tokens=len(ids), width=int(tcfg.hidden_size), heads=int(tcfg.num_attention_heads),
                     hidden=int(tcfg.intermediate_size), layers=len(model.text_encoder.encoder.layer),
                     xattn_layers=len(xattn), xattn_heads=int(tcfg.num_attention_heads), keys=tokens,
                     token_chars=max((len(str(n)) for n in names), default=0))
    return Shapes(blocks=[one] * len(adapter.blocks(model)), prefix=1, text=text, grids=[(gh, gw)])


def _video(plan: TracePlan, hw: tuple[int, int]) -> Shapes:
    """A video family's clip: every block on the (t, y, x) token grid after the prefix tokens; TimeSformer's
    temporal (each patch position over the frames) and spatial (each frame's patches and a class-token copy)
    attention matrices."""
    model, adapter = plan.model, plan.adapter
    cfg = model.config
    frames = adapter.frames(model)
    tt, ph, pw = adapter.tubelet(model)
    gt, gh, gw = frames // tt, hw[0] // ph, hw[1] // pw
    prefix = len(adapter.prefix_kinds(model))
    tokens = prefix + gt * gh * gw
    facts = adapter.describe(model)
    width, heads = int(facts["embed_dim"]), int(facts["num_heads"])
    n_blocks = len(adapter.blocks(model))
    matrices = ATTENTION_SITE in plan.site_ids or SCORES_SITE in plan.site_ids
    # the frame axis, and patch_frame beside patch_row and patch_col (also query_ and key_patch_frame)
    coords = 8 * frames + (3 if matrices else 1) * 8 * tokens
    keys, extra, elements = tokens, 0, {}
    if isinstance(adapter, HfTimesformerAdapter):
        n = 1 + gh * gw  # a frame's sequence in the spatial attention: its class-token copy and its patches
        elements = {"attn_time": n_blocks * gh * gw * heads * frames * frames,
                    "attn_space": n_blocks * frames * heads * n * n}
        # no F2: the per-block formula's attention is both attentions' keys per query, averaged over the tokens
        keys = math.ceil(sum(elements.values()) / (n_blocks * heads * tokens))
        extra = n_blocks * tokens * 4 * width  # the temporal attention's qkv output and its LayerNorm input
        site_coords = {"attn_time": 8 * (n_blocks + gh + gw + 2 * frames),
                       "attn_space": 8 * (n_blocks + frames) + 2 * n * (8 + 20)}  # index and 5-char kind
        coords += sum(v for k, v in site_coords.items() if k in plan.site_ids)
    one = BlockShape(tokens=tokens, width=width, heads=heads, head_width=heads * int(facts["head_dim"]),
                     hidden=int(cfg.intermediate_size), keys=keys, rows=tokens)
    return Shapes(blocks=[one] * n_blocks, prefix=prefix, extra_graph=extra, frames=frames,
                  site_elements={k: v for k, v in elements.items() if k in plan.site_ids}, coords=coords)


def model_shapes(plan: TracePlan, hw: tuple[int, int]) -> Shapes:
    """The :class:`Shapes` of ``plan``'s model at input size ``hw``; a :class:`TraceError` for a model whose
    layout the estimate does not cover.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> s = model_shapes(TracePlan.for_trace(m, "top1"), (224, 224))
        >>> len(s.blocks), s.blocks[0].tokens, s.blocks[0].hidden
        (12, 197, 768)
    """
    if isinstance(plan.adapter, SwinAdapter):
        return _swin(plan, hw)
    if isinstance(plan.adapter, BlipAdapter):
        return _blip(plan)
    if getattr(plan.adapter, "video", False):
        return _video(plan, hw)
    return _flat(plan, hw)
