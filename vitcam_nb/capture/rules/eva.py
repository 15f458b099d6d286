"""The backward rules on timm's ``Eva`` family (EVA-01, the SBB RoPE ViTs and every ``Eva`` with a GELU ``Mlp``):
the hooks of the ViT family (:mod:`vitcam_nb.capture.rules.vit`), with AttnLRP's halving for ``A @ V`` on the input
of the attention's sub-LayerNorm ``attn.norm`` (an Identity unless ``scale_attn_inner``), which comes before its
``proj``. The rotary position embedding rotates q and k by constant angles (a linear map held by the model, no
gradient of its own), so halving the gradient at ``q_norm``'s and ``k_norm``'s outputs halves it at the rotated q
and k. The layer scales ``gamma_1``/``gamma_2`` are constant factors.

EVA-02 and the other models with a SwiGLU MLP, query/key norms, a gated attention, post-norm blocks or the
``rope`` attention type are refused by name: the rules are implemented here for the GELU MLP and the plain EVA
attention only.

Example:
    >>> from timm.models.eva import Eva
    >>> from vitcam_nb.adapters import find_adapter
    >>> from vitcam_nb.capture.rules import check_rule_for
    >>> m = Eva(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, use_rot_pos_emb=True)
    >>> check_rule_for("libragrad", m, find_adapter(m))
    'libragrad'
"""

from __future__ import annotations

from functools import partial

import torch

from vitcam_nb.adapters.base import Adapter
from vitcam_nb.capture.rules.base import RuleImpl
from vitcam_nb.capture.rules.vit import check_vit, rule_hooks
from vitcam_nb.core.errors import TraceError

__all__ = ["check_eva", "eva_impl"]

MODELS = ("timm Eva with pre-norm EvaBlocks, the plain EVA attention (no query/key norm, no gate) and a GELU Mlp: "
          "eva_giant_*, vit_*_rope_* (not EVA-02's SwiGLU)")


def check_eva(model: torch.nn.Module, adapter: Adapter, rule: str) -> None:
    """Refuse an EVA whose blocks hold a module ``rule`` is not defined on here (a SwiGLU or GLU MLP, query/key
    norms, a gated or ``rope``-type attention, an RMS norm, post-norm blocks, attention pooling).

    Example:
        >>> import timm
        >>> from vitcam_nb.adapters import find_adapter
        >>> m = timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=28, depth=1)
        >>> check_eva(m, find_adapter(m), "cp_lrp")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: rule: rule='cp_lrp' is defined here for timm Eva ...; block 0's MLP is a SwiGLU ...
    """
    from timm.models.eva import EvaAttention, EvaBlock

    check_vit(model, adapter, rule, EvaBlock, MODELS)
    where = f"rule: rule={rule!r} is defined here for {MODELS};"
    for i, blk in enumerate(adapter.blocks(model)):
        attn = blk.attn
        if type(attn) is not EvaAttention:
            raise TraceError(f"{where} block {i}'s attention is a {type(attn).__name__}, not EvaAttention")
        if not (isinstance(attn.q_norm, torch.nn.Identity) and isinstance(attn.k_norm, torch.nn.Identity)):
            raise TraceError(f"{where} block {i}'s attention has query/key norms")
        if attn.gate is not None:
            raise TraceError(f"{where} block {i}'s attention has a sigmoid gate (a product of two input-dependent "
                             "tensors before proj)")
        if not isinstance(attn.norm, (torch.nn.Identity, torch.nn.LayerNorm)):
            raise TraceError(f"{where} block {i}'s attention sub-norm is a {type(attn.norm).__name__}, not a "
                             "LayerNorm")
        mlp_norm = getattr(blk.mlp, "norm", torch.nn.Identity())
        if not isinstance(mlp_norm, (torch.nn.Identity, torch.nn.LayerNorm)):
            raise TraceError(f"{where} block {i}'s MLP norm is a {type(mlp_norm).__name__}, not a LayerNorm")


def eva_impl(rule: str, *, attention: str, gelu: str) -> RuleImpl:
    """Rule ``rule`` on the EVA family with the given attention and GELU treatment.

    Example:
        >>> eva_impl("libragrad", attention="constant", gelu="gate").family
        'eva'
    """
    return RuleImpl("eva", partial(check_eva, rule=rule),
                    partial(rule_hooks, attention=attention, gelu=gelu, product_out="norm"), MODELS)
