"""Adapter for Hugging Face ``transformers`` ``UperNetForSemanticSegmentation`` with a Swin backbone
(``vitcam_nb[hf]``): the Swin layers under ``backbone.swin.encoder.layers`` traced into the same hierarchical
DataTree as :class:`~vitcam_nb.adapters.hf_swin.HfSwinAdapter`, the (B, classes, H, W) ``logits`` of the
UperNet head being what a dense target (:func:`vitcam_nb.targets.region`) differentiates.

How UperNet's Swin differs from ``SwinForImageClassification``:

- the encoder sits in a ``SwinBackbone`` (``model.backbone.swin``) whose config (image size, window, heads) is
  ``model.backbone.config``; ``model.config`` is the ``UperNetConfig`` (head, labels);
- the backbone runs its layers with ``always_partition=True``: a layer keeps its window and shift even on a grid
  not larger than the window (it pads instead of clamping), and the recorded window and shift say so;
- every stage's output (before patch merging) feeds the head, so every layer has a gradient.

Only the Swin backbone is read; UperNet with another backbone (ConvNeXt, BEiT, ...) is refused with a TypeError
naming the backbone that is supported. transformers is never imported here (classes are recognised by name).

Example:
    >>> a = HfUperNetSwinAdapter()
    >>> a.family, a.matches(object())
    ('hf_upernet_swin', False)
"""

from __future__ import annotations

from typing import Any

import torch

from vitcam_nb.adapters.base import SiteSpec
from vitcam_nb.adapters.hf import IMAGENET_MEAN, IMAGENET_STD, is_transformers_model
from vitcam_nb.adapters.hf_swin import HfSwinAdapter
from vitcam_nb.adapters.registry import declare_family
from vitcam_nb.core.errors import ArgumentTypeError

__all__ = ["HfUperNetSwinAdapter"]

#: The UperNet backbones this adapter reads.
SWIN_BACKBONES = ("SwinBackbone",)


@declare_family(needs="transformers", priority=290)
class HfUperNetSwinAdapter(HfSwinAdapter):
    """transformers ``UperNetForSemanticSegmentation`` whose ``backbone`` is a ``SwinBackbone``.

    Example:
        >>> HfUperNetSwinAdapter().relative_sites("backbone.swin.")["F1"].hook("")
        'backbone.swin.encoder.layers.{stage}.blocks.{block}.layernorm_before:output'
    """

    family = "hf_upernet_swin"
    pads_windows = True  # the backbone runs its layers with always_partition=True
    classes = ("UperNetForSemanticSegmentation",)
    base_prefix = "backbone.swin"
    #: UperNet's image processor (SegformerImageProcessor): ImageNet statistics, bilinear resize, no crop. The data
    #: config uses them at the backbone config's image_size; the published checkpoints' processor resizes to
    #: 512 x 512 instead, so pass ``processor=`` to ``vc.trace`` to preprocess exactly as they do.
    processor_defaults: dict[str, Any] = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "interpolation": "bilinear",
                                          "crop_pct": 1.0, "crop_mode": "squash"}

    def matches(self, model: torch.nn.Module) -> bool:
        """Any UperNet model: one with another backbone is refused by :meth:`backbone` with what is supported,
        which says more than "not a supported transformer" would."""
        return is_transformers_model(model, self.classes)

    def backbone(self, model: torch.nn.Module) -> torch.nn.Module:
        """The ``SwinModel`` inside UperNet's ``SwinBackbone`` (a ``SwinModel`` passed in is returned as is).

        Example:
            >>> class UperNetForSemanticSegmentation(torch.nn.Module):
            ...     __module__ = "transformers.fake"
            >>> m = UperNetForSemanticSegmentation()
            >>> m.backbone = torch.nn.Conv2d(3, 3, 1)
            >>> HfUperNetSwinAdapter().backbone(m)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            vitcam_nb.core.errors.ArgumentTypeError: model: UperNetForSemanticSegmentation with a Conv2d backbone ...
        """
        if not is_transformers_model(model, self.classes):
            return model
        inner = getattr(model, "backbone", None)
        if not is_transformers_model(inner, SWIN_BACKBONES):
            raise ArgumentTypeError(f"model: {type(model).__name__} with a {type(inner).__name__} backbone is not "
                                    f"supported; the {self.family} adapter reads UperNet with a Swin backbone "
                                    f"({', '.join(SWIN_BACKBONES)}, UperNetConfig(backbone_config=SwinConfig(...))). "
                                    f"For another backbone, register an adapter for it "
                                    f"(vitcam_nb.adapters.register_adapter)")
        return inner.swin

    def site_table(self, model: torch.nn.Module) -> dict[str, SiteSpec]:
        self._check_layout(model)
        return self.relative_sites(f"{self.base_prefix}.")

    def _swin_config(self, model: torch.nn.Module) -> Any:
        return self.backbone(model).config

    def vision_config(self, model: torch.nn.Module) -> Any:
        """The backbone's ``SwinConfig`` (``model.config`` is the UperNet head's)."""
        return self._swin_config(model)

    def configured_size(self, model: torch.nn.Module) -> tuple[int, int]:
        """(height, width) the backbone config's ``image_size`` states."""
        return super().configured_size(self.backbone(model))

    def check_input(self, model: torch.nn.Module, x: torch.Tensor) -> None:
        super().check_input(self.backbone(model), x)

    def attention_backend(self, model: torch.nn.Module) -> str:
        """The checklist's attention backend, from the backbone's config."""
        return super().attention_backend(self.backbone(model))

    def describe(self, model: torch.nn.Module) -> dict[str, object]:
        facts = super().describe(self.backbone(model))
        head = model.config
        return {**facts, "global_pool": "none (dense output)",
                "dense_head": f"UperNet (pyramid pooling {list(head.pool_scales)} + FPN, {int(head.hidden_size)} "
                              f"channels), {int(head.num_labels)} class logits upsampled bilinearly to the input size",
                "hf_class": type(model).__name__,
                "hf_name_or_path": str(getattr(head, "_name_or_path", "") or facts["hf_name_or_path"])}
