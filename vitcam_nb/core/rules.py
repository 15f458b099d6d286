"""Backward rules (the trace argument ``rule``): their names, what each changes in the backward pass, and where it
comes from. Each rule is one module of :mod:`vitcam_nb.capture.rules` that states its text here
(:func:`define_rule`) and registers its implementation there; the package is walked, so adding a rule edits no
list. This module holds the table that records, checklists and error messages read (:data:`RULES`, a read-only
view that loads the rule modules on first read).

A rule changes only the backward pass: the forward pass, the logits and every stored activation stay those of
the model. The stored gradients are then the rule's modified gradients, and input x modified gradient is the
relevance of layer-wise relevance propagation (LRP) in its gradient x input form.

Names: a rule's name is what a trace stores (``backward_rule``) and what ``rule=`` takes. Three rules share a name
with a channel weighting that reads them out (``cp_lrp``, ``attnlrp``, ``libragrad``); their rule-only spellings
``cp_lrp_rule``, ``attnlrp_rule`` and ``libragrad_rule`` are accepted everywhere ``rule=`` is and normalise to the
stored name (:func:`check_rule`), so traces, checklists and recipe ids are those of the stored name.

Example:
    >>> rule_names()[:5]
    ['gradient', 'cp_lrp', 'attnlrp', 'libragrad', 'chefer_lrp']
    >>> check_rule("attnlrp"), check_rule("attnlrp_rule")
    ('attnlrp', 'attnlrp')
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from vitcam_nb.core.errors import ArgumentError, TraceError

__all__ = ["DEFAULT_RULE", "LRP_PATENT_NOTE", "RULES", "RuleInfo", "check_rule", "define_rule", "fill_rules_from",
           "rule_aliases", "rule_items", "rule_names", "rule_sentence", "rule_text", "undefine_rule"]

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


# name -> (order, info); the rule modules fill it (define_rule) when first read
_INFOS: dict[str, tuple[int, RuleInfo]] = {DEFAULT_RULE: (0, RuleInfo(
    "autograd's gradient, nothing substituted", "none (plain backpropagation)"))}
# alias -> name
_ALIASES: dict[str, str] = {}
# packages whose modules define rules, imported (by name: core imports no higher layer) before the first read
_PENDING: list[str] = []
_LOCK = threading.RLock()


def fill_rules_from(module: str) -> None:
    """Import ``module`` (by name) before the rule table is first read; ``vitcam_nb`` names its rule package here.

    Example:
        >>> fill_rules_from("vitcam_nb.core.errors")
    """
    with _LOCK:
        if module not in _PENDING:
            _PENDING.append(module)


def _infos() -> dict[str, tuple[int, RuleInfo]]:
    with _LOCK:
        while _PENDING:  # popped before importing: the rule modules read the table while they are imported
            module = _PENDING.pop(0)
            try:
                importlib.import_module(module)
            except BaseException:
                _PENDING.insert(0, module)
                raise
    return _INFOS


def define_rule(name: str, description: str, citation: str, *, order: int = 100, aliases: tuple[str, ...] = (),
                replace: bool = False) -> RuleInfo:
    """State rule ``name``: what it substitutes and its source. ``order`` places it in :func:`rule_names` (the
    built-ins take 10..40, ``gradient`` 0; equal orders keep the order of definition); ``aliases`` are other
    spellings :func:`check_rule` accepts and maps to ``name``. A rule module calls this before registering its
    implementation (:func:`vitcam_nb.capture.rules.register_rule`).

    Example:
        >>> info = define_rule("demo_rule", "nothing", "none", aliases=("demo",))
        >>> check_rule("demo"), rule_names()[-1]
        ('demo_rule', 'demo_rule')
        >>> _forget("demo_rule")
    """
    for value, what in ((name, "name"), (description, "description"), (citation, "citation")):
        if not isinstance(value, str) or not value:
            raise ArgumentError(f"{what}: expected a non-empty string, got {value!r}")
    if isinstance(aliases, str) or not all(isinstance(a, str) and a for a in aliases):
        raise ArgumentError(f"aliases: expected a tuple of non-empty strings, got {aliases!r}")
    with _LOCK:
        taken = set(_INFOS) | set(_ALIASES)
        if not replace and (name in taken or any(a in taken for a in aliases)):
            raise ArgumentError(f"name: a backward rule named {name!r} (or one of {list(aliases)}) is defined "
                                "already; pass replace=True to replace it")
        if name == DEFAULT_RULE or name in _ALIASES or any(a in _INFOS or a == name for a in aliases):
            raise ArgumentError(f"name: {name!r} or its aliases {list(aliases)} collide with a rule's name")
        info = RuleInfo(description, citation)
        _INFOS[name] = (order, info)
        _ALIASES.update(dict.fromkeys(aliases, name))
    return info


def undefine_rule(name: str) -> None:
    """Remove rule ``name`` and its aliases from the table (a rule defined at run time: examples and tests undo
    theirs). The default rule stays; an unknown name is refused by name. Its implementations are removed by
    :func:`vitcam_nb.capture.rules.unregister_rule`, which calls this.

    Example:
        >>> _ = define_rule("demo_rule", "nothing", "none")
        >>> undefine_rule("demo_rule"); "demo_rule" in RULES
        False
    """
    if name == DEFAULT_RULE:
        raise ArgumentError(f"name: {DEFAULT_RULE!r} is autograd's own gradient and cannot be removed")
    if not isinstance(name, str) or name not in _infos():
        raise ArgumentError(f"name: no backward rule named {name!r} is defined; defined: {rule_names()}")
    _forget(name)


def _forget(name: str) -> None:
    """Remove rule ``name`` and its aliases, whether defined or not (tests)."""
    with _LOCK:
        _INFOS.pop(name, None)
        for alias in [a for a, n in _ALIASES.items() if n == name]:
            del _ALIASES[alias]


def _ordered() -> list[str]:
    infos = _infos()
    # sorted() is stable: rules of one order keep their order of definition
    return sorted(infos, key=lambda n: infos[n][0])


class _RuleTable(Mapping):
    """The read-only view :data:`RULES`: rule name -> :class:`RuleInfo`, in :func:`rule_names` order."""

    def __getitem__(self, name: str) -> RuleInfo:
        return _infos()[name][1]

    def __iter__(self) -> Iterator[str]:
        return iter(_ordered())

    def __len__(self) -> int:
        return len(_infos())

    def __contains__(self, name: object) -> bool:
        return name in _infos()

    def __repr__(self) -> str:
        return f"RULES({_ordered()})"


#: Every backward rule: name -> :class:`RuleInfo` (read-only; a rule module adds one with :func:`define_rule`).
RULES: Mapping[str, RuleInfo] = _RuleTable()


def rule_names() -> list[str]:
    """Every backward rule a trace may use, the default first.

    Example:
        >>> rule_names()[0]
        'gradient'
    """
    return _ordered()


def rule_aliases() -> dict[str, str]:
    """The other spellings ``rule=`` accepts: alias -> the rule's name.

    Example:
        >>> rule_aliases()["cp_lrp_rule"]
        'cp_lrp'
    """
    _infos()
    return dict(_ALIASES)


def check_rule(rule: object) -> str:
    """The name of the backward rule ``rule`` names (an alias maps to its rule), else a :class:`TraceError`
    listing the allowed names.

    Example:
        >>> check_rule("lrp")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: rule: unknown backward rule 'lrp'; allowed: ['gradient', 'cp_lrp', 'attnlrp', 'libragrad', ...]
    """
    if isinstance(rule, str) and rule in _infos():
        return rule
    if isinstance(rule, str) and rule in _ALIASES:
        return _ALIASES[rule]
    raise TraceError(f"rule: unknown backward rule {rule!r}; allowed: {rule_names()} (or the rule-only spellings "
                     f"{sorted(_ALIASES)})")


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
