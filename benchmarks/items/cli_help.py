"""How fast ``vitcam-nb --help`` answers (issue #51, item 6): the command's help against ``python -c "import torch"``,
each in a fresh interpreter, rounds interleaved in one run; target: help / import torch <= 0.7 (the parser is built
and read before anything heavy is imported, so the help pays for Python and the package's face only).

Run:  ``python -m benchmarks.items.cli_help [--rounds N] [--out FILE]`` (writes ``benchmarks/CLI_HELP.json``;
``--quick``: two rounds, no claim, written under ``benchmarks/results/``). ``import vitcam_nb`` is timed beside them
for scale. The help runs what the ``vitcam-nb`` console script runs (``vitcam_nb.cli:main``), with this checkout first
on ``PYTHONPATH``; every command's output is discarded and its exit status checked.
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
from pathlib import Path

from benchmarks.machine import machine_info, versions
from benchmarks.timing import paired_ratio

TARGET = 0.7
ROOT = Path(__file__).resolve().parent.parent
REPO = ROOT.parent
#: What each candidate runs in a fresh interpreter: the console script's body, the baseline, the package import.
COMMANDS = {
    "vitcam_nb_help": ["-c", "import sys; from vitcam_nb.cli import main; sys.exit(main())", "--help"],
    "import_torch": ["-c", "import torch"],
    "import_vitcam_nb": ["-c", "import vitcam_nb"],
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def timed_command(args: list[str]) -> float:
    """Wall seconds of ``python ARGS`` in a fresh interpreter (a failing command is an error, not a time).

    Example:
        >>> timed_command(["-c", "pass"]) > 0
        True
    """
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=REPO, env=_env(), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def run(rounds: int) -> dict:
    """Time the three commands once per round, the order rotated every round; medians and the paired ratio.

    Example:
        >>> run(1)["ratio_help_over_import_torch"] > 0  # doctest: +SKIP
        True
    """
    timed_command(COMMANDS["import_torch"])  # one untimed run each: the file cache is warm for every candidate
    timed_command(COMMANDS["vitcam_nb_help"])
    names = list(COMMANDS)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(timed_command(COMMANDS[name]))
    ratio = paired_ratio(samples["vitcam_nb_help"], samples["import_torch"])
    return {
        "item": "cli_help", "target": f"vitcam-nb --help / python -c 'import torch' <= {TARGET}",
        "ratio_help_over_import_torch": ratio, "holds": ratio <= TARGET, "rounds": rounds,
        "commands": {n: "python " + " ".join(a) for n, a in COMMANDS.items()},
        "median_s": {n: statistics.median(v) for n, v in samples.items()}, "samples_s": samples,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info("cpu"), "versions": versions(),
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: measure, print the JSON and write it to ``--out``.

    Example:
        >>> main(["--quick", "--out", "/tmp/cli_help.json"])  # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.items.cli_help", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="two rounds, no claim")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/CLI_HELP.json (quick: "
                   "benchmarks/results/cli_help-quick.json)")
    args = p.parse_args(argv)
    out = args.out or (ROOT / "results" / "cli_help-quick.json" if args.quick else ROOT / "CLI_HELP.json")
    result = run(2 if args.quick else args.rounds)
    result["command"] = "python -m benchmarks.items.cli_help " + " ".join(sys.argv[1:] if argv is None else argv)
    result["quick"] = bool(args.quick)
    text = json.dumps(result, indent=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
