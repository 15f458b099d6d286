"""Gallery speed on a busy machine (issue #23): the 12 x 5 gallery of ViT-B/16 (60 maps, bilinear to 224 px)
timed with the machine as it is and with one extra CPU-bound process started by this benchmark, rounds
interleaved in one run; the ratio busy/as-is is the load cost (target <= 1.3).

Run:  ``python -m benchmarks.load [--rounds N] [--out benchmarks/LOAD.json]``  (prints the JSON).
On a machine that other jobs already load, "as is" is not quiet: the JSON records the load averages.

The busy process is a separate interpreter started with ``subprocess`` (no fork of this process), as another
user's job on a shared machine would be: forking the measuring process shuts down OpenBLAS's thread pools (its
fork handler), and the pools it then starts again spin beside the gallery, which a neighbour never causes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from benchmarks import workloads

VARY = {"layer": "all", "site": ["F1", "F3", "F4", "F5", "F6"]}


def busy_process() -> subprocess.Popen:
    """Start one CPU-bound Python process (a bare loop), the load of one occupied core.

    Example:
        >>> p = busy_process(); p.poll() is None
        True
        >>> p.kill(); p.wait() != 0
        True
    """
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _burst(fn, n: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(n):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def run(rounds: int = 5, burst: int = 5, model: str = workloads.VIT_BASE) -> dict:
    """Interleaved rounds of the gallery as-is and under one extra CPU-bound process; medians and ratio.

    Example:
        >>> run(rounds=1, burst=1, model="tiny_vit")["rounds"]   # doctest: +SKIP
        1
    """
    import vitcam_nb as vc

    warnings.simplefilter("ignore", vc.DegenerateMapWarning)
    w = workloads.build(model)
    tr = vc.trace(w.model, w.x, targets="top5")
    gallery = lambda: vc.gallery(tr, vc.Recipe(), vary=VARY)  # noqa: E731
    gallery()
    load_start = os.getloadavg()
    quiet, busy = [], []
    for r in range(rounds):
        for loaded in ((False, True) if r % 2 == 0 else (True, False)):
            spinner = busy_process() if loaded else None
            try:
                if spinner:
                    time.sleep(0.3)
                (busy if loaded else quiet).append(_burst(gallery, burst))
            finally:
                if spinner:
                    spinner.kill()
                    spinner.wait()
    ratios = [b[0] / q[0] for q, b in zip(quiet, busy)]
    return {
        "model": model, "maps": int(tr.sizes["layer"]) * len(VARY["site"]), "rounds": rounds, "burst": burst,
        "as_is_median_s": statistics.median(q[0] for q in quiet),
        "busy_median_s": statistics.median(b[0] for b in busy),
        "as_is_cpu_median_s": statistics.median(q[1] for q in quiet),
        "busy_cpu_median_s": statistics.median(b[1] for b in busy),
        "busy_over_as_is": statistics.median(ratios), "target": 1.3,
        "load_average_start": list(load_start), "load_average_end": list(os.getloadavg()),
        "cpus": os.cpu_count(), "date": _dt.date.today().isoformat(),
        "command": "python -m benchmarks.load " + " ".join(sys.argv[1:]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--burst", type=int, default=5)
    p.add_argument("--model", default=workloads.VIT_BASE)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = run(args.rounds, args.burst, args.model)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
