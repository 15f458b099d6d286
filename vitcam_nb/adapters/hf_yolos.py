"""Adapter for Hugging Face YOLOS (``YolosModel``, ``YolosForObjectDetection``; ``vitcam_nb[hf]``): a plain ViT
whose sequence is (class token, patches, detection tokens). Each detection token feeds the class and box heads,
so a detection's score is read from one detection token; the map covers the patch tokens only.

The trace stores the tokens in the schema's order, prefix tokens first: the class token, then the
``num_detection_tokens`` detection tokens (``token_kind`` ``"det"``, in the model's order), then the patches in
raster order; :meth:`HfYolosAdapter.arrange` moves the detection tokens there from the end of the model's
sequence (query and key axes of F2 alike). The layers are the layout transformers 5 ships for YOLOS
(``attention.attention.query/key/value``, ``attention.output.dense``, ``intermediate``, ``output``); a model with
another layout is refused with the version to install.

Example:
    >>> HfYolosAdapter().family
    'hf_yolos'
"""

from __future__ import annotations

from typing import Any

import torch

from vitcam_nb.adapters.base import SiteSpec
from vitcam_nb.adapters.hf import IMAGENET_MEAN, IMAGENET_STD, HfSiteSpec, HfVitAdapter
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.core.errors import ArgumentTypeError

__all__ = ["HfYolosAdapter", "yolos_token_order"]

#: The kind of a YOLOS detection token in ``token_kind``.
DETECTION_KIND = "det"


def yolos_token_order(n_tokens: int, n_det: int) -> torch.Tensor:
    """Indices that bring YOLOS's (class, patches, detections) sequence to (class, detections, patches).

    Example:
        >>> yolos_token_order(6, 2).tolist()
        [0, 4, 5, 1, 2, 3]
    """
    patches = n_tokens - 1 - n_det
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(1 + patches, n_tokens),
                      torch.arange(1, 1 + patches)])


@declare_family(needs="transformers", priority=340)
class HfYolosAdapter(HfVitAdapter):
    """transformers YOLOS: class token, patches, then ``config.num_detection_tokens`` detection tokens (stored
    with the prefix tokens, after the class token).

    Example:
        >>> HfYolosAdapter().relative_sites("vit.encoder.layer")["F3"].hook("")
        'vit.encoder.layer.{layer}.attention.output.dense:input'
    """

    family = "hf_yolos"
    classes = ("YolosModel", "YolosForObjectDetection")
    base_prefix = "vit"
    #: YolosImageProcessor: ImageNet statistics, bilinear resize (the kit resizes to config.image_size, no padding).
    processor_defaults = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "interpolation": "bilinear", "crop_pct": 1.0,
                          "crop_mode": "squash"}
    interpolates = True  # YolosEmbeddings interpolates the patch position embeddings at every input size

    def _check_layout(self, model: torch.nn.Module, layers: torch.nn.ModuleList) -> None:
        first = layers[0]
        ok = all(_has(first, p) for p in ("attention.attention.query", "attention.attention.key",
                                          "attention.attention.value", "attention.output.dense", "intermediate.dense",
                                          "output.dense", "layernorm_before", "layernorm_after"))
        if not ok:
            raise ArgumentTypeError(f"model: {type(model).__name__}'s layers are not the YOLOS layout of transformers "
                                    f"5 (attention.attention.query/key/value, attention.output.dense, intermediate, "
                                    f"output, layernorm_before/after); the hf_yolos adapter reads that layout: pip "
                                    f"install 'transformers>=5,<6'")

    def relative_sites(self, path: str) -> dict[str, SiteSpec]:
        """The sites of a YOLOS layer (``x + attention(layernorm_before(x))``, then ``x + output.dense(
        intermediate(layernorm_after(x)))``) and the per-head ``q``, ``k``, ``v``.

        Example:
            >>> HfYolosAdapter().relative_sites("vit.encoder.layer")["F2"].hook("")
            'vit.encoder.layer.{layer}.attention.attention:output[1]'
        """
        sites = {
            "F1": HfSiteSpec("layernorm_before", "output", "LayerNorm output before multi-head attention", path),
            "F2": HfSiteSpec("attention.attention", "output[1]", "softmax attention matrix per head (the weights the "
                             "eager attention returns)", path),
            "F3": HfSiteSpec("attention.output.dense", "input",
                             "attention output, heads concatenated, before the output projection", path),
            "F4": HfSiteSpec("layernorm_after", "output", "LayerNorm output before the MLP", path),
            "F5": HfSiteSpec("output.dense", "output", "MLP output (second linear layer, before the residual)", path),
            "F6": HfSiteSpec("", "output", "residual stream after the MLP (layer output, before the mid position "
                             "embeddings are added)", path),
            "resid_pre": HfSiteSpec("", "input", "residual stream entering the layer", path),
            "attn_out": HfSiteSpec("attention", "output", "attention output after attention.output.dense", path),
            "resid_mid": HfSiteSpec("layernorm_after", "input", "residual stream after the attention residual", path),
        }
        for site, name in (("q", "query"), ("k", "key"), ("v", "value")):
            sites[site] = HfSiteSpec(f"attention.attention.{name}", "output",
                                     f"attention {name} projection, heads concatenated", path)
        return sites

    def prefix_kinds(self, model: torch.nn.Module) -> list[str]:
        return ["cls"] + [DETECTION_KIND] * self.detection_tokens(model)

    def detection_tokens(self, model: torch.nn.Module) -> int:
        """``config.num_detection_tokens``.

        Example:
            >>> class M(torch.nn.Module): config = type("C", (), {"num_detection_tokens": 5})()
            >>> HfYolosAdapter().detection_tokens(M())
            5
        """
        return int(model.config.num_detection_tokens)

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [blk.attention.attention for blk in self.blocks(model)]

    def arrange(self, model: torch.nn.Module, site: str, layer: int, tensor: torch.Tensor) -> torch.Tensor:
        n_det = self.detection_tokens(model)
        if site == "F2":
            order = yolos_token_order(int(tensor.shape[-1]), n_det).to(tensor.device)
            return tensor.index_select(-2, order).index_select(-1, order)
        order = yolos_token_order(int(tensor.shape[-2]), n_det).to(tensor.device)
        return tensor.index_select(-2, order)

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        return {**super().describe(model), "num_detection_tokens": self.detection_tokens(model),
                "token_order": "class token, detection tokens, patches (the model's sequence is class token, "
                               "patches, detection tokens; the detection tokens are moved in front of the patches)"}

    def pooling(self, model: torch.nn.Module) -> str:
        if hasattr(model, "bbox_predictor"):
            return ("none: each detection token (after the final LayerNorm) feeds the class and box heads; a "
                    "detection's scores are read from its own token")
        return "none"

    def position_encoding(self, model: torch.nn.Module) -> str:
        mid = getattr(model.config, "use_mid_position_embeddings", False)
        return "absolute (interpolated to the input size)" + (
            " + mid position embeddings added after every layer but the last" if mid else "")


def _has(module: Any, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True
