"""Adapter for Hugging Face ``DPTForSemanticSegmentation`` (``vitcam_nb[hf]``): the ViT encoder of a Dense
Prediction Transformer, traced like any flat ViT while the neck and head turn its tokens into a (B, C, H, W)
segmentation map, so that a dense target (``vc.targets.region`` / ``vc.targets.dense``) is what is differentiated.

The DPT layers keep the older transformers ViT layout (``attention.attention`` with ``query``/``key``/``value``,
``attention.output.dense``, ``intermediate``/``output`` for the MLP, the residual added inside ``output``); the
sites are named after those modules. Only the plain ViT backbone is read: a hybrid DPT (``config.is_hybrid``,
BiT convolutions before the tokens) is refused, and so are ``DPTModel`` and ``DPTForDepthEstimation`` (no
adapter matches them). Position embeddings are interpolated at every input size; the neck needs a square
token grid, so a non-square input is refused.

transformers is never imported here (the class is recognised by name).

Example:
    >>> a = HfDptAdapter()
    >>> a.family, a.matches(object())
    ('hf_dpt', False)
"""

from __future__ import annotations

import torch

from vitcam_nb.adapters.base import SiteSpec
from vitcam_nb.adapters.hf import HALF_MEAN, HALF_STD, HfSiteSpec, HfVitAdapter
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.core.errors import ArgumentTypeError, TraceError

__all__ = ["HfDptAdapter"]


@declare_family(needs="transformers", priority=300)
class HfDptAdapter(HfVitAdapter):
    """transformers ``DPTForSemanticSegmentation`` with a ViT backbone: one class token, then the patches.

    Example:
        >>> HfDptAdapter().relative_sites("dpt.encoder.layer")["F3"].hook("")
        'dpt.encoder.layer.{layer}.attention.output.dense:input'
    """

    family = "hf_dpt"
    classes = ("DPTForSemanticSegmentation",)
    base_prefix = "dpt"
    attention, out_proj = "attention", "output"
    #: DPTImageProcessor: resize to the size (no aspect ratio kept, multiple of 1) bicubic, mean/std 0.5.
    processor_defaults = {"mean": HALF_MEAN, "std": HALF_STD, "interpolation": "bicubic", "crop_pct": 1.0,
                          "crop_mode": "squash"}
    interpolates = True  # DPTViTEmbeddings resizes its position embeddings to every input's grid

    def _check_layout(self, model: torch.nn.Module, layers: torch.nn.ModuleList) -> None:
        if getattr(model.config, "is_hybrid", False):
            raise ArgumentTypeError(f"model: {type(model).__name__} has a hybrid backbone (config.is_hybrid=True: BiT "
                                    f"convolutions before the tokens); the hf_dpt adapter reads the plain ViT backbone "
                                    f"only")
        first = layers[0]
        if not all(hasattr(first, n) for n in ("layernorm_before", "layernorm_after", "intermediate", "output")) or \
                not hasattr(getattr(first, "attention", None), "output"):
            raise ArgumentTypeError(f"model: {type(model).__name__}'s layers are not the DPTViTLayer layout "
                                    f"(attention.attention, attention.output.dense, layernorm_before/after, "
                                    f"intermediate, output); the hf_dpt adapter does not fit it")

    def relative_sites(self, path: str) -> dict[str, SiteSpec]:
        """The site table with the layer list at ``path`` (DPTViTLayer's module names).

        Example:
            >>> HfDptAdapter().relative_sites("dpt.encoder.layer")["F2"].hook("")
            'dpt.encoder.layer.{layer}.attention.attention:output[1]'
        """
        return {
            "F1": HfSiteSpec("layernorm_before", "output", "LayerNorm output before multi-head attention", path),
            "F2": HfSiteSpec("attention.attention", "output[1]", "softmax attention matrix per head (the weights "
                             "the eager attention returns)", path),
            "F3": HfSiteSpec("attention.output.dense", "input", "attention output, heads concatenated, before the "
                             "output projection", path),
            "F4": HfSiteSpec("layernorm_after", "output", "LayerNorm output before the MLP", path),
            "F5": HfSiteSpec("output.dense", "output", "MLP output (before the residual add inside the layer's "
                             "output module; its dropout is the identity in eval mode)", path),
            "F6": HfSiteSpec("", "output", "residual stream after the MLP (layer output)", path),
            "resid_pre": HfSiteSpec("", "input", "residual stream entering the layer", path),
            "attn_out": HfSiteSpec("attention", "output", "attention output after the output projection", path),
            "resid_mid": HfSiteSpec("layernorm_after", "input", "residual stream after the attention residual",
                                    path),
        }

    def check_input(self, model: torch.nn.Module, x: torch.Tensor) -> None:
        super().check_input(model, x)
        h, w = int(x.shape[-2]), int(x.shape[-1])
        if h != w:  # DPTReassembleStage reshapes the patch tokens to a square grid whatever the input was
            raise TraceError(f"image: {h}x{w} is not square; DPTForSemanticSegmentation's neck reassembles the "
                             "patch tokens into a square grid, so pass a square image (or a PIL image / uint8 "
                             "array to have it resized)")

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [blk.attention.attention for blk in self.blocks(model)]

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        cfg = model.config
        facts = super().describe(model)
        facts["dense_head"] = (f"DPT neck (reassemble {cfg.readout_type} readout of layers "
                               f"{list(cfg.backbone_out_indices)}, fusion) and semantic segmentation head, "
                               f"{int(cfg.num_labels)} classes")
        return facts

    def pooling(self, model: torch.nn.Module) -> str:
        return "none (dense output: the neck reads the tokens of several layers)"

    def position_encoding(self, model: torch.nn.Module) -> str:
        return "absolute (interpolated to the input size)"
