"""Adapter for timm's ``Eva`` (EVA, EVA-02, EVA-CLIP, the timm SBB RoPE ViTs, Perception Encoder).

What differs from a plain ViT block, read from timm's source:

- attention (``EvaAttention`` or ``AttentionRope``) rotates queries and keys of the patch tokens (RoPE) before
  the scores; the softmax still goes through ``attn.attn_drop``, so F2 is its output;
- the heads are concatenated and then pass a sub-LayerNorm ``attn.norm`` (``scale_attn_inner``; an Identity
  otherwise) and an optional sigmoid gate before ``attn.proj``: F3 is the *input* of ``attn.norm``, the raw
  value-weighted heads, the same quantity as a ViT's F3;
- ``EvaBlockPostNorm`` computes ``x + norm1(attn(x))`` and ``x + norm2(mlp(x))``: there is no LayerNorm before
  attention or the MLP, so F1 and F4 do not exist for such models and are refused.
"""

from __future__ import annotations

import torch

from vitcam_nb.adapters.base import SiteSpec
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.adapters.vit import VitAdapter
from vitcam_nb.core.errors import ArgumentTypeError

EVA_SITES: dict[str, SiteSpec] = {
    "F1": SiteSpec("norm1", "output", "LayerNorm output before multi-head attention"),
    "F2": SiteSpec("attn.attn_drop", "output", "softmax attention matrix per head (after RoPE on queries and keys)"),
    "F3": SiteSpec("attn.norm", "input", "attention output, heads concatenated, before the attention sub-LayerNorm "
                   "(attn.norm), gate and output projection"),
    "F4": SiteSpec("norm2", "output", "LayerNorm output before the MLP"),
    "F5": SiteSpec("mlp", "output", "MLP output (before the layer scale gamma_2, where the block has one)"),
    "F6": SiteSpec("", "output", "residual stream after the MLP (block output)"),
    "resid_pre": SiteSpec("", "input", "residual stream entering the block"),
    "attn_out": SiteSpec("attn", "output", "attention module output after the projection"),
    "resid_mid": SiteSpec("norm2", "input", "residual stream after the attention residual"),
}

# Post-norm blocks: the LayerNorms follow attention and MLP, inside the residual branches.
EVA_POSTNORM_SITES: dict[str, SiteSpec] = {
    "F2": EVA_SITES["F2"],
    "F3": EVA_SITES["F3"],
    "F5": SiteSpec("mlp", "output", "MLP output (before the post-norm norm2)"),
    "F6": EVA_SITES["F6"],
    "resid_pre": EVA_SITES["resid_pre"],
    "attn_out": SiteSpec("attn", "output", "attention module output after the projection (before the post-norm "
                         "norm1)"),
    "resid_mid": SiteSpec("mlp", "input", "residual stream after the attention residual"),
}


def _is_post_norm(model: torch.nn.Module) -> bool:
    from timm.models.eva import EvaBlockPostNorm

    kinds = {isinstance(blk, EvaBlockPostNorm) for blk in model.blocks}
    if len(kinds) != 1:
        raise ArgumentTypeError("model: mixes pre-norm and post-norm EVA blocks; the eva adapter expects one kind")
    return kinds.pop()


@declare_family(priority=130)
class EvaAdapter(VitAdapter):
    """timm ``Eva``: class token (optional), then register tokens, then patches; RoPE and/or absolute positions.

    Example:
        >>> import timm
        >>> m = timm.create_model("eva02_tiny_patch14_224", pretrained=False, depth=1)
        >>> a = EvaAdapter()
        >>> a.matches(m), a.prefix_kinds(m), a.describe(m)["position_encoding"]
        (True, ['cls'], 'absolute + rope')
        >>> p = timm.create_model("eva02_enormous_patch14_clip_224", pretrained=False, depth=1, embed_dim=32)
        >>> sorted(set(a.sites) - set(a.site_table(p)))
        ['F1', 'F4']
    """

    family = "eva"
    sites = EVA_SITES

    def matches(self, model: torch.nn.Module) -> bool:
        from timm.models.eva import Eva

        return isinstance(model, Eva)

    def site_table(self, model: torch.nn.Module) -> dict[str, SiteSpec]:
        """F1..F6 and the extended sites for pre-norm blocks; without F1 and F4 for post-norm blocks.

        Example:
            >>> import timm
            >>> m = timm.create_model("eva02_tiny_patch14_224", pretrained=False, depth=1)
            >>> EvaAdapter().site_table(m)["F3"].hook("blocks.{layer}")
            'blocks.{layer}.attn.norm:input'
        """
        return dict(EVA_POSTNORM_SITES if _is_post_norm(model) else EVA_SITES)

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        # Eva._pos_embed concatenates [cls_token, reg_token, patches] in this order.
        kinds = ["cls"] if getattr(model, "cls_token", None) is not None else []
        reg = getattr(model, "reg_token", None)
        if reg is not None:
            kinds.extend(["reg"] * int(reg.shape[1]))
        if len(kinds) != model.num_prefix_tokens:
            raise ArgumentTypeError(f"model: {type(model).__name__} has num_prefix_tokens={model.num_prefix_tokens} "
                                    f"but the eva adapter found {kinds}; register an adapter for this variant")
        return kinds

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        """Flat facts for the trace attrs, including the position encoding and the block layout.

        Example:
            >>> import timm
            >>> m = timm.create_model("vit_medium_patch16_rope_reg1_gap_256", pretrained=False, depth=1)
            >>> d = EvaAdapter().describe(m)
            >>> d["position_encoding"], d["block_norm"], d["global_pool"]
            ('rope', 'pre-norm', 'avg')
        """
        attn = model.blocks[0].attn
        encodings = []
        if getattr(model, "pos_embed", None) is not None:
            encodings.append("absolute")
        if getattr(model, "rope", None) is not None:
            encodings.append("rope (mixed, per layer)" if getattr(model, "rope_mixed", False) else "rope")
        return {
            **super().describe(model),
            "position_encoding": " + ".join(encodings) or "none",
            "block_norm": "post-norm" if _is_post_norm(model) else "pre-norm",
            "attn_sub_norm": int(not isinstance(attn.norm, torch.nn.Identity)),
            "attn_type": type(attn).__name__,
        }
