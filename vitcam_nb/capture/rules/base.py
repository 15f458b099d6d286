"""The registry of backward-rule implementations: for each rule of :data:`vitcam_nb.core.rules.RULES`, one
implementation per model family that has one, or one for every model its ``applies`` accepts (a family wildcard,
e.g. "every model whose blocks use torch.nn.LayerNorm"), each with a check (the model's modules are those the rule
is defined on) and a context manager that substitutes the backward pass while the trace's one pass runs.

A rule context must leave the forward values unchanged and restore the model exactly on exit, also on error: the
implementations here only add hooks (removed on exit) whose outputs carry the rule's gradient through forward-
neutral detach tricks (:mod:`vitcam_nb.capture.rules.grad`).

Example:
    >>> import timm
    >>> from vitcam_nb.adapters import find_adapter
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1)
    >>> check_rule_for("attnlrp", m, find_adapter(m))
    'attnlrp'
    >>> rule_families("cp_lrp")[:4], "open_clip" in rule_families("cp_lrp")
    (['vit', 'beit', 'eva', 'hf_vit'], True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass

import torch

from vitcam_nb.adapters.base import Adapter
from vitcam_nb.core.errors import ArgumentError, TraceError
from vitcam_nb.core.rules import DEFAULT_RULE, check_rule, define_rule, rule_names, undefine_rule  # noqa: F401

__all__ = ["RuleImpl", "check_rule_for", "check_rule_target", "register_refusal", "register_rule", "rule_context",
           "rule_extra_grads", "rule_extra_names", "rule_families", "unregister_rule"]


@dataclass(frozen=True)
class RuleImpl:
    """How one rule runs on one model family.

    ``check(model, adapter)`` raises :class:`~vitcam_nb.core.errors.TraceError` when the model has a module the
    rule is not defined on; ``context(model, adapter)`` is the context manager the pass runs inside.
    ``models`` names the models of the family it covers, for error messages. ``extra_grads``, if given, runs
    after the forward pass and before the pass's own backward, inside the rule's context: ``extra_grads(outputs,
    tensors)`` may run its own batched backward passes over the retained graph
    (:func:`vitcam_nb.capture.backward.batched_grad` with ``retain_graph=True``) and returns
    ``{variable name: {(layer, site): (targets, batch, ...) tensor}}``, stored beside the site's gradient (e.g.
    ``chefer_lrp``'s plain gradient at F2, ``attn_plain_grad``).

    Example:
        >>> RuleImpl("vit", lambda m, a: None, lambda m, a: contextlib.nullcontext(), "timm ViT").family
        'vit'
    """

    family: str
    check: Callable[[torch.nn.Module, Adapter], None]
    context: Callable[[torch.nn.Module, Adapter], ContextManager]
    models: str = ""
    extra_grads: Callable[[torch.Tensor, dict], dict[str, dict]] | None = None
    #: the variables ``extra_grads`` stores, each shaped like the F2 gradient (for the memory estimate)
    extra_names: tuple[str, ...] = ()
    #: ``check_target(target)`` raises :class:`~vitcam_nb.core.errors.TraceError` for a target the rule's backward
    #: does not define (None: every target the family takes)
    check_target: Callable[[object], None] | None = None
    #: a family wildcard: ``applies(model, adapter)`` says whether this implementation covers a model of any family
    #: (``family`` then only labels it in messages). A family's own implementation of the rule is picked first.
    applies: Callable[[torch.nn.Module, Adapter], bool] | None = None


# rule name -> family -> implementation
_IMPLS: dict[str, dict[str, RuleImpl]] = {}
# family -> why no rule is implemented for it, stated in its refusal
_REFUSALS: dict[str, str] = {}


def register_rule(rule: str, impl: RuleImpl, *, replace: bool = False) -> None:
    """Register ``impl`` as rule ``rule`` (a name of :data:`vitcam_nb.core.rules.RULES`) on its family.

    Example:
        >>> impl = RuleImpl("demo", lambda m, a: None, lambda m, a: contextlib.nullcontext())
        >>> register_rule("cp_lrp", impl)
        >>> "demo" in rule_families("cp_lrp")
        True
        >>> del _IMPLS["cp_lrp"]["demo"]
    """
    rule = check_rule(rule)
    if rule == DEFAULT_RULE:
        raise ArgumentError(f"rule: {DEFAULT_RULE!r} is autograd's own gradient and takes no implementation")
    if impl.applies is not None and (impl.extra_grads or impl.extra_names or impl.check_target):
        # extra_grads, extra_names and check_target are looked up from the adapter alone, before a model is at hand
        raise ArgumentError("impl: a wildcard implementation (applies=...) takes no extra_grads, extra_names or "
                            "check_target; register those per family")
    table = _IMPLS.setdefault(rule, {})
    if impl.family in table and not replace:
        raise ArgumentError(f"rule: {rule!r} already has an implementation for family {impl.family!r}; pass "
                            "replace=True to replace it")
    table[impl.family] = impl


def unregister_rule(rule: str) -> None:
    """Remove every implementation of rule ``rule`` and its definition (:func:`vitcam_nb.core.rules.undefine_rule`):
    what a module that defined and registered a rule at run time calls to undo it (examples and tests).

    Example:
        >>> _ = define_rule("demo_rule", "nothing", "none")
        >>> register_rule("demo_rule", RuleImpl("demo", lambda m, a: None, lambda m, a: contextlib.nullcontext()))
        >>> unregister_rule("demo_rule"); rule_families("cp_lrp") != [] and "demo_rule" not in rule_names()
        True
    """
    name = check_rule(rule)
    undefine_rule(name)  # refuses the default rule before anything is removed
    _IMPLS.pop(name, None)


def register_refusal(family: str, reason: str) -> None:
    """State ``reason`` when a model of ``family`` is traced with a rule that has no implementation for it.

    Example:
        >>> register_refusal("demo", "its attention is not softmax attention")
        >>> "demo" in _REFUSALS
        True
        >>> del _REFUSALS["demo"]
    """
    _REFUSALS[family] = reason


def _impl(rule: str, adapter: Adapter, model: torch.nn.Module | None = None) -> RuleImpl | None:
    """The implementation of ``rule`` for ``adapter``'s family, else (with a ``model``) the first wildcard one
    whose ``applies`` accepts it."""
    impls = _IMPLS.get(rule, {})
    impl = impls.get(getattr(adapter, "family", None))
    if impl is not None and impl.applies is None:
        return impl
    if model is None:
        return None
    return next((i for i in impls.values() if i.applies is not None and i.applies(model, adapter)), None)


def rule_families(rule: str) -> list[str]:
    """The model families rule ``rule`` is implemented for.

    Example:
        >>> rule_families("gradient")
        []
    """
    return list(_IMPLS.get(check_rule(rule), {}))


def check_rule_for(rule: object, model: torch.nn.Module, adapter: Adapter) -> str:
    """``rule`` checked before any model call: a known name, implemented for the model's family, and defined on
    its modules; else a :class:`~vitcam_nb.core.errors.TraceError` that names what is allowed.

    Example:
        >>> check_rule_for("gradient", torch.nn.Linear(1, 1), None)
        'gradient'
    """
    rule = check_rule(rule)
    if rule == DEFAULT_RULE:
        return rule
    impls = _IMPLS.get(rule, {})
    impl = _impl(rule, adapter, model)
    if impl is None:
        covered = "; ".join(f"{f} ({i.models})" if i.models else f for f, i in impls.items()) or "no family"
        reason = f": {_REFUSALS[adapter.family]}" if adapter.family in _REFUSALS else ""
        raise TraceError(f"rule: rule={rule!r} is defined for {covered}; the {adapter.family} family "
                         f"({type(model).__name__}) is not supported{reason}. Trace it with rule='gradient'")
    impl.check(model, adapter)
    return rule


def rule_context(rule: str, model: torch.nn.Module, adapter: Adapter) -> ContextManager:
    """The context the pass runs inside for ``rule`` (nothing at all for ``"gradient"``).

    Example:
        >>> with rule_context("gradient", torch.nn.Linear(1, 1), None):
        ...     pass
    """
    rule = check_rule(rule)
    if rule == DEFAULT_RULE:
        return contextlib.nullcontext()
    return _impl(rule, adapter, model).context(model, adapter)


def rule_extra_grads(rule: str, adapter: Adapter, outputs: torch.Tensor, tensors: dict) -> dict[str, dict]:
    """The extra gradients rule ``rule`` stores (``{}`` for every rule without them), computed on the pass's
    ``outputs`` (one per target, each differentiated with its own one-hot, as the pass's backward) and its site
    ``tensors``; called inside the rule's context, before the pass's own backward frees the graph.

    Example:
        >>> rule_extra_grads("gradient", None, torch.zeros(2), {})
        {}
    """
    impl = _impl(check_rule(rule), adapter)
    if impl is None or impl.extra_grads is None:
        return {}
    return impl.extra_grads(outputs, tensors)


def check_rule_target(rule: str, target: object, adapter: Adapter) -> None:
    """Refuse, before any model call, a target the rule's backward pass does not define on ``adapter``'s family
    (``chefer_lrp`` starts its relevance from a class's one-hot only).

    Example:
        >>> check_rule_target("gradient", None, None)
    """
    impl = _impl(check_rule(rule), adapter)
    if impl is not None and impl.check_target is not None:
        impl.check_target(target)


def rule_extra_names(rule: str, adapter: Adapter) -> tuple[str, ...]:
    """The extra variables rule ``rule`` stores on ``adapter``'s family, each shaped like the F2 gradient.

    Example:
        >>> rule_extra_names("gradient", None)
        ()
    """
    impl = _impl(check_rule(rule), adapter)
    return impl.extra_names if impl is not None else ()
