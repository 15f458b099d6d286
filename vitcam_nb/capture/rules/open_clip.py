"""The backward rules on open_clip's image towers (``VisionTransformer`` blocks with ``nn.MultiheadAttention``).

During a trace the open_clip adapter runs each block's attention explicitly and passes q, k and the softmax
matrix through identity modules of their own (``attn.attn_q``, ``attn.attn_k``, ``attn.attn_probs``;
:mod:`vitcam_nb.adapters.open_clip`); the rule context is entered after the adapter's, so its hooks go on them:

- LayerNorm (every ``nn.LayerNorm`` of the image tower: ``ln_pre``, ``ln_1``, ``ln_2``, ``ln_post``): standard
  deviation constant (cp_lrp, attnlrp, libragrad);
- the MLP's activation (``mlp.gelu``: GELU or CLIP's quick GELU ``x * sigmoid(1.702 x)``): the identity rule
  (cp_lrp, attnlrp) or the gate detached (libragrad; the quick GELU's gate is ``sigmoid(1.702 x)``);
- attention, constant (cp_lrp, libragrad): the softmax matrix enters ``attn_probs`` as a new leaf (site F2, its
  gradient stored; nothing into ``q k^T``);
- attention, uniform (attnlrp): half the gradient into ``attn_q``'s and ``attn_k``'s outputs (after the sites q
  and k read them, so those sites hold the halved gradient, as on timm) and into ``out_proj``'s input (F3 holds
  the product's gradient). The layer scales ``ls_1``/``ls_2`` and the projection ``proj`` are constant factors.

Example:
    >>> import open_clip  # doctest: +SKIP
    >>> from vitcam_nb.adapters import find_adapter  # doctest: +SKIP
    >>> from vitcam_nb.capture.rules import check_rule_for  # doctest: +SKIP
    >>> check_rule_for("attnlrp", clip_model, find_adapter(clip_model))  # doctest: +SKIP
    'attnlrp'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch

from vitcam_nb.adapters.base import Adapter
from vitcam_nb.adapters.open_clip import PROBS_MODULE, QKV_MODULES, visual_tower
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

__all__ = ["check_open_clip", "open_clip_hooks", "open_clip_impl"]

MODELS = ("open_clip VisionTransformer with nn.MultiheadAttention blocks, a GELU or quick-GELU MLP and token or "
          "average pooling (ViT-* CLIP models; no attentional pooler)")


def check_open_clip(model: torch.nn.Module, adapter: Adapter, rule: str) -> None:
    """Refuse an open_clip tower holding a module ``rule`` is not defined on here (a custom attention block,
    another activation or norm, cross-attention, an attentional pooler).

    Example:
        >>> check_open_clip(clip_model, find_adapter(clip_model), "cp_lrp")  # doctest: +SKIP
    """
    where = f"rule: rule={rule!r} is defined here for {MODELS};"
    tower = visual_tower(model)
    for i, blk in enumerate(adapter.blocks(model)):
        if type(blk).__name__ != "ResidualAttentionBlock" or not isinstance(blk.attn, torch.nn.MultiheadAttention):
            raise TraceError(f"{where} block {i} is a {type(blk).__name__} with {type(blk.attn).__name__}")
        if hasattr(blk, "ln_1_kv"):
            raise TraceError(f"{where} block {i} is a cross-attention block")
        for name in ("ln_1", "ln_2"):
            if not isinstance(getattr(blk, name), torch.nn.LayerNorm):
                raise TraceError(f"{where} block {i}'s {name} is a {type(getattr(blk, name)).__name__}, not a "
                                 "LayerNorm")
        act = getattr(blk.mlp, "gelu", None)
        if act is None or gelu_variant(act) is None:
            raise TraceError(f"{where} block {i}'s MLP activation is a {type(act).__name__}, not a GELU")
    if getattr(tower, "attn_pool", None) is not None:
        raise TraceError(f"{where} this tower pools with an attentional pooler (attn_pool)")
    for name in ("ln_pre", "ln_post"):
        norm = getattr(tower, name, None)
        if norm is not None and not isinstance(norm, (torch.nn.LayerNorm, torch.nn.Identity)):
            raise TraceError(f"{where} the tower's {name} is a {type(norm).__name__}, not a LayerNorm")


@contextlib.contextmanager
def open_clip_hooks(model: torch.nn.Module, adapter: Adapter, *, attention: str, gelu: str) -> Iterator[None]:
    """The hooks of one rule on an open_clip tower whose attention runs explicitly (inside the adapter's
    ``patched``), removed on exit, also on error.

    Example:
        >>> hooks = open_clip_hooks(clip_model, find_adapter(clip_model), attention="constant",  # doctest: +SKIP
        ...                         gelu="gate")
        >>> with hooks:  # doctest: +SKIP
        ...     pass
    """
    with removable_hooks() as handles:
        for module in visual_tower(model).modules():
            if isinstance(module, torch.nn.LayerNorm):
                handles.append(module.register_forward_hook(layer_norm_hook, prepend=True))
        for blk in adapter.blocks(model):
            handles.append(blk.mlp.gelu.register_forward_hook(partial(activation_hook, gelu), prepend=True))
            attn = blk.attn
            if attention == "constant":
                handles.append(getattr(attn, PROBS_MODULE).register_forward_pre_hook(constant_input))
                continue
            for site in ("q", "k"):  # appended: the capture's q/k sites read the tensors before the halving
                handles.append(getattr(attn, QKV_MODULES[site]).register_forward_hook(half_output))
            handles.append(attn.out_proj.register_forward_pre_hook(half_input, prepend=True))
        yield


def open_clip_impl(rule: str, *, attention: str, gelu: str) -> RuleImpl:
    """Rule ``rule`` on the open_clip family with the given attention and GELU treatment.

    Example:
        >>> open_clip_impl("cp_lrp", attention="constant", gelu="identity").family
        'open_clip'
    """
    return RuleImpl("open_clip", partial(check_open_clip, rule=rule),
                    partial(open_clip_hooks, attention=attention, gelu=gelu), MODELS)
