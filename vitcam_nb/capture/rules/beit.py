"""The backward rules on timm's ``Beit`` family (BEiT v1/v2): the hooks of the ViT family
(:mod:`vitcam_nb.capture.rules.vit`), with AttnLRP's uniform rule on ``q k^T`` applied where the softmax leaves
(BEiT computes q and k inside its attention with no module of their own; the relative position bias added to the
scores is a constant and takes no gradient). The layer scales ``gamma_1``/``gamma_2`` are constant factors.

Example:
    >>> import timm
    >>> from vitcam_nb.adapters import find_adapter
    >>> from vitcam_nb.capture.rules import check_rule_for
    >>> m = timm.create_model("beit_base_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
    >>> check_rule_for("attnlrp", m, find_adapter(m))
    'attnlrp'
"""

from __future__ import annotations

from functools import partial

import torch

from vitcam_nb.adapters.base import Adapter
from vitcam_nb.capture.rules.base import RuleImpl
from vitcam_nb.capture.rules.vit import check_vit, rule_hooks
from vitcam_nb.core.errors import TraceError

__all__ = ["beit_impl", "check_beit"]

MODELS = "timm Beit: beit_*, beitv2_* with a GELU Mlp"


def check_beit(model: torch.nn.Module, adapter: Adapter, rule: str) -> None:
    """Refuse a BEiT whose blocks hold a module ``rule`` is not defined on here (a SwiGLU MLP, another norm).

    Example:
        >>> import timm
        >>> from vitcam_nb.adapters import find_adapter
        >>> m = timm.create_model("beit_base_patch16_224", pretrained=False, depth=1, swiglu_mlp=True)
        >>> check_beit(m, find_adapter(m), "cp_lrp")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: rule: rule='cp_lrp' is defined here for timm Beit ...
    """
    from timm.models.beit import Attention, Block

    check_vit(model, adapter, rule, Block, MODELS)
    for i, blk in enumerate(adapter.blocks(model)):
        if type(blk.attn) is not Attention:
            raise TraceError(f"rule: rule={rule!r} is defined here for {MODELS}; block {i}'s attention is a "
                             f"{type(blk.attn).__name__}")


def beit_impl(rule: str, *, attention: str, gelu: str) -> RuleImpl:
    """Rule ``rule`` on the BEiT family with the given attention and GELU treatment.

    Example:
        >>> beit_impl("attnlrp", attention="uniform", gelu="identity").family
        'beit'
    """
    return RuleImpl("beit", partial(check_beit, rule=rule),
                    partial(rule_hooks, attention=attention, gelu=gelu, scores_half="softmax"), MODELS)
