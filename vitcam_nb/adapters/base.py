"""The adapter interface: a site table (site -> module path and input/output) and a token layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SiteSpec:
    """Where a site is read inside block ``l``: ``module`` is a path relative to the block ("" = the block
    itself) and ``io`` says whether its ``input`` (first positional argument) or ``output`` is read.

    Example:
        >>> SiteSpec("norm1", "output").hook("blocks.{layer}")
        'blocks.{layer}.norm1:output'
    """

    module: str
    io: str
    meaning: str = ""

    def hook(self, block_template: str) -> str:
        path = f"{block_template}.{self.module}" if self.module else block_template
        return f"{path}:{self.io}"


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

    def matches(self, model: torch.nn.Module) -> bool:
        raise NotImplementedError

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        raise NotImplementedError

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        """Kinds of the prefix tokens in sequence order ("cls", "dist", "reg")."""
        raise NotImplementedError

    def grid_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module whose output reveals the patch grid (hooked during the forward pass)."""
        raise NotImplementedError

    def grid_from_output(self, model: torch.nn.Module, output: torch.Tensor) -> tuple[int, int]:
        raise NotImplementedError

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Modules with a ``fused_attn`` flag that must be off for F2 to exist."""
        raise NotImplementedError

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        """Flat facts about the model for the trace attrs (num_heads, head_dim, global_pool, ...)."""
        raise NotImplementedError
