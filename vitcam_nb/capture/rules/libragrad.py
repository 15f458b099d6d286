"""Backward rule ``libragrad`` (LibraGrad): its text and citation, and its implementation on every family of
:mod:`vitcam_nb.capture.rules.families` (attention "constant", GELU "gate", LayerNorm's standard deviation a
constant). ``libragrad_rule`` is its rule-only spelling (``libragrad`` also names a channel weighting).

Example:
    >>> from vitcam_nb.capture.rules import rule_families
    >>> "vit" in rule_families("libragrad")
    True
"""

from __future__ import annotations

from vitcam_nb.capture.rules.families import register_on_families
from vitcam_nb.core.rules import define_rule

__all__ = ["RULE"]

RULE = "libragrad"

define_rule(
    RULE,
    "LibraGrad: the softmax attention A treated as a constant (the gradient path through softmax pruned), "
    "LayerNorm's standard deviation treated as a constant, GELU's gate detached (x * g(x).detach(), g the "
    "activation's own gate: Phi(x), its tanh approximation, or sigmoid(1.702 x) for the quick GELU), every other "
    "layer by its gradient",
    "Mehri, Soleymani Baghshah & Pilehvar 2025, LibraGrad: Balancing Gradient Flow for Universally Better "
    "Vision Transformer Attributions, CVPR; official code github.com/NightMachinery/pytorch-image-models-"
    "libragrad-v1 (timm/night/decomposition.py)",
    order=30, aliases=("libragrad_rule",), replace=True)
register_on_families(RULE, attention="constant", gelu="gate")
