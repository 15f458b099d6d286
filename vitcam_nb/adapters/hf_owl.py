"""Adapters for Hugging Face OWL-ViT and OWLv2 open-vocabulary detectors (``OwlViTForObjectDetection``,
``Owlv2ForObjectDetection``; ``vitcam_nb[hf]``).

The image tower is a CLIP ViT (class token, then the patches; pre-norm layers at
``owlvit.vision_model.encoder.layers`` or ``owlv2.vision_model.encoder.layers``), read with the CLIP adapter's
sites. After ``post_layernorm`` every patch token is multiplied by the class token and normalised again
(``layer_norm``), and each patch token predicts one box (box head plus a bias for its grid cell) and one logit
per text query (class head); OWLv2 adds an objectness logit per patch. A detection is therefore a patch token,
and its score is read with :func:`vitcam_nb.targets.detection` (text queries come from the caller's tokenizer).

Example:
    >>> HfOwlVitAdapter().family, HfOwlv2Adapter().family
    ('hf_owlvit', 'hf_owlv2')
"""

from __future__ import annotations

import torch

from vitcam_nb.adapters.hf_clip import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, HfClipAdapter
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.core.errors import ArgumentTypeError

__all__ = ["HfOwlVitAdapter", "HfOwlv2Adapter"]


@declare_family(needs="transformers", priority=350)
class HfOwlVitAdapter(HfClipAdapter):
    """transformers ``OwlViTForObjectDetection``: the CLIP image tower at ``owlvit.vision_model``.

    Example:
        >>> HfOwlVitAdapter().relative_sites("owlvit.vision_model.encoder.layers")["F1"].hook("")
        'owlvit.vision_model.encoder.layers.{layer}.layer_norm1:output'
    """

    family = "hf_owlvit"
    classes = ("OwlViTForObjectDetection",)
    base_prefix = "owlvit.vision_model"
    #: OwlViTImageProcessor: resize bicubic and centre crop to the size, OpenAI CLIP statistics.
    processor_defaults = {"mean": OPENAI_CLIP_MEAN, "std": OPENAI_CLIP_STD, "interpolation": "bicubic",
                          "crop_pct": 1.0, "crop_mode": "center"}

    def backbone_path(self, model: torch.nn.Module) -> str:
        try:
            model.get_submodule(self.base_prefix)
        except AttributeError:
            return ""
        return self.base_prefix

    def _check_layout(self, model: torch.nn.Module, layers: torch.nn.ModuleList) -> None:
        super()._check_layout(model, layers)
        # The detection heads read the patch tokens through these modules; without them it is not the layout read.
        missing = [m for m in ("class_head", "box_head", "layer_norm") if not hasattr(model, m)]
        if missing:
            raise ArgumentTypeError(f"model: {type(model).__name__} has no {', '.join(missing)}; the {self.family} "
                                    f"adapter reads the detection model of transformers 5: pip install "
                                    f"'transformers>=5'")

    def pooling(self, model: torch.nn.Module) -> str:
        return ("none: every patch token, times the class token (after post_layernorm, then layer_norm), predicts "
                "one box and one logit per text query; a detection's score is read from its own patch token")

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        return {**super().describe(model), "detections": "one per patch token (box head + grid-cell box bias)"}


@declare_family(needs="transformers", priority=360)
class HfOwlv2Adapter(HfOwlVitAdapter):
    """transformers ``Owlv2ForObjectDetection``: as OWL-ViT, at ``owlv2.vision_model``, with an objectness head.

    Example:
        >>> HfOwlv2Adapter().base_prefix
        'owlv2.vision_model'
    """

    family = "hf_owlv2"
    classes = ("Owlv2ForObjectDetection",)
    base_prefix = "owlv2.vision_model"
    #: Owlv2ImageProcessor: pads to a square and resizes bilinear to the size, OpenAI CLIP statistics (the kit
    #: resizes a PIL image or uint8 array without the padding; pass a processor for the padded input).
    processor_defaults = {"mean": OPENAI_CLIP_MEAN, "std": OPENAI_CLIP_STD, "interpolation": "bilinear",
                          "crop_pct": 1.0, "crop_mode": "squash"}
