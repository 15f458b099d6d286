"""The backward rules on timm's ``VisionTransformer`` family (ViT, DeiT, DeiT distilled, DINOv2 and register
variants): pre-norm ``Block``s with timm's plain ``Attention`` (no q/k norm, no gate), an ``Mlp`` with a GELU, and
LayerNorms.

Each rule is a set of hooks, added when the pass starts and removed when it ends:

- LayerNorm (every ``nn.LayerNorm`` of the model): the output's gradient is that of ``(x - mean) / std * w + b``
  with ``std`` constant (cp_lrp, attnlrp, libragrad).
- GELU (``mlp.act``): the identity rule, gradient ``gelu(x) / x`` (cp_lrp, attnlrp, as lxt), or the gate detached,
  gradient ``Phi(x)`` (libragrad).
- attention, constant (cp_lrp, libragrad): the softmax matrix enters ``A @ V`` as a new leaf after ``attn_drop``'s
  input, so the gradient at A (site F2) exists and nothing flows on into ``q k^T``.
- attention, uniform (attnlrp): half the gradient to each operand of ``q k^T`` (on the outputs of ``q_norm`` and
  ``k_norm``) and of ``A @ V`` (on the input of ``proj``: the gradient at F3 is the product's, the gradient at A
  and at V half of it).

Forward hooks are put first (``prepend``) so the capture's hooks read the rule's tensors; the pre-hook on
``attn_drop`` comes after the capture's (the pass enters the rule after the capture), so it also covers the
softmax that the ``attn_scores`` site rebuilds.

Example:
    >>> import timm, torch
    >>> from vitcam_nb.adapters import find_adapter
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
    >>> with rule_hooks(m, find_adapter(m), attention="uniform", gelu="identity"):
    ...     n = len(m.blocks[0].attn.proj._forward_pre_hooks)
    >>> n, len(m.blocks[0].attn.proj._forward_pre_hooks)
    (1, 0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch

from vitcam_nb.adapters.base import Adapter
from vitcam_nb.adapters.qkv import timm_qkv_sites
from vitcam_nb.capture.hooks import removable_hooks
from vitcam_nb.capture.rules.base import RuleImpl
from vitcam_nb.capture.rules.common import (
    activation_hook,
    constant_input,
    gelu_variant,
    half_input,
    half_output,
    layer_norm_hook,
)
from vitcam_nb.core.errors import TraceError

__all__ = ["check_vit", "rule_hooks", "vit_impl"]

MODELS = "timm VisionTransformer: vit_*, deit_*, DINOv2 and register variants with plain Attention and a GELU Mlp"


def check_vit(model: torch.nn.Module, adapter: Adapter, rule: str, block_type: type | None = None,
              models: str = MODELS) -> None:
    """Refuse a timm ViT whose blocks hold a module ``rule`` is not defined on here (query/key norms, gated or
    GLU MLPs, RMS norms, attention pooling, parallel or post-norm blocks).

    Example:
        >>> import timm
        >>> from vitcam_nb.adapters import find_adapter
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1, qk_norm=True)
        >>> check_vit(m, find_adapter(m), "attnlrp")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: rule: rule='attnlrp' is defined here for ...
    """
    from timm.layers import Mlp
    from timm.models.vision_transformer import Block

    block_type = block_type or Block
    blocks = adapter.blocks(model)
    where = f"rule: rule={rule!r} is defined here for {models};"
    for i, blk in enumerate(blocks):
        if type(blk) is not block_type:
            raise TraceError(f"{where} block {i} is a {type(blk).__name__}, not timm's pre-norm Block")
        if type(blk.mlp) is not Mlp or gelu_variant(blk.mlp.act) is None:
            raise TraceError(f"{where} block {i}'s MLP is a {type(blk.mlp).__name__} with "
                             f"{type(getattr(blk.mlp, 'act', None)).__name__}, not an Mlp with a GELU")
        for name in ("norm1", "norm2"):
            if not isinstance(getattr(blk, name), torch.nn.LayerNorm):
                raise TraceError(f"{where} block {i}'s {name} is a {type(getattr(blk, name)).__name__}, not a "
                                 "LayerNorm")
    if block_type is Block and not timm_qkv_sites(blocks):
        raise TraceError(f"{where} this model's attention is not timm's plain Attention (it has query/key norms, "
                         "an output norm or a gate)")
    if getattr(model, "attn_pool", None) is not None:
        raise TraceError(f"{where} this model pools with an attention head (global_pool='map')")
    for name in ("norm", "fc_norm"):
        norm = getattr(model, name, None)
        if norm is not None and not isinstance(norm, (torch.nn.LayerNorm, torch.nn.Identity)):
            raise TraceError(f"{where} the model's {name} is a {type(norm).__name__}, not a LayerNorm")


@contextlib.contextmanager
def rule_hooks(model: torch.nn.Module, adapter: Adapter, *, attention: str, gelu: str,
               scores_half: str = "qk", product_out: str = "proj") -> Iterator[None]:
    """The hooks of one rule (``attention``: "constant" or "uniform"; ``gelu``: "identity" or "gate"), removed on
    exit, also on error. ``scores_half``: where the uniform rule halves the gradient of ``q k^T``: on the outputs
    of ``q_norm`` and ``k_norm`` ("qk"), or where the softmax leaves, before ``attn_drop`` ("softmax": the same
    gradients at q, k and everything before them; the pre-softmax scores then carry half the rule's gradient).
    ``product_out``: the attention's submodule whose input is ``A @ V`` with the heads concatenated (``proj``;
    EVA's sub-LayerNorm ``norm``, which comes before its ``proj``).

    Example:
        >>> import timm
        >>> from vitcam_nb.adapters import find_adapter
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1)
        >>> with rule_hooks(m, find_adapter(m), attention="constant", gelu="gate"):
        ...     len(m.blocks[0].attn.attn_drop._forward_pre_hooks)
        1
        >>> len(m.blocks[0].attn.attn_drop._forward_pre_hooks)
        0
    """
    with removable_hooks() as handles:
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                handles.append(module.register_forward_hook(layer_norm_hook, prepend=True))
        for blk in adapter.blocks(model):
            handles.append(blk.mlp.act.register_forward_hook(partial(activation_hook, gelu), prepend=True))
            attn = blk.attn
            if attention == "constant":
                handles.append(attn.attn_drop.register_forward_pre_hook(constant_input))
                continue
            if scores_half == "qk":
                handles.append(attn.q_norm.register_forward_hook(half_output, prepend=True))
                handles.append(attn.k_norm.register_forward_hook(half_output, prepend=True))
            else:  # no module holds q and k: halve the gradient entering the softmax, which halves it at q and k
                handles.append(attn.attn_drop.register_forward_pre_hook(half_input))
            handles.append(getattr(attn, product_out).register_forward_pre_hook(half_input, prepend=True))
        yield


def vit_impl(rule: str, *, attention: str, gelu: str) -> RuleImpl:
    """Rule ``rule`` on the ViT family with the given attention and GELU treatment (see :func:`rule_hooks`).

    Example:
        >>> vit_impl("cp_lrp", attention="constant", gelu="identity").family
        'vit'
    """
    return RuleImpl("vit", partial(check_vit, rule=rule), partial(rule_hooks, attention=attention, gelu=gelu), MODELS)
