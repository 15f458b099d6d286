"""``python -m benchmarks.against --quick`` measures the base commit and the working tree, each from its own
tree, and writes every item for both (no timing assertions: a smoke test of the wiring)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = "e4ec999"
ITEMS = ("trace", "one_variant", "gallery")


def _base_missing() -> str | None:
    """Why the comparison cannot run here, or None."""
    if shutil.which("git") is None:
        return "git is not installed"
    proc = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BASE}^{{commit}}"], capture_output=True)
    if proc.returncode != 0:
        return f"base commit {BASE} is not in this repository (shallow clone or not a git checkout)"
    return None


@pytest.mark.slow
def test_quick_against_base_uses_two_trees(tmp_path: Path) -> None:
    reason = _base_missing()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "a.json"
    committed = ROOT / "benchmarks" / "AGAINST.json"
    before = committed.stat().st_mtime_ns if committed.exists() else None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.against", "--quick", "--base", BASE, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (committed.stat().st_mtime_ns if committed.exists() else None) == before, \
        "--out must be honoured; the committed benchmarks/AGAINST.json stays as it was"
    result = json.loads(out.read_text())

    assert result["quick"] is True and result["model"] == "vit_tiny_patch16_224"
    assert result["settings"]["rounds"] == 2 and len(result["rounds"]) == 2
    assert [r["order"] for r in result["rounds"]] == [["base", "new"], ["new", "base"]], "order alternates"
    for item in ITEMS:
        it = result["items"][item]
        assert it["base"]["median_s"] > 0 and it["new"]["median_s"] > 0, item
        assert it["ratio"] > 0 and len(it["ratios"]) == 2, item
        assert isinstance(it["holds"], bool)
    assert result["verdict"] in ("holds", "does not hold")
    assert result["base"]["commit"].startswith(BASE)

    # Two different trees: the base imported from the temporary extraction, the new one from this checkout,
    # although the checkout's editable install was on the import path of both.
    base_file, new_file = Path(result["base"]["vitcam_nb_file"]), Path(result["new"]["vitcam_nb_file"])
    assert base_file != new_file
    assert base_file.is_relative_to(Path(result["base"]["tree"]))
    assert Path(result["base"]["tree"]).is_relative_to(tempfile.gettempdir())
    assert not Path(result["base"]["tree"]).exists(), "the temporary base tree is removed afterwards"
    assert new_file.is_relative_to(ROOT)
    assert result["base"]["modules_outside_root"] == [] and result["new"]["modules_outside_root"] == []
    for r in result["rounds"]:
        assert Path(r["base"]["vitcam_nb_file"]) == base_file and Path(r["new"]["vitcam_nb_file"]) == new_file

    for key in ("cpu_model", "logical_cpus", "load_average_start", "load_average_end", "torch_threads"):
        assert key in result["machine"], key
    assert result["machine"]["torch_threads"] == 1
    assert "--quick" in result["command"] and result["created"]
    assert "| trace |" in proc.stdout and "Verdict:" in proc.stdout
