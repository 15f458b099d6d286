"""Adapters for Hugging Face ``transformers`` Swin Transformers (``vitcam_nb[hf]``): ``SwinModel`` /
``SwinForImageClassification`` and ``Swinv2Model`` / ``Swinv2ForImageClassification``, traced into the same
hierarchical DataTree as timm's Swin (one child per stage, window attention per window, shift undone).

How the Hugging Face layers differ from timm's blocks, and what the adapter does about it:

- a layer takes (batch, tokens, channels) raster tokens and the ``input_dimensions`` (H, W) as its second
  argument, so F1, F6 and ``resid_pre`` are already raster tokens (timm's are NHWC grids);
- it pads to a window multiple *before* the cyclic shift (timm shifts first), so the window layout is built in
  that order (:func:`~vitcam_nb.adapters.swin.window_tokens` with ``pad_first=True``);
- Swin V1 clamps ``window_size``/``shift_size`` in place when a stage's grid is not larger than the window:
  the values each layer ran with are recorded during the trace and the layer's own values restored after;
- Swin V1 attention returns ``(output, weights)``: F2 is element 1 under eager attention (``sdpa`` is switched
  to eager for the trace and restored), F3 the input of ``o_proj``. Swin V2 computes its cosine attention
  explicitly: F2 is the output of ``attention.self.dropout``, F3 the input of ``attention.output.dense``;
- Swin V2 layers are post-norm (``x + layernorm_before(attn(x))``, ``x + layernorm_after(mlp(x))``): no
  LayerNorm feeds the attention or the MLP, so F1 and F4 do not exist and asking for them is refused.

transformers is never imported here (classes are recognised by name).

Example:
    >>> HfSwinAdapter().matches(object()), HfSwinv2Adapter().family
    (False, 'hf_swinv2')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.base import SiteSpec, TraceContext
from vitcam_nb.adapters.hf import IMAGENET_MEAN, IMAGENET_STD, eager_attention, is_transformers_model
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.adapters.swin import SwinAdapter, window_tokens
from vitcam_nb.core.errors import ArgumentTypeError, TraceError

__all__ = ["HfStageSiteSpec", "HfSwinAdapter", "HfSwinv2Adapter"]


@dataclass(frozen=True)
class HfStageSiteSpec(SiteSpec):
    """A site of a Hugging Face Swin layer; ``template`` is the layer's full path with ``{stage}`` and
    ``{block}`` (e.g. ``swin.encoder.layers.{stage}.blocks.{block}``), so the checklist names the exact module.

    Example:
        >>> HfStageSiteSpec("layernorm_before", "output", template="encoder.layers.{stage}.blocks.{block}").hook("")
        'encoder.layers.{stage}.blocks.{block}.layernorm_before:output'
    """

    template: str = ""

    def hook(self, block_template: str) -> str:
        return super().hook(self.template or block_template)


#: (module relative to the layer, io, meaning) of each site of a Swin V1 layer.
_V1_SITES = {
    "F1": ("layernorm_before", "output", "LayerNorm output before window attention"),
    "F2": ("attention", "output[1]", "softmax window attention per head (the weights the eager attention returns)"),
    "F3": ("attention.o_proj", "input", "window attention output, heads concatenated, before o_proj"),
    "F4": ("layernorm_after", "output", "LayerNorm output before the MLP"),
    "F5": ("mlp", "output", "MLP output"),
    "F6": ("", "output", "residual stream after the MLP (layer output)"),
    "resid_pre": ("", "input", "residual stream entering the layer"),
    "attn_out": ("attention", "output", "window attention output after o_proj"),
    "resid_mid": ("layernorm_after", "input", "residual stream after the attention residual (MLP's LayerNorm input)"),
}
#: The same for a (post-norm) Swin V2 layer; F1 and F4 have no module.
_V2_SITES = {
    "F2": ("attention.self.dropout", "output", "softmax of the scaled cosine window attention per head"),
    "F3": ("attention.output.dense", "input", "window attention output, heads concatenated, before the projection"),
    "F5": ("output", "output", "MLP output (before the post-norm layernorm_after)"),
    "F6": ("", "output", "residual stream after the MLP (layer output)"),
    "resid_pre": ("", "input", "residual stream entering the layer"),
    "attn_out": ("attention", "output", "window attention output after the projection (before layernorm_before)"),
    "resid_mid": ("intermediate", "input", "MLP input: residual stream after the attention residual"),
}


@declare_family(needs="transformers", priority=270)
class HfSwinAdapter(SwinAdapter):
    """transformers ``SwinModel`` / ``SwinForImageClassification`` (also ``SwinForMaskedImageModeling``).

    Example:
        >>> a = HfSwinAdapter()
        >>> a.family, a.relative_sites("swin.")["F3"].hook("")
        ('hf_swin', 'swin.encoder.layers.{stage}.blocks.{block}.attention.o_proj:input')
    """

    family = "hf_swin"
    block_template = "encoder.layers.{stage}.blocks.{block}"
    #: whether a V1 layer keeps its window on a grid not larger than it (padding) instead of clamping the window
    pads_windows = False
    classes: tuple[str, ...] = ("SwinModel", "SwinForImageClassification", "SwinForMaskedImageModeling")
    base_prefix = "swin"
    site_rows: dict[str, tuple[str, str, str]] = _V1_SITES
    grid_sites = ()  # Hugging Face layers already carry raster tokens
    #: AutoImageProcessor of the Swin checkpoints (ViTImageProcessor): resize to the size bicubic, no crop.
    processor_defaults: dict[str, Any] = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "interpolation": "bicubic",
                                          "crop_pct": 1.0, "crop_mode": "squash"}

    def matches(self, model: torch.nn.Module) -> bool:
        return is_transformers_model(model, self.classes)

    def is_v2(self, model: torch.nn.Module) -> bool:
        return False

    def backbone(self, model: torch.nn.Module) -> torch.nn.Module:
        """The backbone (``model.swin`` of a task model, else the model itself).

        Example:
            >>> lin = torch.nn.Linear(1, 1)
            >>> HfSwinAdapter().backbone(lin) is lin
            True
        """
        return getattr(model, self.base_prefix) if hasattr(model, self.base_prefix) else model

    def _stages(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return self.backbone(model).encoder.layers

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [blk for stage in self._stages(model) for blk in stage.blocks]

    def stages(self, model: torch.nn.Module) -> list[list[int]]:
        out, start = [], 0
        for stage in self._stages(model):
            out.append(list(range(start, start + len(stage.blocks))))
            start += len(stage.blocks)
        return out

    def relative_sites(self, prefix: str) -> dict[str, SiteSpec]:
        """The site table with the backbone at ``prefix`` ("swin." or "" for a bare backbone).

        Example:
            >>> HfSwinAdapter().relative_sites("")["F1"].hook("")
            'encoder.layers.{stage}.blocks.{block}.layernorm_before:output'
        """
        template = f"{prefix}{self.block_template}"
        return {site: HfStageSiteSpec(module, io, meaning, template)
                for site, (module, io, meaning) in self.site_rows.items()}

    @property
    def sites(self) -> dict[str, SiteSpec]:  # type: ignore[override]
        """The sites of this family, paths from a bare backbone (:meth:`site_table` names them in full)."""
        return self.relative_sites("")

    def site_table(self, model: torch.nn.Module) -> dict[str, SiteSpec]:
        self._check_layout(model)
        return self.relative_sites(f"{self.base_prefix}." if hasattr(model, self.base_prefix) else "")

    def _check_layout(self, model: torch.nn.Module) -> None:
        first = self.blocks(model)[0]
        for module, _, _ in self.site_rows.values():
            try:
                first.get_submodule(module)
            except AttributeError:
                raise ArgumentTypeError(f"model: {type(model).__name__}'s layers have no {module!r}: not the "
                                        f"transformers 5 layout the {self.family} adapter reads; pip install "
                                        f"'transformers>=5'") from None

    def grid_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.backbone(model).embeddings.patch_embeddings.projection

    def grid_from_output(self, model: torch.nn.Module, output: torch.Tensor) -> tuple[int, int]:
        return int(output.shape[-2]), int(output.shape[-1])

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [blk.attention for blk in self.blocks(model)]

    def block_facts(self, model: torch.nn.Module, layer: int) -> dict[str, int]:
        attn = self.blocks(model)[layer].attention
        return {"num_heads": int(attn.num_attention_heads), "head_dim": int(attn.head_dim),
                "stage_dim": int(attn.q_proj.in_features)}

    # ----------------------------------------------------------------------------- the trace

    @contextlib.contextmanager
    def tracing(self, ctx: TraceContext) -> Iterator[None]:
        """Record the (H, W) grid entering each layer and the window and shift it ran with into ``ctx.facts``;
        eager attention for the trace; every layer's ``window_size``/``shift_size`` restored after.

        Example:
            >>> ctx = TraceContext(torch.nn.Linear(1, 1))
            >>> class A(HfSwinAdapter):
            ...     def blocks(self, model): return []
            >>> with A().tracing(ctx):
            ...     sorted(ctx.facts)
            ['grid', 'window']
        """
        grids: dict[int, tuple[int, int]] = {}
        windows: dict[int, tuple[int, int]] = {}
        ctx.facts.update(grid=grids, window=windows)
        blocks = self.blocks(ctx.model)
        saved = [(blk, blk.window_size, blk.shift_size) for blk in blocks]
        handles = []
        for layer, blk in enumerate(blocks):
            def record_grid(_m, args, kwargs, layer=layer):
                dims = args[1] if len(args) > 1 else kwargs["input_dimensions"]
                grids[layer] = (int(dims[0]), int(dims[1]))

            def record_window(m, _args, _out, layer=layer):
                windows[layer] = (int(m.window_size), int(m.shift_size))
            handles += [blk.register_forward_pre_hook(record_grid, with_kwargs=True),
                        blk.register_forward_hook(record_window)]
        try:
            with eager_attention(ctx.model):
                yield
        finally:
            for h in handles:
                h.remove()
            for blk, window, shift in saved:
                blk.window_size, blk.shift_size = window, shift

    def window_layout(self, ctx: TraceContext, layer: int) -> np.ndarray:
        """Window layout of layer ``layer`` with the window and shift it ran with (padding before the shift)."""
        h, w = self.grid_of(ctx, layer)
        window, shift = ctx.facts["window"][layer]
        return window_tokens(h, w, (window, window), (shift, shift), pad_first=True)

    # ----------------------------------------------------------------------------- input and facts

    def vision_config(self, model: torch.nn.Module) -> Any:
        """The model's config.

        Example:
            >>> class M(torch.nn.Module): config = type("C", (), {"image_size": 32})()
            >>> HfSwinAdapter().vision_config(M()).image_size
            32
        """
        return model.config

    def configured_size(self, model: torch.nn.Module) -> tuple[int, int]:
        """(height, width) the config's ``image_size`` states.

        Example:
            >>> class M(torch.nn.Module): config = type("C", (), {"image_size": 32})()
            >>> HfSwinAdapter().configured_size(M())
            (32, 32)
        """
        size = model.config.image_size
        return (int(size[0]), int(size[1])) if isinstance(size, (tuple, list)) else (int(size), int(size))

    def check_input(self, model: torch.nn.Module, x: torch.Tensor) -> None:
        got, expected = (int(x.shape[-2]), int(x.shape[-1])), self.configured_size(model)
        if getattr(model.config, "use_absolute_embeddings", False) and got != expected:
            raise TraceError(f"image: the model was built for {expected[0]}x{expected[1]} input (config.image_size, "
                             f"absolute position embeddings), got {got[0]}x{got[1]}; pass a PIL image or uint8 array "
                             "to have it resized, or wrap the model so that its forward passes "
                             "interpolate_pos_encoding=True")

    def data_config(self, model: torch.nn.Module) -> dict:
        """The image processor's defaults as a timm data config at the config's image size.

        Example:
            >>> class M(torch.nn.Module): config = type("C", (), {"image_size": 32})()
            >>> HfSwinAdapter().data_config(M())["input_size"]
            (3, 32, 32)
        """
        h, w = self.configured_size(model)
        return {"input_size": (3, h, w), **self.processor_defaults,
                "source": f"defaults of the {self.family} image processor (no processor given)"}

    def attention_backend(self, model: torch.nn.Module) -> str:
        """The checklist's attention backend.

        Example:
            >>> class M(torch.nn.Module): config = type("C", (), {"_attn_implementation_internal": "sdpa"})()
            >>> HfSwinAdapter().attention_backend(M())[:15]
            'eager attention'
        """
        impl = model.config._attn_implementation_internal or "default"
        return (f"eager attention (the model's {impl} implementation switched to eager for the trace and restored "
                "after) so F2 exists")

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        cfg = model.config
        facts = self.block_facts(model, 0)
        v2 = self.is_v2(model)
        return {
            "num_heads": facts["num_heads"],
            "head_dim": facts["head_dim"],
            "embed_dim": int(cfg.embed_dim),
            "global_pool": "avg (mean of the last stage's tokens after the final LayerNorm)"
            if hasattr(model, "classifier") else "none",
            "patch_size": int(cfg.patch_size),
            "window_size": f"{int(cfg.window_size)}x{int(cfg.window_size)}",
            "swin_version": 2 if v2 else 1,
            "num_stages": len(self._stages(model)),
            "position_encoding": ("continuous relative position bias" if v2 else "relative position bias")
            + (" + absolute" if getattr(cfg, "use_absolute_embeddings", False) else ""),
            "hf_class": type(model).__name__,
            "hf_name_or_path": str(getattr(cfg, "_name_or_path", "") or ""),
            "hf_attn_implementation": str(cfg._attn_implementation_internal or "default"),
            "attention_backend": self.attention_backend(model),
        }


@declare_family(needs="transformers", priority=280)
class HfSwinv2Adapter(HfSwinAdapter):
    """transformers ``Swinv2Model`` / ``Swinv2ForImageClassification``: post-norm layers (no F1, F4), scaled
    cosine attention with a continuous relative position bias, computed explicitly (F2 is always a tensor).

    Example:
        >>> sorted(HfSwinv2Adapter().sites)[:3]
        ['F2', 'F3', 'F5']
    """

    family = "hf_swinv2"
    classes = ("Swinv2Model", "Swinv2ForImageClassification", "Swinv2ForMaskedImageModeling")
    base_prefix = "swinv2"
    site_rows = _V2_SITES

    def is_v2(self, model: torch.nn.Module) -> bool:
        return True

    def block_facts(self, model: torch.nn.Module, layer: int) -> dict[str, int]:
        attn = self.blocks(model)[layer].attention.self
        return {"num_heads": int(attn.num_attention_heads), "head_dim": int(attn.attention_head_size),
                "stage_dim": int(attn.query.in_features)}

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [blk.attention.self for blk in self.blocks(model)]

    def attention_backend(self, model: torch.nn.Module) -> str:
        return "explicit softmax of Swinv2SelfAttention (the model has no other attention implementation)"
