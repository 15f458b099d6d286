"""Layer-wise scores (LeGrad, Bousselham et al. 2024): the score of every block's output read out through the
model's final norm and head, each a target of the same batched backward pass.

Two read-outs of block ``l``'s output ``x_l`` (all tokens):

- ``readout="mean"`` (the default; LeGrad's official code, ``legrad/wrapper.py`` of pip ``legrad-torch`` 1.1, and
  torchcam 0.5's ``LeGrad``): ``s_l = head(norm(mean over ALL tokens of x_l))[c]``, the class token included, the
  final norm applied to the mean (open_clip: ``ln_post(mean) @ proj``; timm: ``head(fc_norm(norm(mean)))``).
- ``readout="model"`` (the kit's variant, its only read-out before this option): the model's own head applied
  to block ``l`` (``head(pool(norm(x_l)))``, the class token on class-token models): for the last block this is
  the model's own logit.

The trace stores ``s_0 .. s_{L-1}`` as its ``logits`` (one "class" per block) and differentiates all of them, so
``attn_grad[target of block l, layer l]`` is ``d s_l / d A_l``, the gradient LeGrad reads. The class ``c`` is
given as an index or, with ``"top1"``, is the model's own top class (its logits; for an open_clip tower, the
cosine of its own embedding with each vector), whichever the read-out. The trace id carries the read-out
(``"readout"`` in the target settings, absent for ``"model"``, so traces made before it keep their id and meaning).

Supported: timm ``VisionTransformer`` classifiers (``model.norm``, ``model.fc_norm``, ``model.head``; with
``readout="model"`` also ``model.forward_head``), and open_clip vision towers with ``vectors`` (e.g. text
embeddings): ``s_l = scale * cos(read(x_l), vectors[c])``, ``read`` the read-out above.

Example:
    >>> import timm, torch
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
    ...                       num_classes=3).eval()
    >>> t = layerwise(class_=1, readout="model")
    >>> s = t.scores(m, torch.zeros(1, 3, 32, 32))
    >>> tuple(s.shape), torch.allclose(s[-1], m(torch.zeros(1, 3, 32, 32))[0, 1])
    ((2,), True)
"""

from __future__ import annotations

import numpy as np
import torch

from vitcam_nb.core.errors import TraceError
from vitcam_nb.targets.base import Target, register_target

__all__ = ["READOUTS", "Layerwise", "layerwise"]

#: read-out name -> what it is (the checklist's words)
READOUTS = {"mean": "the final norm applied to the mean over all tokens (class token included), then the head "
                    "(LeGrad's official read-out)",
            "model": "the model's own pooling (the class token on class-token models) and head (the kit's variant)"}


class Layerwise(Target):
    """The scores of one class read out after every block (see the module docstring).

    Example:
        >>> Layerwise("top1").settings()
        {'kind': 'layerwise', 'class': 'top1', 'readout': 'mean'}
    """

    kind = "layerwise"

    def __init__(self, class_: int | str = "top1", vectors: object = None, scale: float = 1.0,
                 readout: str = "mean"):
        if not isinstance(readout, str) or readout not in READOUTS:
            raise TraceError(f"readout: expected one of {list(READOUTS)}, got {readout!r}")
        self.readout = readout
        if not (class_ == "top1" or (isinstance(class_, (int, np.integer)) and not isinstance(class_, bool)
                                     and class_ >= 0)):
            raise TraceError(f"class_: expected 'top1' or a class index >= 0, got {class_!r}")
        self.class_ = class_ if isinstance(class_, str) else int(class_)
        self.vectors = None if vectors is None else torch.as_tensor(np.asarray(vectors, np.float32))
        if self.vectors is not None and (self.vectors.ndim != 2 or not torch.isfinite(self.vectors).all()):
            raise TraceError("vectors: expected a finite (N, D) array of vectors to compare embeddings with")
        self.scale = float(scale)
        self.chosen: int | None = None
        self.description = (f"layer-wise scores of class {self.class_}: block l's output read out through "
                            f"{READOUTS[readout]} (LeGrad)")

    def check(self, model: torch.nn.Module) -> None:
        from timm.models.vision_transformer import VisionTransformer

        if self.vectors is None:
            if not isinstance(model, VisionTransformer) or not int(getattr(model, "num_classes", 0) or 0):
                raise TraceError(f"targets: layerwise reads each block out through a timm VisionTransformer's norm "
                                 f"and classifier head; got {type(model).__name__} (num_classes="
                                 f"{getattr(model, 'num_classes', None)}); an open_clip tower needs vectors=")
            if self.readout == "mean" and getattr(model, "attn_pool", None) is not None:
                raise TraceError("targets: layerwise(readout='mean') applies the final norm and head to the mean "
                                 "over tokens; this timm model pools by attention (global_pool='map'), which "
                                 "LeGrad's classifier read-out does not define; use readout='model'")
            return
        from vitcam_nb.adapters.open_clip import is_open_clip_vit, is_whole_clip

        tower = model.visual if is_whole_clip(model) else model
        if not is_open_clip_vit(tower) or getattr(tower, "attn_pool", None) is not None or \
                str(tower.pool_type) not in ("tok", "avg"):
            raise TraceError("targets: layerwise with vectors reads an open_clip VisionTransformer out per block "
                             "(class-token or average pooling, no attention pooling)")

    def scores(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        from vitcam_nb.adapters.registry import find_adapter

        outputs: list[torch.Tensor] = []
        handles = [blk.register_forward_hook(lambda _m, _i, out: outputs.append(out))
                   for blk in find_adapter(model).blocks(model)]
        try:
            model(x)
        finally:
            for h in handles:
                h.remove()
        read = self._readouts(model, outputs, self.readout)
        # "top1" is the model's own top class (its logits; open_clip: its own embedding's cosines), whatever the
        # read-out: the class LeGrad is asked to explain, as torchcam's example takes it from the model's scores
        own = read[-1] if self.readout == "model" else self._readouts(model, outputs[-1:], "model")[0]
        c = int(torch.argmax(own.detach())) if self.class_ == "top1" else self.class_
        if c >= read[-1].shape[0]:
            raise TraceError(f"class_: {c} is out of range (the model has {read[-1].shape[0]} classes)")
        self.chosen = c
        return torch.stack([r[c] for r in read])

    def _readouts(self, model: torch.nn.Module, outputs: list[torch.Tensor], readout: str) -> list[torch.Tensor]:
        """Each block output through the read-out ``readout``: one score per class (or vector)."""
        if self.vectors is None:
            if readout == "model":
                return [model.forward_head(model.norm(out))[0] for out in outputs]
            # LeGrad's read-out (torchcam's for torchvision: heads(ln(tokens.mean(1)))): one norm acts on the
            # mean; timm has it as `norm` (token pooling) or `fc_norm` (average pooling), the other an Identity.
            return [model.head(model.fc_norm(model.norm(out.mean(dim=1))))[0] for out in outputs]
        tower = model.visual if hasattr(model, "encode_image") else model
        vectors = self.vectors.to(outputs[0].device, outputs[0].dtype)
        vectors = vectors / vectors.norm(dim=1, keepdim=True)
        batch_first = getattr(tower.transformer, "batch_first", True)
        out = []
        for x in outputs:
            x = x if batch_first else x.transpose(0, 1)
            if readout == "mean":  # legrad/wrapper.py: ln_post(feat.mean over tokens) @ proj
                pooled = tower.ln_post(x.mean(dim=1))
                pooled = pooled @ tower.proj if tower.proj is not None else pooled
                out.append(self.scale * (vectors @ (pooled[0] / pooled[0].norm())))
                continue
            if not tower.final_ln_after_pool:
                x = tower.ln_post(x)
            pooled = x[:, 0] if tower.pool_type == "tok" else x[:, 1:].mean(dim=1)
            if tower.final_ln_after_pool:
                pooled = tower.ln_post(pooled)
            if tower.proj is not None:
                pooled = pooled @ tower.proj
            out.append(self.scale * (vectors @ (pooled[0] / pooled[0].norm())))
        return out

    def class_labels(self, model: torch.nn.Module, n: int) -> list[str]:
        return [f"class {self.chosen} after block {i}" for i in range(n)]

    def settings(self) -> dict:
        out = {"kind": self.kind, "class": self.class_}
        if self.readout != "model":  # absent for the earlier read-out: traces made before keep their ids
            out["readout"] = self.readout
        if self.vectors is not None:
            out.update(vectors=self.vectors.numpy().round(7).tolist(), scale=self.scale)
        return out

    def attrs(self) -> dict[str, object]:
        return {**super().attrs(), "layerwise_class": -1 if self.chosen is None else int(self.chosen),
                "layerwise_readout": self.readout}


@register_target
def layerwise(class_: int | str = "top1", vectors: object = None, scale: float = 1.0,
              readout: str = "mean") -> Layerwise:
    """A :class:`Layerwise` target: one score per block for class ``class_`` (``"top1"``: the model's own top
    class); with ``vectors`` (N, D), for an open_clip tower: ``scale`` times the cosine of each
    block's read-out embedding with vector ``class_``. ``readout``: ``"mean"`` (LeGrad's official read-out, for
    ``vc.presets.legrad``) or ``"model"`` (the model's own pooling, for ``vc.presets.legrad_cls``).

    Example:
        >>> layerwise(3).class_, layerwise(3, readout="model").readout
        (3, 'model')
    """
    return Layerwise(class_, vectors, scale, readout)
