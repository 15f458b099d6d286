"""Backward rules (the trace argument ``rule``): their names, what each changes in the backward pass, and where it
comes from. The implementations live in the capture layer (:mod:`vitcam_nb.capture.rules`), registered per model
family; this table is what records, checklists and error messages read.

A rule changes only the backward pass: the forward pass, the logits and every stored activation stay those of
the model. The stored gradients are then the rule's modified gradients, and input x modified gradient is the
relevance of layer-wise relevance propagation (LRP) in its gradient x input form.

Example:
    >>> rule_names()
    ['gradient', 'cp_lrp', 'attnlrp', 'libragrad', 'chefer_lrp']
    >>> check_rule("attnlrp")
    'attnlrp'
"""

from __future__ import annotations

from dataclasses import dataclass

from vitcam_nb.core.errors import TraceError

__all__ = ["DEFAULT_RULE", "LRP_PATENT_NOTE", "RULES", "RuleInfo", "check_rule", "rule_items", "rule_names",
           "rule_sentence", "rule_text"]

#: The rule of a plain trace: autograd's own gradient (nothing substituted).
DEFAULT_RULE = "gradient"

#: What lxt's README states about LRP, repeated wherever the LRP rules are offered.
LRP_PATENT_NOTE = ("LRP's authors state in lxt's README that LRP is patented and free for personal and scientific "
                   "use (github.com/rachtibat/LRP-eXplains-Transformers)")


@dataclass(frozen=True)
class RuleInfo:
    """One backward rule: what it substitutes (``description``) and its source (``citation``).

    Example:
        >>> RULES["cp_lrp"].citation[:9]
        'Ali et al'
    """

    description: str
    citation: str


RULES: dict[str, RuleInfo] = {
    "gradient": RuleInfo("autograd's gradient, nothing substituted", "none (plain backpropagation)"),
    "cp_lrp": RuleInfo(
        "conservative propagation: the softmax attention A treated as a constant (no gradient into q k^T; the "
        "gradient at A itself is still stored), LayerNorm's standard deviation treated as a constant, GELU by the "
        "identity rule (gradient gelu(x)/x), every other layer by its gradient",
        "Ali et al. 2022, XAI for Transformers: Better Explanations through Conservative Propagation, ICML; as lxt "
        "configures CP-LRP for vision transformers (lxt.efficient, models/vit_torch.py: identity rule on GELU)"),
    "attnlrp": RuleInfo(
        "AttnLRP: LayerNorm's standard deviation treated as a constant, GELU by the identity rule (gradient "
        "gelu(x)/x), the products q k^T and A V by the uniform rule (half the gradient to each operand), softmax "
        "by its gradient (AttnLRP's softmax rule in gradient x input form), every other layer by its gradient",
        "Achtibat et al. 2024, AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers, ICML; "
        "official package lxt (lxt.efficient rules: identity_rule_implicit, divide_gradient, stop_gradient)"),
    "libragrad": RuleInfo(
        "LibraGrad: the softmax attention A treated as a constant (the gradient path through softmax pruned), "
        "LayerNorm's standard deviation treated as a constant, GELU's gate detached (x * Phi(x).detach(): "
        "gradient Phi(x)), every other layer by its gradient",
        "Mehri, Soleymani Baghshah & Pilehvar 2025, LibraGrad: Balancing Gradient Flow for Universally Better "
        "Vision Transformer Attributions, CVPR; official code github.com/NightMachinery/pytorch-image-models-"
        "libragrad-v1 (timm/night/decomposition.py)"),
    "chefer_lrp": RuleInfo(
        "Chefer et al.'s LRP relevance pass: the backward carries relevance, not a gradient, from the one-hot of "
        "the class (the stored 'gradient' at every site IS the LRP relevance there): Linear layers by "
        "LRP-alpha1-beta0 (bias left out), LayerNorm, GELU, softmax and dropout pass relevance unchanged, the "
        "products q k^T and A V by the z-rule with half the relevance to each operand, each residual sum split in "
        "proportion to its operands and rescaled to keep the sum, relevance at a fork summed",
        "Chefer, Gur & Wolf 2021, Transformer Interpretability Beyond Attention Visualization, CVPR; official code "
        "github.com/hila-chefer/Transformer-Explainability (baselines/ViT/ViT_LRP.py, layers_ours.py)"),
}


def rule_names() -> list[str]:
    """Every backward rule a trace may use, the default first.

    Example:
        >>> rule_names()[0]
        'gradient'
    """
    return list(RULES)


def check_rule(rule: object) -> str:
    """``rule`` if it names a backward rule, else a :class:`TraceError` listing the allowed names.

    Example:
        >>> check_rule("lrp")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: rule: unknown backward rule 'lrp'; allowed: ['gradient', 'cp_lrp', 'attnlrp', 'libragrad', ...]
    """
    if not isinstance(rule, str) or rule not in RULES:
        raise TraceError(f"rule: unknown backward rule {rule!r}; allowed: {rule_names()}")
    return rule


def rule_text(rule: str) -> str:
    """The rule as the checklist states it: name, what it substitutes, citation (a name this version does not
    know, e.g. from a newer file, is stated as such).

    Example:
        >>> rule_text("gradient")
        "gradient: autograd's gradient, nothing substituted (none (plain backpropagation))"
    """
    info = RULES.get(rule)
    if info is None:
        return f"{rule} (a backward rule this vitcam_nb does not know)"
    return f"{rule}: {info.description} ({info.citation})"


def rule_items(attrs: dict) -> dict[str, str]:
    """The checklist's gradient-target item of a trace's rule: only a rule trace has one, so the checklist of every
    gradient trace stays what it was.

    Example:
        >>> rule_items({})
        {}
        >>> rule_items({"backward_rule": "attnlrp"})["backward rule"][:8]
        'attnlrp:'
    """
    rule = attrs.get("backward_rule")
    return {"backward rule": rule_text(str(rule))} if rule else {}


def rule_sentence(items: dict) -> str:
    """The methods paragraph's clause for a checklist's gradient-target ``items`` ("" without a rule).

    Example:
        >>> rule_sentence({"backward rule": "cp_lrp: ..."})
        '; backward rule cp_lrp: ...'
    """
    return f"; backward rule {items['backward rule']}" if "backward rule" in items else ""
