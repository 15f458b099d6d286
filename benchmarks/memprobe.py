"""Peak resident memory of one trace (or its plain baseline), measured in a fresh process.

Run by the suite as ``python -m benchmarks.memprobe --model NAME --mode trace|baseline``; prints one
JSON line. The peak is taken after the model and input exist: Linux lets a process reset its own
high-water mark (``echo 5 > /proc/self/clear_refs``), so ``VmHWM`` afterwards is the peak of the
measured call alone. Where that is not possible, ``ru_maxrss`` (peak of the whole process, model
creation included) is reported instead and ``method`` says so. numpy's own peak comes from tracemalloc.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import tracemalloc


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(model_name: str, mode: str, device: str = "cpu", k: int = 5) -> dict:
    """Peak memory of one ``vc.trace`` (mode ``trace``) or one plain forward + K+1 autograd.grad (``baseline``).

    A first call on a tiny model (not measured) pays lazy imports. The weights hash of ``model_name`` is
    not cached yet, so the trace's peak includes hashing the weights once, as a user's first trace does.

    Example:
        >>> r = measure("tiny_vit", "baseline")
        >>> r["peak_rise_bytes"] >= 0
        True
    """
    import torch

    import vitcam_nb as vc
    from benchmarks import peers, workloads

    def run(work: workloads.Workload, k: int) -> object:
        if mode == "trace":
            return vc.trace(work.model, work.x.detach().cpu(), targets=f"top{k}", device=device)
        if mode == "baseline":
            return peers.baseline_autograd(work.model, work.x, k)
        raise ValueError(f"mode: expected 'trace' or 'baseline', got {mode!r}")

    # A first call on a tiny model pays the lazy imports and one-off allocations, which are not the trace's.
    del_me = run(workloads.build(workloads.TINY, device), 2)
    del del_me
    w = workloads.build(model_name, device)
    k = min(k, int(w.model.num_classes))
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_before = _status_kib("VmRSS")
    exact = _reset_peak()
    tracemalloc.start()
    result = run(w, k)
    _, numpy_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    hwm = _status_kib("VmHWM") if exact else None
    peak_kib = hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_after = _status_kib("VmRSS")
    out = {
        "model": model_name,
        "mode": mode,
        "method": "VmHWM after clear_refs reset" if hwm is not None else "ru_maxrss (includes model creation)",
        "rss_before_bytes": None if rss_before is None else rss_before * 1024,
        "peak_bytes": peak_kib * 1024,
        "peak_rise_bytes": None if rss_before is None else max(0, peak_kib - rss_before) * 1024,
        "rss_after_bytes": None if rss_after is None else rss_after * 1024,
        "python_peak_bytes_tracemalloc": int(numpy_peak),
    }
    if device.startswith("cuda"):
        out["cuda_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    del result
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line entry: print :func:`measure` as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.memprobe")
    p.add_argument("--model", required=True)
    p.add_argument("--mode", choices=("trace", "baseline"), required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.model, args.mode, args.device, args.k)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
