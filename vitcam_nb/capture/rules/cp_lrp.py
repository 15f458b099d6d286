"""Backward rule ``cp_lrp`` (CP-LRP): its text and citation, and its implementation on every family of
:mod:`vitcam_nb.capture.rules.families` (attention "constant", GELU "identity", LayerNorm's standard deviation a
constant). ``cp_lrp_rule`` is its rule-only spelling (``cp_lrp`` also names a channel weighting).

Example:
    >>> from vitcam_nb.capture.rules import rule_families
    >>> "vit" in rule_families("cp_lrp")
    True
"""

from __future__ import annotations

from vitcam_nb.capture.rules.families import register_on_families
from vitcam_nb.core.rules import define_rule

__all__ = ["RULE"]

RULE = "cp_lrp"

define_rule(
    RULE,
    "conservative propagation: the softmax attention A treated as a constant (no gradient into q k^T; the "
    "gradient at A itself is still stored), LayerNorm's standard deviation treated as a constant, GELU by the "
    "identity rule (gradient gelu(x)/x), every other layer by its gradient",
    "Ali et al. 2022, XAI for Transformers: Better Explanations through Conservative Propagation, ICML; as lxt "
    "configures CP-LRP for vision transformers (lxt.efficient, models/vit_torch.py: identity rule on GELU)",
    order=10, aliases=("cp_lrp_rule",), replace=True)
register_on_families(RULE, attention="constant", gelu="identity")
