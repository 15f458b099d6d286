"""Adapter for timm's ``Beit`` (BEiT v1/v2): a pre-norm ViT block whose attention adds a relative position bias.

The bias is added to the scaled scores before the softmax, so F2 (output of ``attn.attn_drop``) is still the
softmax attention matrix, and F3 (input of ``attn.proj``) the value-weighted heads, as in a plain ViT.
"""

from __future__ import annotations

import torch

from vitcam_nb.adapters.base import SiteSpec
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.adapters.vit import VIT_SITES, VitAdapter
from vitcam_nb.core.errors import ArgumentTypeError

BEIT_SITES: dict[str, SiteSpec] = {
    **VIT_SITES,
    "F2": SiteSpec("attn.attn_drop", "output",
                   "softmax attention matrix per head (relative position bias added before the softmax)"),
    "F5": SiteSpec("mlp", "output", "MLP output (before the layer scale gamma_2, where the block has one)"),
}


@declare_family(priority=120)
class BeitAdapter(VitAdapter):
    """timm ``Beit``: one class token first, then the patch tokens; relative position bias inside attention.

    Example:
        >>> import timm
        >>> m = timm.create_model("beitv2_base_patch16_224", pretrained=False, depth=1)
        >>> a = BeitAdapter()
        >>> a.matches(m), a.prefix_kinds(m), a.describe(m)["position_encoding"]
        (True, ['cls'], 'relative position bias')
    """

    family = "beit"
    sites = BEIT_SITES

    def matches(self, model: torch.nn.Module) -> bool:
        from timm.models.beit import Beit

        return isinstance(model, Beit)

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        # Beit.forward_features concatenates exactly one class token in front of the patches.
        if model.num_prefix_tokens != 1 or getattr(model, "cls_token", None) is None:
            raise ArgumentTypeError(f"model: {type(model).__name__} has num_prefix_tokens={model.num_prefix_tokens}; "
                                    "the beit adapter expects one class token; register an adapter for this variant")
        return ["cls"]

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        """Flat facts for the trace attrs; Beit's attention has no ``head_dim`` attribute, so it is derived.

        Example:
            >>> import timm
            >>> m = timm.create_model("beit_base_patch16_224", pretrained=False, depth=1)
            >>> BeitAdapter().describe(m)["head_dim"]
            64
        """
        attn = model.blocks[0].attn
        patch = model.patch_embed.patch_size
        encodings = []
        if getattr(model, "pos_embed", None) is not None:
            encodings.append("absolute")
        if getattr(attn, "relative_position_bias_table", None) is not None:
            encodings.append("relative position bias")
        if getattr(model, "rel_pos_bias", None) is not None:
            encodings.append("shared relative position bias")
        return {
            "num_heads": int(attn.num_heads),
            "head_dim": int(attn.proj.in_features) // int(attn.num_heads),
            "embed_dim": int(model.embed_dim),
            "global_pool": str(model.global_pool or "none"),
            "patch_size": int(patch[0]) if patch[0] == patch[1] else f"{patch[0]}x{patch[1]}",
            "position_encoding": " + ".join(encodings) or "none",
            "layer_scale": int(model.blocks[0].gamma_1 is not None),
            "dynamic_img_size": 0,
        }
