"""Adapters for the vision towers of Hugging Face CLIP and SigLIP (``vitcam_nb[hf]``): ``CLIPModel``,
``CLIPVisionModel(WithProjection)``, ``SiglipModel`` and ``SiglipVisionModel``.

Both towers are pre-norm layers at ``vision_model.encoder.layers`` (``layer_norm1``, ``self_attn`` with
``out_proj``, ``layer_norm2``, ``mlp``). CLIP puts one class token in front of the patches and pools it; SigLIP has
no class token at all and pools the patch tokens with an attention-pooling head, so its sequence is patches only:
every block site exists, but nothing that reads a class token (``attn_rows="cls"``, ``weight_tokens="cls"``) does.
Scores come from a similarity target (:func:`vitcam_nb.targets.similarity`, :func:`vitcam_nb.targets.prompts`).

Example:
    >>> HfClipAdapter().family, HfSiglipAdapter().family
    ('hf_clip', 'hf_siglip')
"""

from __future__ import annotations

import torch

from vitcam_nb.adapters.base import SiteSpec
from vitcam_nb.adapters.hf import HfSiteSpec, HfVitAdapter
from vitcam_nb.adapters.qkv import projected_qk_sites
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.core.schema import QKV_SITES

__all__ = ["HfClipAdapter", "HfSiglipAdapter", "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD"]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@declare_family(needs="transformers", priority=250)
class HfClipAdapter(HfVitAdapter):
    """transformers CLIP vision towers: class token, then the patches.

    Example:
        >>> HfClipAdapter().relative_sites("vision_model.encoder.layers")["F3"].hook("")
        'vision_model.encoder.layers.{layer}.self_attn.out_proj:input'
    """

    family = "hf_clip"
    classes = ("CLIPModel", "CLIPVisionModel", "CLIPVisionModelWithProjection")
    base_prefix = "vision_model"
    norm_before, norm_after = "layer_norm1", "layer_norm2"
    attention, out_proj = "self_attn", "out_proj"
    patch_conv = "embeddings.patch_embedding"
    #: CLIPImageProcessor: resize the shortest edge bicubic, centre crop, OpenAI CLIP statistics.
    processor_defaults = {"mean": OPENAI_CLIP_MEAN, "std": OPENAI_CLIP_STD, "interpolation": "bicubic",
                          "crop_pct": 1.0, "crop_mode": "center"}

    def relative_sites(self, path: str) -> dict[str, SiteSpec]:
        """The sites of :class:`HfVitAdapter`, the optional per-head ``q``, ``k``, ``v`` (the outputs of
        ``q_proj``, ``k_proj``, ``v_proj``: heads concatenated, queries before the scale) and ``q_out``/``k_out``
        (those q and k through ``out_proj``, for Grad-ECLIP's code).

        Example:
            >>> HfClipAdapter().relative_sites("vision_model.encoder.layers")["v"].hook("")
            'vision_model.encoder.layers.{layer}.self_attn.v_proj:output'
            >>> HfClipAdapter().relative_sites("vision_model.encoder.layers")["q_out"].hook("")
            'vision_model.encoder.layers.{layer}.self_attn:projected:q'
        """
        return {**super().relative_sites(path),
                **{s: HfSiteSpec(f"{self.attention}.{s}_proj", "output", f"attention {s} projection, heads "
                                 "concatenated", path) for s in QKV_SITES},
                **projected_qk_sites(self.attention, self.out_proj,
                                     lambda module, io, meaning: HfSiteSpec(module, io, meaning, path))}

    def pooling(self, model: torch.nn.Module) -> str:
        projected = hasattr(model, "visual_projection")
        return "token (class token after post_layernorm" + (", then visual_projection)" if projected else ")")


@declare_family(needs="transformers", priority=260)
class HfSiglipAdapter(HfClipAdapter):
    """transformers SigLIP vision towers: patches only (no class token); an attention-pooling head reads them.

    Example:
        >>> HfSiglipAdapter().prefix_kinds(None)
        []
    """

    family = "hf_siglip"
    classes = ("SiglipModel", "SiglipVisionModel")
    #: SiglipImageProcessor: resize (squash) to the size bicubic, mean/std 0.5.
    processor_defaults = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "interpolation": "bicubic",
                          "crop_pct": 1.0, "crop_mode": "squash"}

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        # SiglipVisionEmbeddings adds position embeddings to the patches and prepends nothing.
        return []

    def pooling(self, model: torch.nn.Module) -> str:
        return ("attention pooling head (a learned probe attends over the patch tokens after post_layernorm; no "
                "class token)")
