"""The Shapley row of the known-answer report: every preset's agreement with exact Shapley values on the bundled
model (shapes-vit, 64 px images, 4x4 groups of 16x16 px = 2^16 = 65,536 masked forward passes per image).

Usage::

    python scripts/shapley_known_answer.py                          # 2 images -> reports/known_answer/shapley.*
    python scripts/shapley_known_answer.py --n-images 20 --device cuda  # more images on a GPU

For each of ``--n-images`` images of ``vitcam_nb.data.shapes(n, seed)`` (seed 5150, the known-answer report's)
the exact Shapley values of the true class's logit are computed (:func:`vitcam_nb.evaluate.shapley_patches`, mean
baseline, as the report's deletion substrate) and every preset's token-grid map is ranked against them
(:func:`vitcam_nb.evaluate.shapley_agreement`: Spearman of the map pooled per group); the table also holds pointing
game and deletion AUC on the same images, as :func:`vitcam_nb.evaluate.report.presets.report_presets` measures
them. One image took 824 s here on two CPU cores shared with other jobs (about 3 ms per pass unshared): the default
of 2 images (the committed ``reports/known_answer/shapley.csv``: 1,370 s here) is a quick look, not a ranking.
Writes ``shapley.csv`` and ``shapley.json`` (the settings and the time taken) to ``--out``; a file of these names
that the script did not write there (the folder's manifest says) is refused unless ``--overwrite``. The Shapley
values themselves are kept in ``--cache`` (default ``shapley_values.json`` beside the report; ``--no-cache``
computes everything): they depend on the image, the grid, the baseline and the class, never on a map, so a rerun
that adds a method (e.g. the backward-rule presets) reads them instead of repeating 65,536 passes per image; the
settings say how many images were read.
The table has a ``rule`` column: the backward rule of the trace each row was computed from.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Example:
        >>> main(["--n-images", "1", "--grid", "2", "2", "--out", "/tmp/shapley"])  # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-images", type=int, default=2)
    p.add_argument("--seed", type=int, default=5150)
    p.add_argument("--grid", type=int, nargs=2, default=(4, 4), metavar=("ROWS", "COLUMNS"))
    p.add_argument("--baseline", default="mean", choices=("mean", "blur"))
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--device", default=None, help="run a copy of the model there (e.g. cuda)")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "known_answer")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--cache", type=Path, default=None,
                   help="JSON file of Shapley values to read and extend (default <out>/shapley_values.json)")
    p.add_argument("--no-cache", action="store_true", help="compute every Shapley value, read and write no cache")
    args = p.parse_args(argv)

    import vitcam_nb as vc
    from vitcam_nb.core.errors import OutputExistsError
    from vitcam_nb.core.outfiles import OutputFolder
    from vitcam_nb.evaluate.report.presets import report_presets

    out = args.out
    try:  # files of these names that this script did not write there are kept
        folder = OutputFolder(out, ["shapley.csv", "shapley.json"], "scripts/shapley_known_answer.py",
                              overwrite=args.overwrite)
    except OutputExistsError as exc:
        print(f"{exc}", file=sys.stderr)
        return 1
    model = vc.load_model("shapes-vit")
    if args.device is not None:
        model = model.to(args.device)
    t0 = time.perf_counter()
    table = report_presets(model, n_images=args.n_images, seed=args.seed, shapley_images=args.n_images,
                           shapley_grid=tuple(args.grid), shapley_baseline=args.baseline, batch_size=args.batch_size,
                           shapley_cache=None if args.no_cache else (args.cache or out / "shapley_values.json"),
                           progress=True)
    seconds = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    cols = [c for c in ("preset", "status", "rule", "shapley_agreement", "shapley_n_images", "pointing_game",
                        "deletion_auc", "recipe_id") if c in table.columns]
    folder.write("shapley.csv", lambda p: table[cols].to_csv(p, index=False))
    settings = {**table.attrs, "command": "python scripts/shapley_known_answer.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "seconds": round(seconds, 1), "device": str(args.device or "cpu")}
    if "shapley_cache" in settings:  # the repository's own paths relative, as in the command line
        settings["shapley_cache"] = settings["shapley_cache"].replace(str(ROOT) + "/", "")
    folder.write("shapley.json", lambda p: p.write_text(json.dumps(settings, indent=2, default=str) + "\n"))
    print(table[cols].to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
