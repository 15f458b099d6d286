"""Presets register themselves where they are defined (core/preset_registry.py): a new
``vitcam_nb/core/presets_*.py`` module is found by the package walk, with its citation, its row of the preset
table and its public path ``vc.presets.<name>``, and no list edited."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vitcam_nb as vc
from vitcam_nb.core import presets as core_presets
from vitcam_nb.core.errors import ArgumentError

ROOT = Path(__file__).resolve().parents[3]


def test_a_preset_module_added_to_the_package_is_found_listed_and_tabled(tmp_path):
    (tmp_path / "presets_demo_walk.py").write_text(textwrap.dedent('''
        from vitcam_nb.core.preset_registry import register_preset
        from vitcam_nb.core.recipe import Recipe

        @register_preset("Demo et al. 2099", taxonomy={"paper": "Demo et al. 2099", "code": "none", "site": "F1",
                         "target": "logit", "tokens": "patches", "aggregation": "layercam",
                         "reconstruction": "raster"})
        def demo_walk(layer: int = -1) -> Recipe:
            return Recipe(site="F4", layer=layer, weighting="gradcampp")
    '''))
    code = textwrap.dedent(f"""
        import importlib
        core = importlib.import_module("vitcam_nb.core")  # not vc.core: that name imports every layer at once
        core.__path__.append({str(tmp_path)!r})  # the module sits in the package, as a file added to it would
        import vitcam_nb as vc
        names = vc.presets.preset_names()
        assert names[-1] == "demo_walk" and names[:-1] == vc.presets.names()[:-1], names
        assert vc.presets.demo_walk(layer=2).layer == 2 and "demo_walk" in dir(vc.presets)
        assert vc.presets.citation("demo_walk") == "Demo et al. 2099"
        assert vc.presets.preset_name(vc.presets.demo_walk()) == "demo_walk"
        assert "| `demo_walk` | Demo et al. 2099 | none | F1 |" in vc.presets.markdown_table()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_a_preset_registered_at_run_time_is_reached_by_its_public_path_and_a_taken_name_is_refused():
    @vc.presets.register_preset("run-time example", name="demo_runtime", taxonomy={"paper": "x"})
    def make() -> vc.Recipe:
        return vc.Recipe(weighting="gradcam")

    try:
        assert vc.presets.demo_runtime is make and vc.presets.get("demo_runtime") == vc.Recipe(weighting="gradcam")
        assert "demo_runtime" in vc.presets.preset_names() and vc.presets.TAXONOMY["demo_runtime"] == {"paper": "x"}
        with pytest.raises(ArgumentError, match="demo_runtime"):
            vc.presets.register_preset("again", name="demo_runtime")(lambda: vc.Recipe())
    finally:
        core_presets.PRESETS.pop("demo_runtime")
        from vitcam_nb.core.preset_registry import _forget
        _forget("demo_runtime")
    assert "demo_runtime" not in vc.presets.preset_names()
    with pytest.raises(AttributeError):
        vc.presets.demo_runtime  # noqa: B018


def test_every_preset_is_reached_by_its_public_path():
    for name in vc.presets.preset_names():
        assert getattr(vc.presets, name) is core_presets.PRESETS[name]
