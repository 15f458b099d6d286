"""Backward rules (``vc.trace(..., rule=...)``): the registry (:mod:`~vitcam_nb.capture.rules.base`), the
forward-neutral gradient substitutions (:mod:`~vitcam_nb.capture.rules.grad`) and one module per model family
(importing this package registers them). Names, descriptions and citations: :mod:`vitcam_nb.core.rules`.
"""

from vitcam_nb.capture.rules import (  # noqa: F401  (each registers its family's rules)
    beit,
    chefer,
    eva,
    hf,
    open_clip,
    swin,
    vit,
)
from vitcam_nb.capture.rules.base import (
    RuleImpl,
    check_rule_for,
    check_rule_target,
    register_refusal,
    register_rule,
    rule_context,
    rule_extra_grads,
    rule_extra_names,
    rule_families,
)

__all__ = ["RuleImpl", "check_rule_for", "check_rule_target", "register_refusal", "register_rule", "rule_context",
           "rule_extra_grads", "rule_extra_names", "rule_families"]
