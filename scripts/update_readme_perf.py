"""Write the README performance table from a benchmark JSON, between ``<!-- perf:start -->`` and
``<!-- perf:end -->``; nothing outside the markers is touched.

Usage::

    python scripts/update_readme_perf.py                      # benchmarks/RESULTS.json -> README.md
    python scripts/update_readme_perf.py --results benchmarks/results/latest.json --readme README.md
    python scripts/update_readme_perf.py --check              # exit 1 if README.md is not up to date

If the README has no markers, the table is printed and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import README_END, README_START, readme_table  # noqa: E402


def replace_between_markers(text: str, body: str) -> str | None:
    """``text`` with everything between the perf markers replaced by ``body``; None if a marker is missing.

    Example:
        >>> replace_between_markers("a\\n<!-- perf:start -->\\nold\\n<!-- perf:end -->\\nb", "new")
        'a\\n<!-- perf:start -->\\nnew\\n<!-- perf:end -->\\nb'
        >>> replace_between_markers("no markers", "new") is None
        True
    """
    start = text.find(README_START)
    end = text.find(README_END, start + len(README_START)) if start >= 0 else -1
    if start < 0 or end < 0:
        return None
    return text[: start + len(README_START)] + "\n" + body.strip("\n") + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    """Update (or, with ``--check``, verify) the README's performance section; returns the exit status."""
    p = argparse.ArgumentParser(prog="python scripts/update_readme_perf.py", description=__doc__.split("\n")[0])
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.json")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--check", action="store_true", help="do not write; exit 1 if the README is out of date")
    args = p.parse_args(argv)
    if not args.results.is_file():
        print(f"{args.results} does not exist; run `python -m benchmarks` first", file=sys.stderr)
        return 2
    body = readme_table(json.loads(args.results.read_text()))
    text = args.readme.read_text() if args.readme.is_file() else ""
    updated = replace_between_markers(text, body)
    if updated is None:
        print(body)
        print(f"\n{args.readme} has no {README_START} ... {README_END} markers: the table is printed above; "
              "ask the README's owner to add the markers", file=sys.stderr)
        return 1
    if args.check:
        if updated != text:
            print(f"{args.readme} is out of date with {args.results}", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        args.readme.write_text(updated)
        print(f"updated the performance section of {args.readme}")
    else:
        print(f"{args.readme} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
