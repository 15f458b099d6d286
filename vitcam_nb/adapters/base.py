"""The adapter interface: a site table (site -> module path and input/output), a token layout, and the
per-trace context an adapter records facts of one trace into.

Example:
    >>> SiteSpec("norm1", "output").hook("blocks.{layer}")
    'blocks.{layer}.norm1:output'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["Adapter", "SiteSpec", "TraceContext"]


@dataclass(frozen=True)
class SiteSpec:
    """Where a site is read inside block ``l``: ``module`` is a path relative to the block ("" = the block
    itself) and ``io`` says whether its ``input`` (first positional argument), ``output`` (the first element of a
    tuple output) or ``output[i]`` (element ``i`` of a tuple output) is read.

    Example:
        >>> SiteSpec("norm1", "output").hook("blocks.{layer}")
        'blocks.{layer}.norm1:output'
    """

    module: str
    io: str
    meaning: str = ""

    def hook(self, block_template: str) -> str:
        """The checklist's name of this site: module path template and ``:input`` or ``:output``."""
        path = f"{block_template}.{self.module}" if self.module else block_template
        return f"{path}:{self.io}"


@dataclass
class TraceContext:
    """What one trace knows beyond the model: facts an adapter records while it runs (e.g. the token grid
    entering each Swin block), kept here and never on the registered adapter, which every trace shares.

    Example:
        >>> import torch
        >>> ctx = TraceContext(torch.nn.Identity())
        >>> ctx.facts["grid"] = (4, 4)
        >>> ctx.facts
        {'grid': (4, 4)}
    """

    model: torch.nn.Module
    facts: dict[str, Any] = field(default_factory=dict)


class Adapter:
    """Base class of architecture adapters. Subclasses fill in the site table and token layout.

    Example:
        >>> class MyAdapter(Adapter):
        ...     family = "mine"
        ...     def matches(self, model): return False
    """

    family: str = "base"
    block_template: str = "blocks.{layer}"
    sites: dict[str, SiteSpec] = {}
    #: Whether a trace may run each of :meth:`blocks` again inside the backward pass instead of keeping its graph
    #: (:mod:`vitcam_nb.capture.recompute`): set on families whose recomputed traces are tested equal to the plain
    #: pass's (to float32 rounding: the recomputed backward multiplies matrices of other batch shapes).
    recomputable: bool = False

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether this adapter reads ``model`` (checked in registration order)."""
        raise NotImplementedError

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The transformer blocks in forward order (layer ``l`` is ``blocks(model)[l]``)."""
        raise NotImplementedError

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        """Kinds of the prefix tokens in sequence order ("cls", "dist", "reg")."""
        raise NotImplementedError

    def grid_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module whose output reveals the patch grid (hooked during the forward pass)."""
        raise NotImplementedError

    def grid_from_output(self, model: torch.nn.Module, output: torch.Tensor) -> tuple[int, int]:
        """(rows, columns) of the patch grid, read from the output of :meth:`grid_module`."""
        raise NotImplementedError

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Modules with a ``fused_attn`` flag that must be off for F2 to exist."""
        raise NotImplementedError

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        """Flat facts about the model for the trace attrs (num_heads, head_dim, global_pool, ...)."""
        raise NotImplementedError

    def block_facts(self, model: torch.nn.Module, layer: int) -> dict[str, int]:
        """``num_heads``, ``head_dim`` and ``stage_dim`` (residual width) of block ``layer``, for the stage
        attrs of a hierarchical trace; the default reads timm's ``attn.num_heads`` and fused ``attn.qkv``."""
        attn = self.blocks(model)[layer].attn
        heads = int(attn.num_heads)
        return {"num_heads": heads, "head_dim": int(attn.qkv.out_features // 3 // heads),
                "stage_dim": int(attn.qkv.in_features)}

    # Optional override points; the defaults fit a plain pre-norm ViT.

    def site_table(self, model: torch.nn.Module) -> dict[str, SiteSpec]:
        """The sites this particular model has. A family whose blocks lack a module (e.g. post-norm blocks
        have no LayerNorm before attention) leaves that site out, and asking for it is refused."""
        return dict(self.sites)

    @contextlib.contextmanager
    def patched(self, model: torch.nn.Module) -> Iterator[None]:
        """Temporary changes the trace needs beyond ``fused_attn`` (e.g. an explicit attention forward so the
        softmax matrix is a hookable tensor); everything must be restored on exit, also on error."""
        yield

    def arrange(self, model: torch.nn.Module, site: str, layer: int, tensor: torch.Tensor) -> torch.Tensor:
        """Bring a captured tensor to the schema layout: (..., token, channel) for token sites and
        (..., head, query, key) for F2. Activations arrive as (batch, ...), gradients as (targets, batch, ...),
        so index from the end (e.g. ``tensor.index_select(-2, order)`` to reorder tokens)."""
        return tensor

    # Per-trace forms. The capture calls these with the trace's context; by default they are the plain
    # override points above, so an adapter that keeps no per-trace facts only writes those.

    def tracing(self, ctx: TraceContext) -> contextlib.AbstractContextManager[None]:
        """Everything the adapter does around one trace's passes: ``patched(ctx.model)`` by default. An
        adapter that needs facts of this trace (e.g. each block's token grid) records them into ``ctx.facts``
        here, never on ``self``: one adapter instance serves every trace, also concurrently."""
        return self.patched(ctx.model)

    def arrange_traced(self, ctx: TraceContext, site: str, layer: int, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`arrange` with the trace's context: ``arrange(ctx.model, site, layer, tensor)`` by default."""
        return self.arrange(ctx.model, site, layer, tensor)

    def check_input(self, model: torch.nn.Module, x: torch.Tensor) -> None:
        """Refuse an input batch (B, 3, H, W) the model cannot take, with a message naming ``image``."""

    def arrange_extra(self, site: str, tensor: torch.Tensor) -> torch.Tensor:
        """An extra site's captured tensor (batch, ...) or its gradients (targets, batch, ...) as the pass keeps
        them (batch row b is image b); the default leaves them as captured."""
        return tensor

    def prepare_input(self, model: torch.nn.Module, image: object, processor: object = None) -> Any:
        """The prepared input (a :class:`vitcam_nb.preprocess.PreparedInput`) of a family whose input is not one
        image (a video clip), refusing one that does not fit before any model call; None (the default): the
        image rules of :func:`vitcam_nb.preprocess.prepare_input` apply."""
        return None

    def prepare_traced_input(self, model: torch.nn.Module, image: object, processor: object = None,
                             target: object = None) -> Any:
        """:meth:`prepare_input` for a trace whose ``target`` is known: a family whose input is read with the
        target's forward arguments (Qwen2-VL's packed ``pixel_values`` with the answer target's ``image_grid_thw``)
        overrides this; by default the target is not needed."""
        return self.prepare_input(model, image, processor)

    def runs_crops(self, model: torch.nn.Module) -> bool:
        """Whether the model's tower runs on several crops of one input (an any-resolution VLM): its block sites
        then hold one row per crop, and the capture keeps every row (:mod:`vitcam_nb.capture.crops`)."""
        return False

    def data_config(self, model: torch.nn.Module) -> dict | None:
        """A timm-style data config (input_size, mean, std, interpolation, crop_pct, crop_mode) for models
        that do not carry a timm ``pretrained_cfg``; None uses timm's resolver."""
        return None

    def extra_sites(self, model: torch.nn.Module) -> dict[str, list[tuple[torch.nn.Module, str]]]:
        """Sites outside the block stack (e.g. BLIP's cross-attention ``xattn``): site name -> one
        (module, "input"/"output") per layer of that site."""
        return {}

    def assemble_extra(self, model: torch.nn.Module, site: str, acts: list[np.ndarray], grads: list[np.ndarray],
                       target: object) -> tuple[dict, dict]:
        """Data variables and coordinates of an extra site from its per-layer activations (leading dim 1) and
        gradients (leading dim = targets), already on the CPU in the storage dtype."""
        raise NotImplementedError
