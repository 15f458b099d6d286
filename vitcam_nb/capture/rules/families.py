"""The model families that the decomposition rules (CP-LRP, AttnLRP, LibraGrad) run on, in one call: each of those
rules is the same three choices (how the softmax attention, the GELU and LayerNorm take the gradient) made on every
family's modules, so its module states the choices and this builds one implementation per family.

Example:
    >>> [i.family for i in lrp_family_impls("cp_lrp", attention="constant", gelu="identity")][:3]
    ['vit', 'beit', 'eva']
"""

from __future__ import annotations

from vitcam_nb.capture.rules.base import RuleImpl, register_rule
from vitcam_nb.capture.rules.beit import beit_impl
from vitcam_nb.capture.rules.eva import eva_impl
from vitcam_nb.capture.rules.hf import hf_impls
from vitcam_nb.capture.rules.open_clip import open_clip_impl
from vitcam_nb.capture.rules.vit import vit_impl

__all__ = ["lrp_family_impls", "register_on_families"]


def lrp_family_impls(rule: str, *, attention: str, gelu: str) -> list[RuleImpl]:
    """One implementation of ``rule`` per family (timm ViT, BEiT, EVA, the Hugging Face ViTs, open_clip):
    ``attention`` "constant" (the softmax matrix a constant) or "uniform" (half the gradient to each operand of
    ``q k^T`` and ``A V``); ``gelu`` "identity" (gradient gelu(x)/x) or "gate" (the gate detached). Every family
    treats LayerNorm's standard deviation as a constant.

    Example:
        >>> len(lrp_family_impls("attnlrp", attention="uniform", gelu="identity")) >= 5
        True
    """
    return [vit_impl(rule, attention=attention, gelu=gelu), beit_impl(rule, attention=attention, gelu=gelu),
            eva_impl(rule, attention=attention, gelu=gelu), *hf_impls(rule, attention=attention, gelu=gelu),
            open_clip_impl(rule, attention=attention, gelu=gelu)]


def register_on_families(rule: str, *, attention: str, gelu: str) -> None:
    """Register :func:`lrp_family_impls` as rule ``rule`` (replacing what a reloaded module registered before).

    Example:
        >>> register_on_families("cp_lrp", attention="constant", gelu="identity")
    """
    for impl in lrp_family_impls(rule, attention=attention, gelu=gelu):
        register_rule(rule, impl, replace=True)
