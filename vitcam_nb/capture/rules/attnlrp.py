"""Backward rule ``attnlrp`` (AttnLRP): its text and citation, and its implementation on every family of
:mod:`vitcam_nb.capture.rules.families` (attention "uniform", GELU "identity", LayerNorm's standard deviation a
constant). ``attnlrp_rule`` is its rule-only spelling (``attnlrp`` also names a channel weighting).

Example:
    >>> from vitcam_nb.capture.rules import rule_families
    >>> "vit" in rule_families("attnlrp")
    True
"""

from __future__ import annotations

from vitcam_nb.capture.rules.families import register_on_families
from vitcam_nb.core.rules import define_rule

__all__ = ["RULE"]

RULE = "attnlrp"

define_rule(
    RULE,
    "AttnLRP: LayerNorm's standard deviation treated as a constant, GELU by the identity rule (gradient "
    "gelu(x)/x), the products q k^T and A V by the uniform rule (half the gradient to each operand), softmax "
    "by its gradient (AttnLRP's softmax rule in gradient x input form), every other layer by its gradient",
    "Achtibat et al. 2024, AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers, ICML; "
    "official package lxt (lxt.efficient rules: identity_rule_implicit, divide_gradient, stop_gradient)",
    order=20, aliases=("attnlrp_rule",), replace=True)
register_on_families(RULE, attention="uniform", gelu="identity")
