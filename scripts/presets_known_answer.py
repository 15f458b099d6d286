"""Pointing game and deletion AUC of every preset (``vc.presets.names()``) on the bundled known-answer model.

Usage::

    python scripts/presets_known_answer.py --n-images 100 --seed 5150 --out reports/known_answer

Writes ``presets.csv`` (one row per preset; presets that do not apply to the model are listed with the reason;
column ``rule``: the backward rule of the trace each row was computed from, the rule presets' images being traced
once more with their rule) and ``presets.json`` (the settings) to ``--out``. ``--names`` limits the presets;
``--shapley-images k`` adds the Shapley agreement on the first k images, reading and extending ``--shapley-cache``.
A file of those names in ``--out`` that the kit did not write there (or that changed since) is refused before any
work unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Example:
        >>> main(["--n-images", "2", "--out", "/tmp/presets"])  # doctest: +SKIP
        0
    """
    from vitcam_nb.evaluate.report.presets import report_presets

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shapes-vit", help="bundled model name (default shapes-vit)")
    parser.add_argument("--n-images", type=int, default=100)
    parser.add_argument("--seed", type=int, default=5150)
    parser.add_argument("--deletion-steps", type=int, default=16)
    parser.add_argument("--out", default="reports/known_answer")
    parser.add_argument("--names", nargs="+", default=None, help="presets to measure (default: every preset)")
    parser.add_argument("--shapley-images", type=int, default=0, help="Shapley agreement on the first k images")
    parser.add_argument("--shapley-cache", default=None, help="JSON file of Shapley values to read and extend")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace presets.csv / presets.json in --out that the kit did not write there")
    args = parser.parse_args(argv)
    table = report_presets(args.model, n_images=args.n_images, seed=args.seed, deletion_steps=args.deletion_steps,
                           names=args.names, shapley_images=args.shapley_images, shapley_cache=args.shapley_cache,
                           out_dir=args.out, progress=True, overwrite=args.overwrite)
    print(table.drop(columns=["recipe"], errors="ignore").to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
