"""What each memory mode of the trace's pass costs in time, side by side in one process: the plain pass, each block
recomputed in the backward pass and differentiated one target at a time, and that with the head's backward pass
in groups of two or three targets (``vitcam_nb.capture.budget``). For MEMORY.json cases where the budget chooses a
leaner mode than the plain pass; random-init timm models, one CPU thread, the modes interleaved ``--repeats``
rounds in an order rotated every round (medians; a ratio is the median of the per-round ratios), the Datasets
checked equal to float32 rounding (the modes' matrix products have other batch shapes, which round otherwise on
some CPUs: every element within 1e-5 of its magnitude plus 1e-5 of the array's largest, one float16 step more in
float16). Writes ``benchmarks/MEMORY_MODES.json``.

Usage::

    python -m benchmarks.memory_modes                          # the default cases, 5 rounds each
    python -m benchmarks.memory_modes --case vitb224_f16 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.memsizes import CASES, pass_mode

OUT = Path(__file__).resolve().parent / "MEMORY_MODES.json"
DEFAULT_CASES = ("vitb224_f16", "vits224_top3_f16", "swint224", "vitb224_last_f1", "swint224_top2_f3f6")


@contextlib.contextmanager
def forced_mode(recompute: bool, groups: int) -> Iterator[None]:
    """``vc.trace`` runs its pass in this memory mode (the budget's own choice replaced after it is made)."""
    import vitcam_nb.capture.trace as trace_module

    real = trace_module.fit_budget

    def fit(plan, *args, **kwargs):
        real(plan, *args, **kwargs)
        plan.recompute, plan.target_groups = recompute, groups

    trace_module.fit_budget = fit
    try:
        yield
    finally:
        trace_module.fit_budget = real


def measure(case: str, repeats: int) -> dict:
    """Median seconds of ``vc.trace`` in each mode for ``case``, interleaved; ratios to the plain pass."""
    import numpy as np
    import timm
    import torch

    import vitcam_nb as vc
    from vitcam_nb.capture.plan import paired_groups

    name, kwargs, size, label, targets, options = CASES[case]
    torch.set_num_threads(1)
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    image = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    chosen = vc.estimate(model, image, targets, **options)
    groups = paired_groups(chosen["targets"] + 1)
    modes = {pass_mode({"recompute": r, "target_groups": g}): (r, g)  # one head group: two modes only
             for r, g in ((False, 1), (True, 1), (True, groups))}
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    plain = None
    order = list(modes)
    for round_ in range(repeats + 1):  # the first round warms up and is not counted
        for mode in order[round_ % len(order):] + order[:round_ % len(order)]:  # the order rotated every round
            with forced_mode(*modes[mode]):
                start = time.perf_counter()
                tr = vc.trace(model, image, targets, max_bytes=float("inf"), **options)
                seconds[mode].append(time.perf_counter() - start)
            plain = tr if plain is None and mode == "plain" else plain
            if plain is not None:
                for var in ("act", "grad", "attn", "attn_grad"):
                    if var in tr and var in plain:
                        want = plain[var].values
                        rtol = 2.0**-10 if want.dtype == np.float16 else 1e-5  # float16: one step may flip
                        atol = 1e-5 * float(np.abs(want.astype(np.float64)).max())
                        np.testing.assert_allclose(tr[var].values, want, rtol=rtol, atol=atol, err_msg=f"{mode} {var}")
            del tr
    median = {m: statistics.median(s[1:]) for m, s in seconds.items()}
    # a ratio is the median of the per-round ratios: each taken side by side under the same load
    ratio = {m: statistics.median(a / b for a, b in zip(s[1:], seconds["plain"][1:])) for m, s in seconds.items()}
    return {"case": case, "model": label, "targets": targets,
            "options": ", ".join(f"{k}={v!r}" for k, v in options.items()),
            "chosen": pass_mode(chosen),
            "median_seconds": {m: round(v, 3) for m, v in median.items()},
            "over_plain": {m: round(v, 2) for m, v in ratio.items()},
            "repeats": repeats, "torch_threads": 1}


def readme_lines(rows: list[dict]) -> str:
    """The README's sentence on the time of each pass, from MEMORY_MODES.json rows."""
    parts = []
    for r in rows:
        args = f", {r['options']}" if r["options"] else ""
        times = "; ".join(f"{mode}: {ratio:.2f}x" for mode, ratio in r["over_plain"].items() if mode != "plain")
        parts.append(f"- {r['model']} {r['targets']}{args} (the trace runs: {r['chosen']}) — {times}")
    return ("Time of each pass against the plain pass, side by side (`python -m benchmarks.memory_modes`, one "
            f"thread, median of {rows[0]['repeats']} rounds):\n\n" + "\n".join(parts)) if rows else ""


def main(argv: list[str] | None = None) -> int:
    """Command line entry (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory_modes")
    p.add_argument("--case", choices=sorted(CASES), action="append")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    rows = []
    for case in args.case or DEFAULT_CASES:
        rows.append(measure(case, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    if not args.case:
        OUT.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
