"""Write the "which metrics agree" table of ``docs/known_answer.md`` (linked from the README) from the
known-answer score card, between
``<!-- metric-agreement:start -->`` and ``<!-- metric-agreement:end -->``; nothing outside the markers is touched.

Usage::

    python scripts/known_answer_scorecard.py          # writes reports/known_answer/agreement_spearman.csv, ...
    python scripts/readme_metric_agreement.py         # -> README.md
    python scripts/readme_metric_agreement.py --check # exit 1 if README.md is not up to date

The table is the mean Spearman rank agreement (over the presets) of the metrics of one category with those of
another (same-category pairs: the metric with itself left out), then the most agreeing and the most disagreeing
pair of metrics from different categories.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- metric-agreement:start -->", "<!-- metric-agreement:end -->"


def read_matrix(path: Path) -> tuple[list[str], list[list[float]]]:
    """Metric names and the agreement matrix (NaN for empty cells) of an ``agreement_*.csv``.

    Example:
        >>> read_matrix  # doctest: +SKIP
    """
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    names = rows[0][1:]
    return names, [[float(v) if v else float("nan") for v in r[1:]] for r in rows[1:]]


def table(names: list[str], mat: list[list[float]], categories: dict[str, str], settings: dict) -> str:
    """The markdown block: category x category mean agreement, then the extreme cross-category pairs.

    Example:
        >>> print(table(["a", "b"], [[1.0, 0.5], [0.5, 1.0]], {"a": "x", "b": "y"},
        ...             {"n_images": 2, "presets": ["p"], "command": "c"}).splitlines()[2])
        | | x | y |
    """
    cats = list(dict.fromkeys(categories[n] for n in names))
    idx = {c: [i for i, n in enumerate(names) if categories[n] == c] for c in cats}

    def mean(a: str, b: str) -> str:
        vals = [mat[i][j] for i in idx[a] for j in idx[b] if i != j and mat[i][j] == mat[i][j]]
        return f"{sum(vals) / len(vals):+.2f}" if vals else "–"

    lines = [f"Mean Spearman rank agreement of the metrics' rankings of {len(settings['presets'])} presets "
             f"on {settings['n_images']} shapes images (`{settings['command']}`; +1: same ranking, -1: reversed; "
             "lower-is-better metrics negated first):", "",
             "| | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    lines += [f"| **{a}** | " + " | ".join(mean(a, b) for b in cats) + " |" for a in cats]
    pairs = [(mat[i][j], names[i], names[j]) for i in range(len(names)) for j in range(i + 1, len(names))
             if categories[names[i]] != categories[names[j]] and mat[i][j] == mat[i][j]]
    if pairs:
        hi, lo = max(pairs), min(pairs)
        lines += ["", f"Most agreeing across categories: {hi[1]} / {hi[2]} ({hi[0]:+.2f}); most disagreeing: "
                      f"{lo[1]} / {lo[2]} ({lo[0]:+.2f})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Example:
        >>> main(["--check"])  # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=ROOT / "reports" / "known_answer")
    p.add_argument("--readme", type=Path, default=ROOT / "docs" / "known_answer.md")
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    settings = json.loads((args.dir / "scorecard.json").read_text())
    names, mat = read_matrix(args.dir / "agreement_spearman.csv")
    body = table(names, mat, settings["metrics"], settings)
    text = args.readme.read_text()
    if START not in text or END not in text:
        print(body)
        return 1
    head, rest = text.split(START, 1)
    new = head + START + "\n" + body + "\n" + END + rest.split(END, 1)[1]
    if args.check:
        return 0 if new == text else 1
    args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
