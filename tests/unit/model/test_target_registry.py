"""Targets register themselves (targets/base.py ``register_target``) and the package walks its modules: a module
added to ``vitcam_nb/targets`` is ``vc.targets.<name>`` and listed by ``target_names()`` with no line added to the
package's ``__init__``; every built-in constructor keeps its public path."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vitcam_nb as vc
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.targets.base import TARGETS, Target, register_target

ROOT = Path(__file__).resolve().parents[3]


def test_every_registered_constructor_is_the_public_one():
    names = vc.targets.target_names()
    assert {"similarity", "prompts", "itm", "layerwise", "region", "dense", "detection", "segmentation_loss",
            "contrast"} <= set(names)
    for name in names:
        assert getattr(vc.targets, name) is TARGETS[name] and name in vc.targets.__all__


def test_a_target_module_added_to_the_package_is_found(tmp_path):
    # a copy of the package's code (not its data) with one module added, as a contributor would add it
    shutil.copytree(ROOT / "vitcam_nb", tmp_path / "vitcam_nb",
                    ignore=shutil.ignore_patterns("__pycache__", "data", "*.zarr", "*.pt", "*.safetensors"))
    (tmp_path / "vitcam_nb" / "targets" / "zz_first_score.py").write_text(textwrap.dedent('''
        from vitcam_nb.targets.base import Target, register_target


        class FirstScore(Target):
            kind = "first_score"

            def scores(self, model, x):
                return model(x)[0, :1]


        @register_target
        def first_score() -> FirstScore:
            return FirstScore()
    '''))
    # importlib, not "import vitcam_nb.targets as t": that reads vc.targets, which imports every layer at once
    code = (f"import importlib; t = importlib.import_module('vitcam_nb.targets'); "
            f"assert t.__file__.startswith({str(tmp_path)!r}), t.__file__; "
            "print(t.first_score().kind, 'first_score' in t.target_names(), 'first_score' in t.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["first_score", "True", "True"]


def test_a_name_taken_by_another_module_is_refused():
    def similarity() -> Target:
        return Target()

    with pytest.raises(ArgumentError, match="similarity"):
        register_target(similarity)
    assert vc.targets.similarity is TARGETS["similarity"] and TARGETS["similarity"] is not similarity
