"""Trace forms are found by a walk of vitcam_nb.compute and looked up in the order their declared priorities give
(issue 54): the order is the one the import list of 0.3 gave, and it does not depend on import order."""

from __future__ import annotations

import random

import pytest

import vitcam_nb.compute  # noqa: F401  (registers the built-in forms)
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.kinds import TRACE_FORMS, TRACE_KINDS
from vitcam_nb.core.registry import Registry

# The lookup order of 0.3's import list in compute/__init__ (map_store imported last with first=True, the method
# forms with first=True, the others appended): read off that version, the order vc.cam has always asked them in.
OLD_ORDER = ["maps", "video", "vitcx", "tokentm", "transformer_attribution", "published", "flat", "many", "stages",
             "vlm", "xattn"]


def test_the_built_in_forms_keep_the_lookup_order_of_the_old_import_list():
    assert TRACE_KINDS is TRACE_FORMS
    built_in = [n for n in TRACE_FORMS.names() if n in OLD_ORDER]
    assert built_in == OLD_ORDER


@pytest.mark.parametrize("seed", range(5))
def test_the_order_comes_from_the_declared_priorities_whatever_the_order_of_registration(seed):
    names = TRACE_FORMS.names()
    shuffled = random.Random(seed).sample(names, len(names))
    table: Registry[object] = Registry("trace form")
    for name in shuffled:
        table.register(name, TRACE_FORMS.get(name), priority=TRACE_FORMS.priority(name))
    assert table.names() == names


def test_a_form_declared_between_two_built_ins_is_asked_between_them_and_first_still_means_first():
    table: Registry[int] = Registry("x")
    table.register("flat", 1, priority=100)
    table.register("maps", 2, priority=10)
    table.register("mine", 3, priority=99)
    assert table.names() == ["maps", "mine", "flat"]
    table.register("front", 4, first=True)  # without a priority: before every entry registered so far
    table.register("back", 5)  # and after them
    assert table.names() == ["front", "maps", "mine", "flat", "back"]
    table.register("mine", 6, replace=True)  # replaced without a priority: keeps its place
    assert table.names() == ["front", "maps", "mine", "flat", "back"] and table.get("mine") == 6
    table.unregister("mine")
    table.register("mine", 7, priority=100)  # equal priorities: order of registration
    assert table.names() == ["front", "maps", "flat", "mine", "back"]


@pytest.mark.parametrize("bad", ["10", None.__class__, float("nan"), True])
def test_a_priority_that_is_not_a_number_is_refused_by_name_before_anything_changes(bad):
    table: Registry[int] = Registry("x")
    table.register("a", 1, priority=1)
    with pytest.raises(ArgumentError, match="priority"):
        table.register("b", 2, priority=bad)
    assert table.names() == ["a"]
