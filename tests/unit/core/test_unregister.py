"""The public undo of each registration (issue 54: docs/extending.md's examples undo theirs through these, never
through private tables): each removes exactly what was registered and refuses, by name and before changing
anything, what was never registered."""

from __future__ import annotations

import contextlib

import pytest

import vitcam_nb as vc
from vitcam_nb.capture.rules import RuleImpl, register_rule, rule_families, unregister_rule
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.preset_registry import CITATIONS, PRESETS, register_preset, unregister_preset
from vitcam_nb.core.rules import define_rule, rule_aliases, rule_names, undefine_rule
from vitcam_nb.targets import TARGETS, Target, register_target, unregister_target


def test_unregister_rule_removes_its_definition_alias_and_implementations_only():
    before = (rule_names(), rule_aliases(), {r: rule_families(r) for r in rule_names()})
    define_rule("undo_demo", "nothing", "none", aliases=("undo_demo_rule",))
    register_rule("undo_demo", RuleImpl("vit", lambda m, a: None, lambda m, a: contextlib.nullcontext()))
    assert "undo_demo" in rule_names() and rule_families("undo_demo") == ["vit"]
    unregister_rule("undo_demo_rule")  # an alias names the rule
    assert (rule_names(), rule_aliases(), {r: rule_families(r) for r in rule_names()}) == before


@pytest.mark.parametrize("name", ["gradient", "no_such_rule", 3])
def test_unregister_rule_refuses_the_default_and_unknown_names(name):
    before = rule_names()
    with pytest.raises(vc.VitcamError, match="rule|name"):
        unregister_rule(name)
    with pytest.raises(ArgumentError, match="name"):
        undefine_rule(name)
    assert rule_names() == before


def test_unregister_preset_and_target_undo_their_registration_and_refuse_unknown_names():
    vc.presets.names()  # every preset module registered first
    presets_before, citations_before, targets_before = dict(PRESETS), dict(CITATIONS), dict(TARGETS)
    register_preset("a test", name="undo_demo_preset")(lambda: vc.Recipe(weighting="layercam"))
    assert vc.presets.get("undo_demo_preset").weighting == "layercam"
    unregister_preset("undo_demo_preset")
    assert (PRESETS, CITATIONS) == (presets_before, citations_before)

    @register_target
    def undo_demo_target() -> Target:
        return Target()

    unregister_target("undo_demo_target")
    assert TARGETS == targets_before
    for undo in (unregister_preset, unregister_target):
        with pytest.raises(ArgumentError, match="name: no .*'undo_demo"):
            undo("undo_demo_" + undo.__name__)
    assert (PRESETS, TARGETS) == (presets_before, targets_before)
