"""Adapter for timm's ``VisionTransformer`` family: ViT, DeiT (also distilled), registers, avg pooling."""

from __future__ import annotations

import torch

from vitcam_nb.adapters.base import Adapter, SiteSpec
from vitcam_nb.adapters.qkv import timm_qkv_sites
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.core.errors import ArgumentTypeError

VIT_SITES: dict[str, SiteSpec] = {
    "F1": SiteSpec("norm1", "output", "LayerNorm output before multi-head attention"),
    "F2": SiteSpec("attn.attn_drop", "output", "softmax attention matrix per head"),
    "F3": SiteSpec("attn.proj", "input", "attention output, heads concatenated, before the output projection"),
    "F4": SiteSpec("norm2", "output", "LayerNorm output before the MLP"),
    "F5": SiteSpec("mlp", "output", "MLP output"),
    "F6": SiteSpec("", "output", "residual stream after the MLP (block output)"),
    "resid_pre": SiteSpec("", "input", "residual stream entering the block"),
    "attn_out": SiteSpec("attn", "output", "attention module output after the projection"),
    "resid_mid": SiteSpec("norm2", "input", "residual stream after the attention residual"),
}


@declare_family(priority=100)
class VitAdapter(Adapter):
    """timm ``VisionTransformer`` and subclasses that keep its pre-norm block.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, reg_tokens=4)
        >>> VitAdapter().prefix_kinds(m)
        ['cls', 'reg', 'reg', 'reg', 'reg']
    """

    family = "vit"
    block_template = "blocks.{layer}"
    sites = VIT_SITES
    recomputable = True

    def matches(self, model: torch.nn.Module) -> bool:
        from timm.models.vision_transformer import VisionTransformer

        return isinstance(model, VisionTransformer)

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return list(model.blocks)

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        # Sequence order follows timm's _pos_embed: class token, distillation token (DeiT), registers.
        kinds = []
        if getattr(model, "cls_token", None) is not None:
            kinds.append("cls")
        if getattr(model, "dist_token", None) is not None:
            kinds.append("dist")
        reg = getattr(model, "reg_token", None)
        if reg is not None:
            kinds.extend(["reg"] * reg.shape[1])
        if len(kinds) != model.num_prefix_tokens:
            raise ArgumentTypeError(
                f"model: {type(model).__name__} has num_prefix_tokens={model.num_prefix_tokens} but the "
                f"vit adapter found {kinds}; register an adapter for this family"
            )
        return kinds

    def site_table(self, model: torch.nn.Module) -> dict[str, SiteSpec]:
        # q, k, v and attn_scores exist where the blocks use timm's plain Attention (not BEiT's or EVA's).
        return {**self.sites, **timm_qkv_sites(list(model.blocks))}

    def grid_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.patch_embed

    def grid_from_output(self, model: torch.nn.Module, output: torch.Tensor) -> tuple[int, int]:
        # With dynamic_img_size the patch embedding keeps the NHWC grid; otherwise the grid is fixed.
        if output.ndim == 4:
            return int(output.shape[1]), int(output.shape[2])
        gh, gw = model.patch_embed.grid_size
        return int(gh), int(gw)

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [blk.attn for blk in model.blocks]

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        attn = model.blocks[0].attn
        patch = model.patch_embed.patch_size
        return {
            "num_heads": int(attn.num_heads),
            "head_dim": int(attn.head_dim),
            "embed_dim": int(model.embed_dim),
            "global_pool": str(model.global_pool or "none"),
            "patch_size": int(patch[0]) if patch[0] == patch[1] else f"{patch[0]}x{patch[1]}",
            "dynamic_img_size": int(bool(getattr(model, "dynamic_img_size", False))),
            # Only when set: traces of other models keep the attributes they had.
            **({"dynamic_img_pad": 1} if getattr(model.patch_embed, "dynamic_img_pad", False) else {}),
            "position_encoding": "absolute" if getattr(model, "pos_embed", None) is not None else "none",
        }
