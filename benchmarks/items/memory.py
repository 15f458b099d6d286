"""Item 4: stored bytes against the captured tensors' own bytes, peak RSS (fresh subprocesses), netCDF size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks import peers, workloads

if TYPE_CHECKING:
    from benchmarks.suite import Config

ROOT = Path(__file__).resolve().parents[2]


def _probes(model_name: str, modes: tuple[str, ...], cfg: Config, k: int) -> dict[str, dict]:
    """Run one memory-probe subprocess per mode, all at once (each measures only its own process)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore"}
    procs = {}
    for mode in modes:
        cmd = [sys.executable, "-m", "benchmarks.memprobe", "--model", model_name, "--mode", mode,
               "--device", cfg.device, "--k", str(k)]
        if cfg.threads:
            cmd += ["--threads", str(cfg.threads)]
        procs[mode] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       cwd=str(ROOT), env=env)
    out = {}
    for mode, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=1800)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            out[mode] = {"status": "error", "note": stderr.strip()[-800:]}
        else:
            out[mode] = {"status": "ok", **json.loads(stdout.strip().splitlines()[-1])}
    return out


def bench_memory(w: workloads.Workload, tr: object, cfg: Config, k: int) -> dict:
    """Item 4: stored bytes against the captured tensors' own bytes, peak RSS, and the netCDF file size."""
    import vitcam_nb as vc

    per_var = {str(name): int(var.nbytes) for name, var in tr.variables.items()}
    stored = sum(per_var.values())
    data = sum(per_var.get(n, 0) for n in ("act", "grad", "attn", "attn_grad"))
    captured = peers.baseline_autograd(w.model, w.x, k)
    own = peers.tensor_bytes(captured)
    del captured
    tmp = Path(tempfile.mkdtemp(prefix="vitcam-bench-"))
    try:
        path = tmp / "x.nc"
        t0 = time.perf_counter()
        vc.save(tr, path)
        save_s = time.perf_counter() - t0
        disk = path.stat().st_size
        t0 = time.perf_counter()
        vc.load(path)
        load_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {
        "stored_bytes": stored,
        "stored_data_bytes": data,
        "tensor_bytes": own,
        "stored_bytes_ratio": stored / own,
        "per_variable_bytes": dict(sorted(per_var.items(), key=lambda kv: -kv[1])),
        "netcdf_bytes": disk,
        "netcdf_over_stored": disk / stored,
        "save_netcdf_s": save_s,
        "load_netcdf_s": load_s,
        "tensor_bytes_description": "numel x itemsize of every activation (F1, F3..F6), attention map (F2) and "
                                    f"gradient ({k + 1} targets) captured by the plain baseline",
    }
    if cfg.memory:
        cfg.log("    memory probes (subprocesses)")
        peaks = _probes(w.name, ("trace", "baseline"), cfg, k)
        trace_peak, base_peak = peaks["trace"], peaks["baseline"]
        out["peak_trace"] = trace_peak
        out["peak_baseline"] = base_peak
        if trace_peak.get("peak_rise_bytes") and base_peak.get("peak_rise_bytes"):
            out["peak_rise_ratio"] = trace_peak["peak_rise_bytes"] / base_peak["peak_rise_bytes"]
    else:
        out["peak_trace"] = out["peak_baseline"] = {"status": "skipped", "note": "--no-memory"}
    return out
