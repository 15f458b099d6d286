"""The backward-rule registry (core/rules.py, capture/rules/base.py): rules defined by their own modules and found
by walking the package, rule-only spellings that normalise to the stored name, a read-only RULES, and wildcard
implementations (``applies``) that cover every family they accept, a family's own implementation first."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb.adapters import find_adapter
from vitcam_nb.capture.rules import RuleImpl, check_rule_for, register_rule, rule_context, rule_families
from vitcam_nb.capture.rules import base as rules_base
from vitcam_nb.core import rules as core_rules
from vitcam_nb.core.errors import ArgumentError, TraceError

ROOT = Path(__file__).resolve().parents[3]


def _vit(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                             depth=2, num_heads=2, num_classes=5).eval()


def _image() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)


@pytest.mark.parametrize("name", ["cp_lrp", "attnlrp", "libragrad"])
def test_a_rule_only_spelling_traces_exactly_the_rule_and_stores_its_name(name):
    model, image = _vit(), _image()
    plain = vc.trace(model, image, targets=[1, 3], sites=["F1", "F2"], rule=name)
    alias = vc.trace(model, image, targets=[1, 3], sites=["F1", "F2"], rule=f"{name}_rule")
    assert alias.attrs["backward_rule"] == plain.attrs["backward_rule"] == name
    for var in plain.data_vars:  # same kernels on the same shapes: bitwise
        np.testing.assert_array_equal(alias[var].values, plain[var].values)
    assert core_rules.check_rule(f"{name}_rule") == name and f"{name}_rule" not in core_rules.rule_names()


def test_rules_is_read_only_and_lists_the_defined_rules_in_their_order():
    with pytest.raises(TypeError):
        core_rules.RULES["mine"] = core_rules.RuleInfo("x", "y")  # type: ignore[index]
    names = core_rules.rule_names()
    assert names[0] == core_rules.DEFAULT_RULE and list(core_rules.RULES) == names
    assert names.index("cp_lrp") < names.index("attnlrp") < names.index("libragrad") < names.index("chefer_lrp")
    with pytest.raises(TraceError, match="unknown backward rule 'lrp'"):
        core_rules.check_rule("lrp")


def test_a_fresh_process_reading_core_first_finds_the_rules_of_the_package_walk():
    code = ("from vitcam_nb.core.rules import RULES, rule_names; import pkgutil, vitcam_nb.capture.rules as r; "
            "mods = {m.name for m in pkgutil.iter_modules(r.__path__)}; "
            "print(rule_names(), {'cp_lrp', 'attnlrp', 'libragrad', 'chefer'} <= mods)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("]")[0].count("'") >= 10 and out.stdout.strip().endswith("True")


def _has_layer_norm(model: torch.nn.Module, adapter) -> bool:
    return any(isinstance(m, torch.nn.LayerNorm) for b in adapter.blocks(model) for m in b.modules())


@pytest.fixture
def demo_rule():
    """A rule defined here, with one wildcard implementation that counts the passes it covers."""
    entered: list[str] = []

    @contextlib.contextmanager
    def context(model, adapter):
        entered.append(adapter.family)
        yield

    core_rules.define_rule("demo_any_ln", "nothing substituted (a registry test)", "none", aliases=("demo_ln",))
    register_rule("demo_any_ln", RuleImpl("any LayerNorm model", lambda m, a: None, context,
                                          "any model whose blocks hold a torch.nn.LayerNorm", applies=_has_layer_norm))
    try:
        yield entered
    finally:
        rules_base._IMPLS.pop("demo_any_ln", None)
        core_rules._forget("demo_any_ln")


def test_a_wildcard_implementation_covers_every_family_it_accepts(demo_rule):
    vit = _vit()
    torch.manual_seed(0)
    beit = timm.create_model("beit_base_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                             depth=1, num_heads=2, num_classes=5).eval()
    for model in (vit, beit):
        plain = vc.trace(model, _image(), targets=[1], sites=["F1"])
        ruled = vc.trace(model, _image(), targets=[1], sites=["F1"], rule="demo_ln")
        assert ruled.attrs["backward_rule"] == "demo_any_ln"
        # the demo rule substitutes nothing: autograd's gradient, bitwise (same pass, same kernels)
        np.testing.assert_array_equal(ruled["grad"].values, plain["grad"].values)
    assert demo_rule == ["vit", "beit"]
    assert rule_families("demo_any_ln") == ["any LayerNorm model"]


def test_a_wildcard_refuses_what_it_does_not_accept_and_a_family_implementation_comes_first(demo_rule):
    class NoNorm(torch.nn.Module):
        pass

    vit = _vit()
    adapter = find_adapter(vit)
    blocks = adapter.blocks

    class Bare(type(adapter)):
        def blocks(self, model):
            return [NoNorm() for _ in blocks(model)]

    with pytest.raises(TraceError, match="any LayerNorm model"):
        check_rule_for("demo_any_ln", vit, Bare())
    seen = []
    register_rule("demo_any_ln", RuleImpl("vit", lambda m, a: None,
                                          lambda m, a: (seen.append("own"), contextlib.nullcontext())[1]))
    with rule_context("demo_ln", vit, adapter):
        pass
    assert seen == ["own"] and demo_rule == []


def test_a_wildcard_implementation_takes_no_per_family_extras(demo_rule):
    with pytest.raises(ArgumentError, match="wildcard"):
        register_rule("demo_any_ln", RuleImpl("x", lambda m, a: None, lambda m, a: contextlib.nullcontext(),
                                              extra_names=("x",), applies=lambda m, a: True), replace=True)
