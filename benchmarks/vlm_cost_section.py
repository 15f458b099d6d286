"""The generative-VLM trace-cost section of ``docs/performance.md``, written from the committed
``benchmarks/VLM_TRACE_COST.json`` (:mod:`benchmarks.items.vlm_trace_cost`), never by hand: one row per model with
the measured trace and baseline medians, the ratio and whether it meets its target, and the machine it ran on.

Usage::

    python -m benchmarks.vlm_cost_section            # rewrite the section between its markers
    python -m benchmarks.vlm_cost_section --check    # exit 1 if the page's section is not the JSON's
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JSON = ROOT / "benchmarks" / "VLM_TRACE_COST.json"
PAGE = ROOT / "docs" / "performance.md"
START, END = "<!-- vlm-trace-cost:start -->", "<!-- vlm-trace-cost:end -->"


def section(result: dict) -> str:
    """The section's text for one benchmark result (the JSON's dict).

    Example:
        >>> row = {"trace": {"median_s": 0.0125}, "baseline": {"median_s": 0.01}, "ratio": 1.25, "cpu_ratio": 1.2,
        ...        "target": 1.2, "workload": "w"}
        >>> print(section({"rows": {"m": row}, "date": "2026-12-07T00:00:00", "machine": {"cpu_model": "c",
        ...     "usable_cpus": 2}, "torch_threads": 1, "load_average_start": [1, 1, 1],
        ...     "load_average_end": [2, 2, 2], "command": "python -m x"}).splitlines()[2])
        | w | 12.5 ms | 10.0 ms | 1.25× (CPU time 1.20×) | ≤ 1.2: not met |
    """
    lines = ["| model | trace | forward + one batched backward | ratio (median of per-round ratios) | target |",
             "|---|---|---|---|---|"]
    for row in result["rows"].values():
        if not isinstance(row, dict) or "ratio" not in row:
            continue
        met = "met" if row["ratio"] <= row["target"] else "not met"
        lines.append(f"| {row['workload']} | {1e3 * row['trace']['median_s']:.1f} ms | "
                     f"{1e3 * row['baseline']['median_s']:.1f} ms | "
                     f"{row['ratio']:.2f}× (CPU time {row['cpu_ratio']:.2f}×) | ≤ {row['target']}: {met} |")
    m = result["machine"]
    start = "/".join(f"{v:.2f}" for v in result["load_average_start"])
    end = "/".join(f"{v:.2f}" for v in result["load_average_end"])
    lines += ["", f"Measured {result['date'][:10]} with `{result['command']}` on {m['cpu_model']}, "
                  f"{m['usable_cpus']} usable CPUs, torch threads {result['torch_threads']}, load average "
                  f"(1/5/15 min) {start} at start, {end} at end; every candidate timed in one interleaved loop."]
    return "\n".join(lines)


def render(page: str, result: dict) -> str:
    """``page`` with its section rewritten from ``result``."""
    head, rest = page.split(START, 1)
    return head + START + "\n" + section(result) + "\n" + END + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not what the JSON gives")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    want = render(page, json.loads(JSON.read_text()))
    if args.check:
        if want != page:
            print(f"{PAGE} is not what {JSON.name} gives: run python -m benchmarks.vlm_cost_section")
            return 1
        return 0
    PAGE.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
