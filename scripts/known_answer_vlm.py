"""Which sites and methods of the bundled VLM ``shapes-vlm`` point at the object a question asks about.

Usage::

    python scripts/known_answer_vlm.py --n-questions 300 --seed 7000 --out reports/known_answer/vlm

(``python scripts/known_answer_report.py --model shapes-vlm ...`` runs the same.) Writes ``known_answer_vlm.json``
(settings and one row per recipe), ``known_answer_vlm.csv`` and ``known_answer_vlm.md`` (a table) to ``--out``; the
scores are those of :func:`vitcam_nb.evaluate.report.known_answer_vlm.report_known_answer_vlm`. A file of those
names in ``--out`` that the kit did not write there (or that changed since) is refused before any work unless
``--overwrite``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

OUTPUTS = ("known_answer_vlm.json", "known_answer_vlm.csv", "known_answer_vlm.md")
COLUMNS = ("recipe", "recipe_id", "pointing_game", "auroc", "other_object", "token_pointing", "token_other",
           "pointing_game_colour",
           "pointing_game_where", "pointing_game_shape", "pointing_game_right", "n", "n_constant")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Example:
        >>> main(["--n-questions", "2", "--out", "/tmp/vlm_report"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shapes-vlm")
    parser.add_argument("--n-questions", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7_000)
    parser.add_argument("--out", default="reports/known_answer/vlm")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace report files in --out that the kit did not write there (or that changed since)")
    args = parser.parse_args(argv)
    return write_report(args.model, args.n_questions, args.seed, Path(args.out), overwrite=args.overwrite)


def write_report(model: str, n_questions: int, seed: int, out: Path, *, overwrite: bool = False) -> int:
    """Run the report and write its three files to ``out``.

    Example:
        >>> write_report("shapes-vlm", 2, 0, Path("/tmp/vlm_report"))  # doctest: +SKIP
        0
    """
    import torch

    from vitcam_nb.core.outfiles import OutputFolder
    from vitcam_nb.evaluate.report.known_answer_vlm import report_known_answer_vlm

    torch.set_num_threads(1)
    folder = OutputFolder(out, OUTPUTS, "scripts/known_answer_vlm.py", overwrite=overwrite)
    rows, settings = report_known_answer_vlm(model, n_questions=n_questions, seed=seed, progress=True)
    settings["command"] = (f"python scripts/known_answer_vlm.py --model {model} --n-questions {n_questions} "
                           f"--seed {seed} --out {out.as_posix()}")
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused or failed run leaves no folder behind
    text = json.dumps({"settings": settings, "rows": rows}, indent=1)
    folder.write("known_answer_vlm.json", lambda p: p.write_text(text, encoding="utf-8"))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: row[k] for k in COLUMNS} for row in rows)
    folder.write("known_answer_vlm.csv", lambda p: p.write_text(buf.getvalue(), encoding="utf-8"))
    md = _markdown(rows, settings)
    folder.write("known_answer_vlm.md", lambda p: p.write_text(md, encoding="utf-8"))
    for row in rows:
        print(f"{row['recipe']:45s} pointing {row['pointing_game']:.3f}  AUROC {row['auroc']:.3f}  "
              f"other object {row['other_object']:.3f}  token {row['token_pointing']:.3f} / {row['token_other']:.3f}")
    return 0


def _markdown(rows: list[dict], settings: dict) -> str:
    def num(v: float) -> str:
        return "—" if v != v else f"{v:.3f}"

    acc = ", ".join(f"{t} {v:.3f}" for t, v in settings["accuracy_per_type"].items())
    lines = ["# Known answer: shapes-vlm", "",
             f"{settings['n_questions']} questions of `{settings['generator']}` (per type "
             f"{settings['n_per_type']}); the model's greedy accuracy on them: {settings['accuracy']:.3f} ({acc}). "
             f"Target: {settings['target']}. Pointing game: the map's peak within {settings['tolerance_px']:.1f} px "
             "of the asked-about object's mask; other object: the same on the object NOT asked about (a map that "
             "binds the question scores lower there); AUROC: the map as a detector of the asked-about mask's "
             "pixels (0.5 is chance); token pointing / token other: the same recipe on the 4x4 grid of image tokens "
             "(no upsampling): does the highest token's patch hold a pixel of the asked-about (other) object; "
             "'right': the questions the model answers right. 'random peak': a map whose peak is a uniformly "
             "random pixel (or token), exact. A constant map (n_constant) has no peak and is left out of the "
             "means.", "",
             f"Regenerate: `{settings['command']}` ({settings['seconds']:.0f} s here).", "",
             "| recipe | recipe id | pointing game | other object | AUROC | token pointing | token other | colour "
             "| where | shape | right | constant |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['recipe']} | {r['recipe_id']} | {num(r['pointing_game'])} | {num(r['other_object'])} | "
              f"{num(r['auroc'])} | {num(r['token_pointing'])} | {num(r['token_other'])} | "
              f"{num(r['pointing_game_colour'])} | {num(r['pointing_game_where'])} | "
              f"{num(r['pointing_game_shape'])} | {num(r['pointing_game_right'])} | {r['n_constant']} |"
              for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
