"""The adapter table (vitcam_nb/adapters/registry.py) and the per-trace context (adapters/base.py): built-in
families loaded only when their package is installed, third-party families from the ``vitcam_nb.adapters``
entry point group, and no adapter keeping facts of a trace on itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import timm
import torch

import vitcam_nb as vc
from vitcam_nb.adapters import TraceContext, find_adapter

ROOT = Path(__file__).resolve().parents[3]


def _run(code: str, extra_path: Path | None = None) -> str:
    env_path = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": ":".join(env_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_a_builtin_family_whose_package_is_missing_is_left_out():
    out = _run("""
        import importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "open_clip" else real(name, *a)
        import sys
        from vitcam_nb.adapters import supported_families
        from vitcam_nb.adapters.registry import declared_families
        print(",".join(supported_families()), "open_clip" in sys.modules,
              ",".join(s.family for s in declared_families() if s.needs != "open_clip"))
    """)
    families, imported, expected = out.split()
    # the table is the declarations in their order less those whose package is missing, whatever families exist
    assert families.split(",") == expected.split(",") and imported == "False"
    assert "open_clip" not in families.split(",")
    assert {"vit", "swin", "beit", "eva", "blip", "hf_vit", "hf_clip", "hf_owlv2"} <= set(families.split(","))


def test_every_adapter_module_declares_its_families_and_the_table_is_found_by_walking_the_package():
    """Built-ins come by the package walk (no tuple kept by hand): each declared class sits in a module of the
    package, BUILTIN_ADAPTERS is derived from the declarations, and an adapter class of the package is read."""
    import vitcam_nb.adapters.registry as registry
    from vitcam_nb.adapters.hf import HfDeitAdapter

    specs = registry.declared_families()
    assert all(s.cls.__module__.startswith("vitcam_nb.adapters.") for s in specs)
    assert registry.BUILTIN_ADAPTERS == tuple((s.family, s.target, s.needs) for s in specs)
    assert ("hf_deit_distilled", "vitcam_nb.adapters.hf:HfDeitAdapter", "transformers") in registry.BUILTIN_ADAPTERS
    assert type(find_adapter(timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1))).family == "vit"
    assert isinstance(HfDeitAdapter(), registry.Adapter)
    priorities = [s.priority for s in specs if not s.before]
    assert priorities == sorted(priorities)


def test_declared_order_before_and_priority():
    """``before`` puts a family in front of the one it names whatever its priority; equal priorities keep the
    order of declaration."""
    import vitcam_nb.adapters.registry as registry

    @registry.declare_family(priority=5000, before=("beit",))
    class Early(registry.Adapter):
        family = "early_demo"

    @registry.declare_family(priority=5000)
    class Late(registry.Adapter):
        family = "late_demo"

    try:
        names = [s.family for s in registry.declared_families()]
        assert names.index("early_demo") == names.index("beit") - 1
        assert names[-1] == "late_demo"
    finally:
        registry._forget("early_demo")
        registry._forget("late_demo")
    assert "early_demo" not in [s.family for s in registry.declared_families()]


def test_a_family_from_an_entry_point_is_registered(tmp_path):
    (tmp_path / "myfamily.py").write_text(textwrap.dedent("""
        from vitcam_nb.adapters import VitAdapter

        class MyAdapter(VitAdapter):
            family = "my_family"

            def matches(self, model):
                return type(model).__name__ == "MyNet"
    """))
    dist = tmp_path / "myfamily-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myfamily\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[vitcam_nb.adapters]\nmy_family = myfamily:MyAdapter\n")
    out = _run("""
        from vitcam_nb.adapters import supported_families
        print(",".join(supported_families()))
    """, extra_path=tmp_path)
    assert out.split(",")[:2] == ["my_family", "vit"]  # before the built-ins: a plugin may refine a family


def test_a_broken_entry_point_warns_and_the_builtins_stay(tmp_path):
    dist = tmp_path / "broken-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[vitcam_nb.adapters]\nbroken = no_such_module:Adapter\n")
    out = _run("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from vitcam_nb.adapters import supported_families
            families = supported_families()
        print("vit" in families, any("'broken'" in str(w.message) for w in caught))
    """, extra_path=tmp_path)
    assert out == "True True"


def _swin() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1), num_heads=(2, 4),
                             embed_dim=16, img_size=56, window_size=7, num_classes=4, strict_img_size=False).eval()


def test_the_registered_swin_adapter_keeps_nothing_of_a_trace():
    model = _swin()
    adapter = find_adapter(model)
    before = dict(vars(adapter))
    vc.trace(model, np.zeros((56, 56, 3), np.uint8), targets="top1", sites=["F1", "F3"])
    assert vars(adapter) == before == {}


def test_two_traces_at_once_keep_their_own_grids():
    """Two models of one family traced at once share the registered adapter; each trace keeps its own facts."""
    model_a, model_b = _swin(), _swin()
    adapter = find_adapter(model_a)
    assert find_adapter(model_b) is adapter
    a, b = TraceContext(model_a), TraceContext(model_b)
    with adapter.tracing(a):
        with adapter.tracing(b):
            model_b(torch.zeros(1, 3, 84, 84))  # another input size: other grids per block
        model_a(torch.zeros(1, 3, 56, 56))
    assert adapter.grid_of(a, 0) == (14, 14) and adapter.grid_of(b, 0) == (21, 21)
    assert adapter.window_keys(a, 0).shape[0] == 14 * 14 and adapter.window_keys(b, 0).shape[0] == 21 * 21


def test_traces_in_threads_get_the_maps_of_their_own_input_size():
    models = [_swin(), _swin()]
    inputs = []
    for seed, size in ((0, 56), (1, 84)):
        image = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
        x = vc.preprocess.prepare_input(models[0], image).tensor
        inputs.append(torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear"))
    alone = [vc.trace(models[i], inputs[i], targets="top1", sites=["F3"]) for i in range(2)]
    results: dict[int, object] = {}

    def run(i: int) -> None:
        results[i] = vc.trace(models[i], inputs[i], targets="top1", sites=["F3"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0]["stage_0"].attrs["grid_h"] == 14 and results[1]["stage_0"].attrs["grid_h"] == 21
    for i in range(2):  # the windows were put back with each trace's own grid
        recipe = vc.Recipe(site="F3", layer=0, weighting="hirescam", upsample="none", relu="none", normalize="none")
        got, want = vc.cam(results[i], recipe), vc.cam(alone[i], recipe)
        assert got.attrs["degenerate"] == "" and np.abs(want.values).max() > 0
        np.testing.assert_array_equal(got.values, want.values)
