"""Architecture adapters: where each feature site lives in a model family, and how tokens map to a grid.

An adapter is the only per-architecture code in vitcam_nb. :func:`find_adapter` picks the first registered
adapter whose ``matches`` accepts the model; :func:`register_adapter` adds a user's own family without
editing the package (and the ``vitcam_nb.adapters`` entry point group adds a package's).

Example:
    >>> import timm
    >>> from vitcam_nb.adapters import find_adapter
    >>> find_adapter(timm.create_model("vit_tiny_patch16_224", pretrained=False)).family
    'vit'
"""

from __future__ import annotations

# imported for their registrations: the Idefics3/SmolVLM and Qwen2-VL/2.5-VL family rows
from vitcam_nb.adapters import hf_vlm_idefics, hf_vlm_qwen  # noqa: F401
from vitcam_nb.adapters.base import Adapter, SiteSpec, TraceContext
from vitcam_nb.adapters.beit import BeitAdapter
from vitcam_nb.adapters.blip import BlipAdapter  # imports transformers only when a BLIP model is traced
from vitcam_nb.adapters.eva import EvaAdapter
from vitcam_nb.adapters.hf_vlm_anyres import register_vlm_family  # noqa: F401  (registers LLaVA-NeXT/OneVision rows)
from vitcam_nb.adapters.open_clip import OpenClipAdapter  # imports open_clip only when one of its models is traced
from vitcam_nb.adapters.qkv import single_head_attention
from vitcam_nb.adapters.registry import find_adapter, register_adapter, supported_families, unregister_adapter
from vitcam_nb.adapters.swin import SwinAdapter
from vitcam_nb.adapters.vit import VitAdapter
from vitcam_nb.core.errors import TraceError

__all__ = ["Adapter", "BeitAdapter", "BlipAdapter", "EvaAdapter", "OpenClipAdapter", "SiteSpec", "SwinAdapter",
           "TraceContext", "VitAdapter", "find_adapter", "register_adapter", "single_head_attention",
           "supported_families", "TraceError", "unregister_adapter"]
