"""The benchmark suite runs end to end in --quick mode and writes every result key (no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ITEMS = {
    "trace_cost": ["k", "n_targets", "trace", "baseline_autograd", "baseline_backward", "forward",
                   "ratio_vs_autograd", "ratio_vs_autograd_of_medians", "ratio_vs_backward", "ratio_vs_forward",
                   "first_trace", "breakdown", "baseline_description"],
    "single_variant": ["recipe", "recipe_id", "class", "what", "vc_cam", "vc_cam_cold_caches", "pytorch_grad_cam",
                       "speedup_vs_pytorch_grad_cam", "speedup_vs_pytorch_grad_cam_cold_caches", "agreement",
                       "timing_note"],
    "gallery": ["variants", "layers", "sites", "recipe", "vc_gallery", "vc_gallery_cold_caches",
                "pytorch_grad_cam_loop", "pytorch_grad_cam_one_pass", "speedup_vs_pytorch_grad_cam_loop",
                "speedup_vs_pytorch_grad_cam_one_pass", "speedup_vs_pytorch_grad_cam_one_pass_cold_caches",
                "agreement", "f3_hook", "timing_note"],
    "memory": ["stored_bytes", "stored_data_bytes", "tensor_bytes", "stored_bytes_ratio", "per_variable_bytes",
               "netcdf_bytes", "netcdf_over_stored", "save_netcdf_s", "load_netcdf_s", "peak_trace",
               "peak_baseline"],
}
STAT_KEYS = {"median_s", "min_s", "max_s", "n", "samples_s"}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    committed = ROOT / "benchmarks" / "RESULTS.json"
    before = committed.stat().st_mtime_ns if committed.exists() else None
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = committed.stat().st_mtime_ns if committed.exists() else None
    assert before == after, "--quick must not overwrite the committed benchmarks/RESULTS.json"
    return json.loads((out / "latest.json").read_text()), out


@pytest.mark.slow
def test_quick_run_writes_every_key(quick_run: tuple[dict, Path]) -> None:
    results, out = quick_run
    for key in ("schema", "created", "command", "quick", "device", "machine", "versions", "settings", "models",
                "widget_latency", "trace_many", "targets", "notes", "wall_s"):
        assert key in results, key
    assert results["quick"] is True and "--quick" in results["command"]
    for key in ("cpu_model", "logical_cpus", "usable_cpus", "load_average_start", "load_average_end",
                "torch_threads"):
        assert key in results["machine"], key
    for dist in ("vitcam_nb", "torch", "timm", "grad-cam", "torchcam"):
        assert dist in results["versions"], dist
    tiny = results["models"]["tiny_vit"]
    assert tiny["status"] == "ok"
    for item, keys in ITEMS.items():
        missing = [k for k in keys if k not in tiny[item]]
        assert not missing, f"{item}: {missing}"
    for item, name in (("trace_cost", "trace"), ("single_variant", "vc_cam"), ("gallery", "vc_gallery")):
        assert STAT_KEYS <= set(tiny[item][name]), (item, name)
        assert tiny[item][name]["median_s"] > 0
    assert tiny["gallery"]["variants"] == 3 * 5
    assert tiny["memory"]["stored_bytes"] > 0 and tiny["memory"]["tensor_bytes"] > 0
    for probe in ("peak_trace", "peak_baseline"):
        assert tiny["memory"][probe]["status"] == "ok", tiny["memory"][probe]
        assert tiny["memory"][probe]["peak_rise_bytes"] is not None
    # Peers computing the same variant give the same map (a wiring check, not a timing claim).
    for name, agreement in tiny["gallery"]["agreement"].items():
        assert agreement["max_abs_diff"] < 1e-3, name
    assert tiny["single_variant"]["agreement"]["pytorch_grad_cam_max_abs_diff"] < 1e-3
    bundled = results["models"]["shapes-vit"]
    assert bundled["status"] in ("ok", "skipped")
    if bundled["status"] == "skipped":
        assert bundled["note"]
    assert results["widget_latency"]["status"] in ("ok", "skipped", "error")
    assert results["trace_many"]["status"]
    targets = {(row["target"], row["model"]) for row in results["targets"]}
    for target in ("trace_ratio", "single_variant_speedup", "gallery_seconds", "stored_bytes_ratio"):
        assert (target, "tiny_vit") in targets
    assert not any(row["official"] for row in results["targets"]), "quick rows are never the official claim"
    for row in results["targets"]:
        assert {"what", "value", "cpu_value", "op", "threshold", "holds", "official"} <= set(row)
    md = (out / "latest.md").read_text()
    assert "## Targets" in md and "tiny_vit" in md and "python -m benchmarks --quick" in md


@pytest.mark.slow
def test_update_readme_perf_replaces_only_between_markers(quick_run: tuple[dict, Path], tmp_path: Path) -> None:
    _, out = quick_run
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\nbefore\n<!-- perf:start -->\nold table\n<!-- perf:end -->\nafter\n")
    script = [sys.executable, str(ROOT / "scripts" / "update_readme_perf.py"), "--results", str(out / "latest.json"),
              "--readme", str(readme)]
    proc = subprocess.run(script, capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n<!-- perf:start -->\n") and text.endswith("<!-- perf:end -->\nafter\n")
    # The README states measured figures; targets and verdicts stay in benchmarks/RESULTS.md.
    assert "old table" not in text and "| what | model | measured (wall) |" in text
    assert "holds" not in text and "missed" not in text and "**no**" not in text
    assert subprocess.run([*script, "--check"], env=_env(), timeout=120).returncode == 0

    readme.write_text("# no markers\n")
    proc = subprocess.run(script, capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 1 and "| what |" in proc.stdout and "markers" in proc.stderr
    assert readme.read_text() == "# no markers\n"


def _readme_perf_script():
    """scripts/update_readme_perf.py as a module (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("update_readme_perf", ROOT / "scripts" / "update_readme_perf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_load_row_states_the_ratio_without_a_verdict(tmp_path: Path) -> None:
    module = _readme_perf_script()
    entry = {"model": "m", "maps": 60, "rounds": 3, "as_is_median_s": 0.02, "busy_median_s": 0.03,
             "busy_over_as_is": 1.5, "target": 1.3, "load_average_start": [1.0, 0.5, 0.25], "cpus": 2,
             "date": "2026-11-30", "command": "python -m benchmarks.load"}
    path = tmp_path / "LOAD.json"
    path.write_text(json.dumps(entry))
    row = module.load_row(path)
    assert "20.0 ms" in row and "30.0 ms" in row and "×1.50" in row
    assert "missed" not in row and "target" not in row


def test_against_row_states_each_ratio_the_date_and_the_machine(tmp_path: Path) -> None:
    module = _readme_perf_script()
    entry = {"model": "m", "base": {"version": "0.1.0", "commit": "e4ec999c1b42"}, "threshold": 1.1,
             "settings": {"threads": 1, "rounds": 5}, "verdict": "does not hold", "command": "python -m x",
             "created": "2026-12-01T13:26:51+00:00", "machine": {"cpu_model": "AMD EPYC"},
             "items": {"trace": {"ratio": 1.381}, "one_variant": {"ratio": 1.149}, "gallery": {"ratio": 0.338}}}
    path = tmp_path / "AGAINST.json"
    path.write_text(json.dumps(entry))
    row = module.against_row(path)
    assert "trace ×1.38, one variant ×1.15, gallery ×0.34" in row and "does not hold" not in row
    assert "Measured 2026-12-01 on AMD EPYC" in row
    path.write_text(json.dumps({**entry, "quick": True}))
    assert module.against_row(path) == ""


def test_gallery_row_compares_with_the_fastest_peer() -> None:
    module = _readme_perf_script()
    g = {"vc_gallery": {"median_s": 0.0125}, "torchcam_one_pass": {"median_s": 0.9},
         "pytorch_grad_cam_one_pass": {"median_s": 0.8}, "speedup_vs_torchcam_one_pass": 72.0,
         "speedup_vs_pytorch_grad_cam_one_pass": 64.0}
    results = {"created": "2026-11-30T10:00:00", "models": {"m": {"gallery": g}},
               "partial_updates": [{"item": "m/gallery", "created": "2026-12-01T09:00:00"}]}
    row = module.gallery_row(results, "m")
    # pytorch-grad-cam is the faster peer here (0.8 s), so its paired ratio is the one stated.
    assert "`vc.gallery` 12.5 ms;" in row and "(pytorch-grad-cam) ×64.0;" in row and "target" not in row
    assert "measured 2026-12-01" in row
    g.update(vc_gallery={"median_s": 0.025}, speedup_vs_pytorch_grad_cam_one_pass=120.0)
    row = module.gallery_row(results, "m")
    assert "25.0 ms" in row and "×120.0;" in row
    assert "first gallery" not in row  # no cold-cache measurement in these results
    g.update(vc_gallery_cold_caches={"median_s": 0.031}, speedup_vs_pytorch_grad_cam_one_pass_cold_caches=25.8)
    assert "The first gallery on a trace" in module.gallery_row(results, "m")
    assert "31.0 ms, ×25.8." in module.gallery_row(results, "m")
    assert module.gallery_row({**results, "quick": True}, "m") == ""


def test_trace_faults_row_states_both_counts_and_is_empty_without_them() -> None:
    module = _readme_perf_script()
    pf = {"trace": {"minor_faults": 340123, "system_s": 0.81}, "baseline_autograd": {"minor_faults": 3776,
                                                                                    "system_s": 0.03}}
    row = module.trace_faults_row({"models": {"m": {"trace_cost": {"page_faults": pf}}}}, "m")
    assert "340,123 minor page faults and 0.81 s" in row and "the baseline 3,776 and 0.03 s" in row
    assert module.trace_faults_row({"models": {"m": {"trace_cost": {}}}}, "m") == ""


def test_ambiguity_row_states_the_largest_description_within_500_recipes(tmp_path: Path) -> None:
    module = _readme_perf_script()
    rows = [{"description": "small", "recipes": 66, "design": "exact: a", "first_call_s": 0.1, "median_repeat_s": 0.1},
            {"description": "five hundred", "recipes": 500, "design": "exact: b", "first_call_s": 1.234,
             "median_repeat_s": 1.1},
            {"description": "too many", "recipes": 900, "design": "sampled", "first_call_s": 9.0,
             "median_repeat_s": 9.0}]
    entry = {"model": "m", "threads": 1, "target_s": 2.0, "repeat": 3, "rows": rows, "cpus": 2,
             "load_average_start": [1.0, 0.5, 0.25], "date": "2026-11-30", "command": "python -m benchmarks.ambiguity"}
    path = tmp_path / "AMBIGUITY.json"
    path.write_text(json.dumps(entry))
    row = module.ambiguity_row(path)
    assert "500 recipes open" in row and '"five hundred"' in row and "1.23 s" in row and "66 recipes 0.10 s" in row
    assert "too many" not in row and "holds" not in row and "1.00/0.50/0.25" in row
