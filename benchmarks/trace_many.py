"""trace_many (issue #10): throughput against a plain loop of ``vc.trace()`` + ``vc.save()``, and peak resident
memory against the number of images, which must stay flat (not grow with it).

``run(quick) -> dict`` is what the suite calls; ``python -m benchmarks.trace_many [--quick] [--device D]``
prints the same dict as JSON. Every measurement runs in a fresh process (``--probe``): a warm-up pays the lazy
imports, then Linux's high-water mark is reset (``/proc/self/clear_refs``) so that ``VmHWM`` is the peak of
the measured run alone, and ``VmRSS`` is sampled after every batch. Images come from the bundled shapes
generator, made batch by batch so that the input itself does not grow with the image count; the model is the
bundled ``shapes-vit``, or the same architecture with random weights while the weights are not bundled yet
(tracing cost does not depend on the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"targets": "top3", "sites": None, "dtype": "float16"}  # every site F1..F6, as vc.trace's default
FLAT_TOLERANCE_BYTES = 16 * 2**20


def _model(device: str) -> tuple[object, str]:
    """The bundled shapes-vit, or its architecture with seeded random weights when the weights are absent."""
    import torch

    try:
        from vitcam_nb.models import load_model

        return load_model("shapes-vit").to(device), "shapes-vit (bundled weights)"
    except Exception as exc:  # weights not bundled yet: same architecture, random weights
        from vitcam_nb.data.train import SPECS, build_model, pretrained_cfg

        torch.manual_seed(0)
        model = build_model(SPECS["shapes-vit"]["arch"])
        model.pretrained_cfg = model.default_cfg = pretrained_cfg("shapes-vit", SPECS["shapes-vit"]["arch"])
        return model.eval().to(device), (f"shapes-vit architecture, random weights (bundled model unavailable: "
                                         f"{type(exc).__name__})")


def _images(n: int, chunk: int, samples: list | None = None) -> Iterator[tuple]:
    """``n`` shapes images as (image, label, mask), generated ``chunk`` at a time; ``samples`` gets the
    resident memory (bytes) each time a chunk starts, i.e. once per batch of the consumer."""
    from benchmarks.memprobe import _status_kib
    from vitcam_nb.data import shapes

    for start in range(0, n, chunk):
        if samples is not None:
            samples.append((start, (_status_kib("VmRSS") or 0) * 1024))
        images, labels, masks = shapes(min(chunk, n - start), seed=1000 + start)
        yield from zip(images, labels.tolist(), masks)


def probe(mode: str, n: int, batch_size: int, device: str = "cpu") -> dict:
    """One measured run in this process: ``mode`` is ``trace_many`` (one store) or ``loop`` (``vc.trace`` +
    ``vc.save`` per image, one zarr file each). Returns seconds, images/s, peak and sampled memory.

    Example:
        >>> r = probe("trace_many", 4, 2)  # doctest: +SKIP
        >>> r["images_per_s"] > 0  # doctest: +SKIP
        True
    """
    import gc

    import vitcam_nb as vc
    from benchmarks.memprobe import _reset_peak, _status_kib
    from vitcam_nb.capture.trace_many import trace_many

    model, description = _model(device)
    folder = Path(tempfile.mkdtemp(prefix="vitcam-trace-many-"))
    try:
        # Warm-up: the lazy imports and one-off allocations of both paths, not measured.
        trace_many(model, _images(2, 2), folder / "warm.zarr", batch_size=2, device=device, progress=False,
                   **SETTINGS)
        vc.save(vc.trace(model, next(_images(1, 1))[0], device=device, **SETTINGS), folder / "warm1.zarr")
        gc.collect()
        samples: list[tuple[int, int]] = []
        rss_before = (_status_kib("VmRSS") or 0) * 1024
        exact = _reset_peak()
        start = time.perf_counter()
        if mode == "trace_many":
            out = folder / "store.zarr"
            trace_many(model, _images(n, batch_size, samples), out, batch_size=batch_size, device=device,
                       progress=False, **SETTINGS)
        elif mode == "loop":
            out = folder / "loop"
            out.mkdir()
            for i, (image, _label, _mask) in enumerate(_images(n, batch_size, samples)):
                vc.save(vc.trace(model, image, device=device, **SETTINGS), out / f"{i:05d}.zarr")
        else:
            raise ValueError(f"mode: expected 'trace_many' or 'loop', got {mode!r}")
        seconds = time.perf_counter() - start
        hwm = _status_kib("VmHWM") if exact else None
        if hwm is None:
            import resource

            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rss = np.array([s[1] for s in samples], dtype=np.float64)
    at = np.array([s[0] for s in samples], dtype=np.float64)
    # The allocator keeps the first batches' memory for reuse: the steady state starts at the third batch.
    slope = float(np.polyfit(at[2:], rss[2:], 1)[0]) if len(rss) >= 4 else None
    return {
        "mode": mode, "n_images": n, "batch_size": batch_size, "device": device, "model": description,
        "seconds": seconds, "images_per_s": n / seconds,
        "peak_method": "VmHWM after clear_refs reset" if exact else "ru_maxrss (whole process)",
        "rss_before_bytes": int(rss_before), "peak_bytes": int(hwm) * 1024,
        "peak_rise_bytes": max(0, int(hwm) * 1024 - int(rss_before)),
        "rss_per_batch_bytes": [int(v) for v in rss],
        "rss_slope_bytes_per_image": slope,
        "disk_bytes": int(disk),
    }


def _probe_subprocess(mode: str, n: int, batch_size: int, device: str, threads: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.trace_many", "--probe", mode, "--n", str(n), "--batch-size",
           str(batch_size), "--device", device, "--threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False, device: str = "cpu", threads: int | None = None) -> dict:
    """Throughput of trace_many against a plain trace()+save() loop, and its peak memory at two image counts.

    Full: 64 and 256 images in batches of 16, each run in a fresh process; the loop runs 64 images. Quick (a
    CI smoke run, no claims): 8 and 24 images in batches of 4, loop of 8, all in this process (later runs
    reuse memory the allocator kept, so the quick memory numbers are lower bounds). Memory is flat when the
    peak rise of the large run exceeds the small run's by less than 16 MiB (or 10 %).

    Example:
        >>> r = run(quick=True)  # doctest: +SKIP
        >>> r["memory"]["flat"]  # doctest: +SKIP
        True
    """
    threads = (1 if quick else 0) if threads is None else threads
    small, large, loop_n, batch = (8, 24, 8, 4) if quick else (64, 256, 64, 16)
    wall = time.perf_counter()
    if quick:
        if threads:
            import torch

            torch.set_num_threads(threads)
        measure = probe
    else:
        def measure(mode: str, n: int, batch_size: int, device: str) -> dict:
            return _probe_subprocess(mode, n, batch_size, device, threads)
    many_small = measure("trace_many", small, batch, device)
    many_large = measure("trace_many", large, batch, device)
    loop = measure("loop", loop_n, batch, device)
    growth = many_large["peak_rise_bytes"] - many_small["peak_rise_bytes"]
    allowed = max(FLAT_TOLERANCE_BYTES, 0.10 * many_small["peak_rise_bytes"])
    return {
        "status": "ok",
        "command": "python -m benchmarks.trace_many" + (" --quick" if quick else "") +
                   (f" --device {device}" if device != "cpu" else ""),
        "quick": quick, "device": device, "threads": threads or "torch default",
        "model": many_large["model"],
        "settings": {**SETTINGS, "sites": "F1..F6", "batch_size": batch, "image_size": "64x64"},
        "throughput": {
            "trace_many_images_per_s": many_large["images_per_s"],
            "loop_trace_save_images_per_s": loop["images_per_s"],
            "speedup": many_large["images_per_s"] / loop["images_per_s"],
            "n_images": {"trace_many": large, "loop": loop_n},
        },
        "memory": {
            "peak_rise_bytes": {str(small): many_small["peak_rise_bytes"], str(large): many_large["peak_rise_bytes"]},
            "growth_bytes": growth, "allowed_growth_bytes": int(allowed), "flat": bool(growth <= allowed),
            "rss_per_batch_bytes": many_large["rss_per_batch_bytes"],
            "rss_slope_bytes_per_image": many_large["rss_slope_bytes_per_image"],
            "loop_peak_rise_bytes": loop["peak_rise_bytes"],
            "method": many_large["peak_method"] + ("; in one process (quick)" if quick else "; fresh process each"),
        },
        "disk_bytes_per_image": {"trace_many": many_large["disk_bytes"] / large, "loop": loop["disk_bytes"] / loop_n},
        "probes": {"trace_many_small": many_small, "trace_many_large": many_large, "loop": loop},
        "wall_s": time.perf_counter() - wall,
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: the whole comparison (default) or one probe (``--probe``), printed as JSON."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.trace_many", description=__doc__)
    p.add_argument("--quick", action="store_true", help="8 and 24 images in one process instead of 64 and 256")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: quick 1, full torch's)")
    p.add_argument("--probe", choices=("trace_many", "loop"), help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=32, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=8, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(probe(args.probe, args.n, args.batch_size, args.device)))
    else:
        print(json.dumps(run(args.quick, args.device, args.threads), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
