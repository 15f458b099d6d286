"""Backward rules (``vc.trace(..., rule=...)``): the registry (:mod:`~vitcam_nb.capture.rules.base`), the
forward-neutral gradient substitutions (:mod:`~vitcam_nb.capture.rules.grad`), one module per rule (its name, text
and citation stated in :mod:`vitcam_nb.core.rules`, its implementations registered here) and the per-family hook
modules they build on. Every module of this package is imported when the package is (a walk of the package, no
list to edit): a new rule is one new module that calls :func:`~vitcam_nb.core.rules.define_rule` and
:func:`register_rule` at its bottom.

Example:
    >>> from vitcam_nb.core.rules import rule_names
    >>> "chefer_lrp" in rule_names()
    True
"""

import importlib
import pkgutil

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
    unregister_rule,
)

__all__ = ["RuleImpl", "check_rule_for", "check_rule_target", "register_refusal", "register_rule", "rule_context",
           "rule_extra_grads", "rule_extra_names", "rule_families", "unregister_rule"]

# Sorted by name, so every process registers in one order (a rule's place in rule_names() is its declared order).
for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_module.name}")
