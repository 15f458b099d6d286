"""Why the backward rules refuse Swin (timm ``SwinTransformer``, transformers Swin, Swin V2 and UperNet with a
Swin backbone): the refusal names the family and states the reason (:func:`~vitcam_nb.capture.rules.base.
register_refusal`).

The rules of this version are written, and tested against a plain-torch reference, for blocks with one global
softmax attention over all tokens (ViT, DeiT, DINOv2, BEiT, EVA, CLIP, SigLIP), as the cited configurations state
them for ViTs: lxt's CP-LRP and AttnLRP for vision transformers and LibraGrad's ViT code. Swin attends inside
local windows that shift every other block under a mask, adds a relative position bias, and merges patches
between stages; none of that has an implementation or a reference test here.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1), num_heads=(1, 2),
    ...                       embed_dim=16, img_size=32, window_size=2)
    >>> vc.trace(m, np.zeros((32, 32, 3), np.uint8), rule="cp_lrp")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    TraceError: rule: rule='cp_lrp' is defined for ...; the swin family (SwinTransformer) is not supported: ...
"""

from __future__ import annotations

from vitcam_nb.capture.rules.base import register_refusal

__all__ = ["SWIN_FAMILIES", "SWIN_REASON"]

#: The adapter families of Swin models.
SWIN_FAMILIES = ("swin", "hf_swin", "hf_swinv2", "hf_upernet_swin")

SWIN_REASON = ("the rules are implemented here for one global softmax attention per block (as lxt configures "
               "CP-LRP and AttnLRP for ViTs, and LibraGrad's ViT code); Swin's shifted-window attention (local "
               "windows shifted under a mask every other block, a relative position bias, patch merging between "
               "stages) has no implementation or reference test in this version")

for _family in SWIN_FAMILIES:
    register_refusal(_family, SWIN_REASON)
