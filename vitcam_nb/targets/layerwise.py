"""Layer-wise scores (exact LeGrad, Bousselham et al. 2024): the score of every block's output read out through
the model's final norm and head, each a target of the same batched backward pass.

For block ``l`` with output ``x_l``, ``s_l = head(pool(norm(x_l)))[c]``: what the classifier would say if the
network stopped after block ``l`` (for the last block this is the model's own logit). The trace stores
``s_0 .. s_{L-1}`` as its ``logits`` (one "class" per block) and differentiates all of them, so
``attn_grad[target of block l, layer l]`` is ``d s_l / d A_l``, the gradient LeGrad reads. The class ``c`` is
fixed first from the model's own logits (``"top1"`` or an index).

Supported: timm ``VisionTransformer`` classifiers (``model.norm``, ``model.forward_head``).

Example:
    >>> import timm, torch
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
    ...                       num_classes=3).eval()
    >>> t = layerwise(class_=1)
    >>> s = t.scores(m, torch.zeros(1, 3, 32, 32))
    >>> tuple(s.shape), torch.allclose(s[-1], m(torch.zeros(1, 3, 32, 32))[0, 1])
    ((2,), True)
"""

from __future__ import annotations

import numpy as np
import torch

from vitcam_nb.core.errors import TraceError
from vitcam_nb.targets.base import Target

__all__ = ["Layerwise", "layerwise"]


class Layerwise(Target):
    """The scores of one class read out after every block (see the module docstring).

    Example:
        >>> Layerwise("top1").settings()
        {'kind': 'layerwise', 'class': 'top1'}
    """

    kind = "layerwise"

    def __init__(self, class_: int | str = "top1"):
        if not (class_ == "top1" or (isinstance(class_, (int, np.integer)) and not isinstance(class_, bool)
                                     and class_ >= 0)):
            raise TraceError(f"class_: expected 'top1' or a class index >= 0, got {class_!r}")
        self.class_ = class_ if isinstance(class_, str) else int(class_)
        self.chosen: int | None = None
        self.description = (f"layer-wise scores of class {self.class_}: block l's output through the final norm, "
                            "pooling and head (exact LeGrad)")

    def check(self, model: torch.nn.Module) -> None:
        from timm.models.vision_transformer import VisionTransformer

        if not isinstance(model, VisionTransformer) or not int(getattr(model, "num_classes", 0) or 0):
            raise TraceError(f"targets: layerwise reads each block out through a timm VisionTransformer's norm and "
                             f"classifier head; got {type(model).__name__} (num_classes="
                             f"{getattr(model, 'num_classes', None)})")

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        outputs: list[torch.Tensor] = []
        handles = [blk.register_forward_hook(lambda _m, _i, out: outputs.append(out)) for blk in model.blocks]
        try:
            logits = model(x)[0]
        finally:
            for h in handles:
                h.remove()
        c = int(torch.argmax(logits.detach())) if self.class_ == "top1" else self.class_
        if c >= logits.shape[0]:
            raise TraceError(f"class_: {c} is out of range (the model has {logits.shape[0]} classes)")
        self.chosen = c
        return torch.stack([model.forward_head(model.norm(out))[0, c] for out in outputs])

    def class_labels(self, model: torch.nn.Module, n: int) -> list[str]:
        return [f"class {self.chosen} after block {i}" for i in range(n)]

    def settings(self) -> dict:
        return {"kind": self.kind, "class": self.class_}

    def attrs(self) -> dict[str, object]:
        return {**super().attrs(), "layerwise_class": -1 if self.chosen is None else int(self.chosen)}


def layerwise(class_: int | str = "top1") -> Layerwise:
    """A :class:`Layerwise` target: one score per block for class ``class_`` (``"top1"``: the model's top class).

    Example:
        >>> layerwise(3).class_
        3
    """
    return Layerwise(class_)
