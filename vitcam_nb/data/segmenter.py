"""A small dense model for dense targets: a timm ViT backbone whose patch tokens each go through one linear layer
to class logits, the logit grid upsampled bilinearly to the input (Segmenter's linear decoder, Strudel et al.
2021; SETR-naive, Zheng et al. 2021). It is a timm ``VisionTransformer``, so the vit adapter traces it unchanged.

Example:
    >>> import torch
    >>> m = LinearSegmenter(3, img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2).eval()
    >>> m(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 3, 32, 32])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from vitcam_nb.core.errors import ArgumentError

__all__ = ["LinearSegmenter"]


class LinearSegmenter(VisionTransformer):
    """A ViT with a per-token linear head: ``out[b, c] = upsample(W_c . norm(x_L)[b, patch] + b_c)``, (B, C, H, W).

    Args:
        num_seg_classes: classes of the dense output (e.g. background plus the objects).
        **vit_kwargs: timm ``VisionTransformer`` arguments (its classifier head is left out: ``num_classes=0``).

    Example:
        >>> LinearSegmenter(4, img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2).seg_head.out_features
        4
    """

    def __init__(self, num_seg_classes: int, **vit_kwargs: Any):
        if not isinstance(num_seg_classes, int) or num_seg_classes < 1:
            raise ArgumentError(f"num_seg_classes: expected an int >= 1, got {num_seg_classes!r}")
        super().__init__(**{**vit_kwargs, "num_classes": 0})
        self.num_seg_classes = num_seg_classes
        self.seg_head = torch.nn.Linear(self.embed_dim, num_seg_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.forward_features(x)[:, self.num_prefix_tokens:]
        gh, gw = self.patch_embed.dynamic_feat_size(x.shape[-2:]) if self.dynamic_img_size \
            else self.patch_embed.grid_size
        logits = self.seg_head(tokens).transpose(1, 2).reshape(x.shape[0], self.num_seg_classes, gh, gw)
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)
