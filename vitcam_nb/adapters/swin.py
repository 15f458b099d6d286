"""Adapter for timm's hierarchical Swin Transformers (V1 and V2): NHWC token grids, (shifted) window
attention, patch merging between stages.

Blocks are numbered globally across stages (``layer``) and also addressed as ``"stage.block"``. Token sites
are stored in raster order of their stage's grid: windowed tensors (F3, attn_out) are put back from
windows to the raster grid with the shift undone; F2 stays per window (a dense token x token matrix would
be mostly zeros and too large at the first stage), each query row holding its window's keys, with a
``attn_window_key`` coordinate naming each key's raster token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from vitcam_nb.adapters.base import Adapter, SiteSpec, TraceContext
from vitcam_nb.adapters.registry import declare_family

__all__ = ["NHWC", "POST_NORM_MISSING", "SWIN_SITES", "SwinAdapter", "WINDOWED", "window_tokens"]

SWIN_SITES: dict[str, SiteSpec] = {
    "F1": SiteSpec("norm1", "output", "LayerNorm output before window attention"),
    "F2": SiteSpec("attn.attn_drop", "output", "softmax window attention per head"),
    "F3": SiteSpec("attn.proj", "input", "window attention output, heads concatenated, before the projection"),
    "F4": SiteSpec("norm2", "output", "LayerNorm output before the MLP"),
    "F5": SiteSpec("mlp", "output", "MLP output"),
    "F6": SiteSpec("", "output", "residual stream after the MLP (block output)"),
    "resid_pre": SiteSpec("", "input", "residual stream entering the block"),
    "attn_out": SiteSpec("attn", "output", "window attention output after the projection"),
    "resid_mid": SiteSpec("norm2", "input", "residual stream after the attention residual"),
}
# In a post-norm V2 block the MLP reads the residual stream itself (norm2 comes after the MLP).
V2_RESID_MID = SiteSpec("mlp", "input", "residual stream after the attention residual (the MLP's input)")
# Swin V2 blocks are post-norm (x + norm1(attn(x)), x + norm2(mlp(x))): no LayerNorm feeds attention or MLP.
POST_NORM_MISSING = ("F1", "F4")
WINDOWED = ("F2", "F3", "attn_out")
NHWC = ("F1", "F6", "resid_pre")


def window_tokens(height: int, width: int, window: tuple[int, int], shift: tuple[int, int],
                  pad_first: bool = False) -> np.ndarray:
    """Raster token index at each (window, position) of a shifted-window block; -1 marks padding.

    Applies the block's own steps (cyclic shift by ``-shift``, padding to a window multiple, window
    partition) to the token indices, so reading a windowed tensor through it undoes the shift. timm shifts
    and then pads; Hugging Face's Swin layers pad and then shift the padded grid (``pad_first=True``).

    Example:
        >>> window_tokens(2, 4, (2, 2), (0, 0))
        array([[0, 1, 4, 5],
               [2, 3, 6, 7]])
    """
    idx = torch.arange(height * width).view(1, height, width, 1)
    pad_h = (window[0] - height % window[0]) % window[0]
    pad_w = (window[1] - width % window[1]) % window[1]
    if pad_first:
        idx = torch.nn.functional.pad(idx, (0, 0, 0, pad_w, 0, pad_h), value=-1)
    if any(shift):
        idx = torch.roll(idx, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    if not pad_first:
        idx = torch.nn.functional.pad(idx, (0, 0, 0, pad_w, 0, pad_h), value=-1)
    hp, wp = height + pad_h, width + pad_w
    windows = idx.view(hp // window[0], window[0], wp // window[1], window[1]).permute(0, 2, 1, 3)
    return windows.reshape(-1, window[0] * window[1]).numpy()


@declare_family(priority=110)
class SwinAdapter(Adapter):
    """timm ``SwinTransformer`` and ``SwinTransformerV2``.

    Example:
        >>> import timm
        >>> m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False)
        >>> SwinAdapter().stages(m)[:2]
        [[0, 1], [2, 3]]
    """

    family = "swin"
    block_template = "layers.{stage}.blocks.{block}"
    sites = SWIN_SITES
    hierarchical = True
    recomputable = True
    #: Sites captured as (..., H, W, C) grids, flattened to raster tokens (timm blocks work on NHWC tensors).
    grid_sites: tuple[str, ...] = NHWC

    def matches(self, model: torch.nn.Module) -> bool:
        from timm.models.swin_transformer import SwinTransformer
        from timm.models.swin_transformer_v2 import SwinTransformerV2

        return isinstance(model, (SwinTransformer, SwinTransformerV2))

    def is_v2(self, model: torch.nn.Module) -> bool:
        from timm.models.swin_transformer_v2 import SwinTransformerV2

        return isinstance(model, SwinTransformerV2)

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [blk for stage in model.layers for blk in stage.blocks]

    def stages(self, model: torch.nn.Module) -> list[list[int]]:
        """Global block indices of each stage."""
        out, start = [], 0
        for stage in model.layers:
            out.append(list(range(start, start + len(stage.blocks))))
            start += len(stage.blocks)
        return out

    def site_table(self, model: torch.nn.Module) -> dict[str, SiteSpec]:
        if self.is_v2(model):
            table = {k: v for k, v in self.sites.items() if k not in POST_NORM_MISSING}
            return {**table, "resid_mid": V2_RESID_MID}
        return dict(self.sites)

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        return []

    def grid_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.patch_embed

    def grid_from_output(self, model: torch.nn.Module, output: torch.Tensor) -> tuple[int, int]:
        return int(output.shape[1]), int(output.shape[2])

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [blk.attn for blk in self.blocks(model)]

    @contextlib.contextmanager
    def tracing(self, ctx: TraceContext) -> Iterator[None]:
        """Record the (H, W) token grid entering each global block into ``ctx.facts["grid"]``.

        Example:
            >>> import timm, torch
            >>> m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1, 1, 1))
            >>> ctx = TraceContext(m)
            >>> with SwinAdapter().tracing(ctx):
            ...     _ = m(torch.zeros(1, 3, 224, 224))
            >>> ctx.facts["grid"][0], ctx.facts["grid"][3]
            ((56, 56), (7, 7))
        """
        grids: dict[int, tuple[int, int]] = {}
        ctx.facts["grid"] = grids
        handles = []
        for layer, blk in enumerate(self.blocks(ctx.model)):
            def record(_m, args, layer=layer):
                grids[layer] = (int(args[0].shape[1]), int(args[0].shape[2]))
            handles.append(blk.register_forward_pre_hook(record))
        try:
            with self.patched(ctx.model):
                yield
        finally:
            for h in handles:
                h.remove()

    def grid_of(self, ctx: TraceContext, layer: int) -> tuple[int, int]:
        """The (H, W) token grid entering global block ``layer`` in this trace."""
        return ctx.facts["grid"][layer]

    def window_layout(self, ctx: TraceContext, layer: int) -> np.ndarray:
        """:func:`window_tokens` of global block ``layer`` at this trace's grid."""
        blk = self.blocks(ctx.model)[layer]
        h, w = self.grid_of(ctx, layer)
        return window_tokens(h, w, tuple(blk.window_size), tuple(blk.shift_size))

    def arrange_traced(self, ctx: TraceContext, site: str, layer: int, tensor: torch.Tensor) -> torch.Tensor:
        """Token sites in raster order of the stage grid: NHWC flattened, windows put back, shift undone. The
        leading dimensions (batch; targets, batch) are kept: windows of one image are contiguous."""
        h, w = self.grid_of(ctx, layer)
        if site in self.grid_sites:
            return tensor.reshape(*tensor.shape[:-3], h * w, tensor.shape[-1])
        if site not in WINDOWED:
            return tensor
        layout = torch.as_tensor(self.window_layout(ctx, layer), device=tensor.device)
        n_windows, area = layout.shape
        valid = layout.reshape(-1) >= 0
        where = torch.argsort(layout.reshape(-1)[valid])  # raster token t sits at windowed position where[t]
        positions = torch.nonzero(valid).reshape(-1)[where]
        if site == "F2":  # (..., batch * windows, head, area, area) -> (..., batch, head, query, window key)
            lead, heads = tensor.shape[:-4], tensor.shape[-3]
            x = tensor.reshape(*lead, -1, n_windows, heads, area, area).transpose(-4, -3)
            return x.reshape(*x.shape[:-3], n_windows * area, area)[..., positions, :]
        x = tensor.reshape(*tensor.shape[:-3], -1, n_windows * area, tensor.shape[-1])
        return x[..., positions, :]

    def window_keys(self, ctx: TraceContext, layer: int) -> np.ndarray:
        """(token, window position) -> raster token of that key (-1 = padding), for F2 of block ``layer``."""
        layout = self.window_layout(ctx, layer)
        flat = layout.reshape(-1)
        window_of = np.empty(int(flat.max()) + 1, np.int64)
        window_of[flat[flat >= 0]] = np.nonzero(flat >= 0)[0] // layout.shape[1]
        return layout[window_of]

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        blk = self.blocks(model)[0]
        patch = model.patch_embed.patch_size
        return {
            "num_heads": int(blk.attn.num_heads),
            "head_dim": int(blk.attn.qkv.out_features // 3 // blk.attn.num_heads),
            "embed_dim": int(model.embed_dim),
            "global_pool": str(model.global_pool or "none"),
            "patch_size": int(patch[0]) if patch[0] == patch[1] else f"{patch[0]}x{patch[1]}",
            "window_size": "x".join(str(int(v)) for v in blk.window_size),
            "swin_version": 2 if self.is_v2(model) else 1,
            "num_stages": len(model.layers),
            "position_encoding": "continuous relative position bias" if self.is_v2(model)
            else "relative position bias",
        }
