"""Rank every Grad-CAM variant on the bundled known-answer model (pointing game, deletion AUC).

Usage::

    python scripts/known_answer_report.py --n-images 300 --seed 0 --out known_answer_report [--device cuda]
    python scripts/known_answer_report.py --model shapes-video --n-images 100 --seed 0 --out reports/video
    python scripts/known_answer_report.py --n-images 200 --seed 5150 --deletion-steps 4 --sites F1 \
        --weightings scorecam ablationcam --targets logit --out reports/known_answer/scored   # a subset

Writes ``known_answer_report.csv`` (one row per site x layer x weighting x target variant),
``known_answer_report.png`` and ``known_answer_report.json`` (the settings) to ``--out``; for the video model
``shapes-video``, ``known_answer_video.json`` (right frames and frame pointing per recipe, and the settings).

The bundled detector is scored by pointing game per detection instead (Grad-CAM at F1 of the last block and at
each of ``--sites`` of the block before; writes ``known_answer_detection.csv`` and ``.json``)::

    python scripts/known_answer_report.py --model shapes-yolos --n-images 200 --seed 0 \
        --out reports/known_answer/detection

A file of those names in ``--out`` that the kit did not write there (or that changed since), such as a report an
earlier version wrote without the folder's manifest, is refused before any work unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Example:
        >>> main(["--n-images", "2", "--out", "/tmp/report"])  # doctest: +SKIP
        0
    """
    from vitcam_nb.evaluate.report.known_answer import report_known_answer
    from vitcam_nb.models import bundled_names, model_card

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shapes-vit", help="bundled model name (default shapes-vit)")
    parser.add_argument("--n-images", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deletion-steps", type=int, default=16)
    parser.add_argument("--substrate", default="mean", choices=["mean", "image_mean", "blur", "nli"])
    parser.add_argument("--score", default="prob", choices=["prob", "logit"])
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default="known_answer_report")
    parser.add_argument("--sites", nargs="+", default=None, help="sites (default F1..F6)")
    parser.add_argument("--weightings", nargs="+", default=None, help="weightings (default every channel weighting)")
    parser.add_argument("--targets", nargs="+", default=None, help="targets (default logit, prob, logprob)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace report files in --out that the kit did not write there (or that changed since)")
    args = parser.parse_args(argv)
    if args.model == "shapes-yolos":
        return _detection(args)
    if args.model == "shapes-vlm":  # the VLM's own report: scripts/known_answer_vlm.py, next to this script
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from known_answer_vlm import write_report

        return write_report(args.model, args.n_images, args.seed, Path(args.out), overwrite=args.overwrite)
    if args.model in bundled_names() and "hf_config" in model_card(args.model):
        return _video(args)
    variants = {k: tuple(v) for k, v in (("sites", args.sites), ("weightings", args.weightings),
                                         ("targets", args.targets)) if v is not None}
    table, _ = report_known_answer(
        args.model, n_images=args.n_images, seed=args.seed, deletion_steps=args.deletion_steps, **variants,
        substrate=args.substrate, score=args.score, batch_size=args.batch_size, device=args.device,
        out_dir=args.out, progress=True, overwrite=args.overwrite,
    )
    print(table.head(20).to_string(index=False))
    return 0


def _detection(args: argparse.Namespace) -> int:
    """Pointing game per detection of the bundled detector: Grad-CAM at F1 of the last block and at each site of the
    block before it (in the last block only F1 reaches a detection token; F2 to F6 give constant maps there)."""
    import vitcam_nb as vc

    sites = args.sites or ("F1", "F2", "F3", "F4", "F5", "F6")
    recipes = {"gradcam F1 last": vc.Recipe(site="F1"),
               **{f"gradcam {site} second-to-last": vc.Recipe(site=site, layer=-2) for site in sites}}
    _table, summary = vc.evaluate.report_known_answer_detection(args.model, n_images=args.n_images, seed=args.seed,
                                                               recipes=recipes, out_dir=args.out,
                                                               overwrite=args.overwrite)
    for label, row in summary.items():
        print(f"{label}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    return 0


def _video(args: argparse.Namespace) -> int:
    """The video known answer (right frames, frame pointing) of a bundled video model, as JSON in ``--out``."""
    import json
    from pathlib import Path

    from vitcam_nb.core.outfiles import OutputFolder
    from vitcam_nb.evaluate.report.known_answer_video import report_known_answer_video

    out = Path(args.out)
    folder = OutputFolder(out, ["known_answer_video.json"], "scripts/known_answer_report.py", overwrite=args.overwrite)
    rows, settings = report_known_answer_video(args.model, n_clips=args.n_images, seed=args.seed)
    text = json.dumps({"settings": settings, "rows": rows}, indent=1)
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused or failed run leaves no folder behind
    folder.write("known_answer_video.json", lambda p: p.write_text(text, encoding="utf-8"))
    for row in rows:
        print(f"{row['recipe']:40s} right frames {row['right_frames']:.3f}  frame pointing {row['frame_pointing']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
