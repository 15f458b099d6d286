"""Score card of every preset x the score card's metrics on the bundled known-answer model (shapes-vit).

Usage::

    python scripts/known_answer_scorecard.py                   # 200 fresh shapes images -> reports/known_answer/
    python scripts/known_answer_scorecard.py --n-images 20 --out /tmp/sc      # quick look

Fresh images: ``vitcam_nb.data.shapes(n, seed)`` with a seed (default 2212) other than the known-answer report's
(5150). Every preset of ``vc.presets.names()`` is scored, each recipe once (presets that are the same recipe are
listed as aliases); a preset that cannot be computed on a shapes-vit trace is skipped with the reason its refusal
gives. Each image's maps explain its true class. ``--metrics`` picks the metrics: by default the 13 of the
committed report (:data:`REPORT_METRICS`); ``--metrics all`` adds every metric registered since (faithfulness and
monotonicity correlation, IROF, SaCo, efficient MPRT: about a hundred model calls per map each); the Shapley row,
``shapley_agreement`` (exact Shapley values of 4x4 patch groups: 65,536 model calls per image), runs only when named
(``--metrics pointing_game shapley_agreement``; ``scripts/shapley_known_answer.py`` writes it for the presets' report).
Writes to ``--out``:

* ``scorecard.nc``: the score card Dataset (``vc.evaluate.scorecard``; per-image values included);
* ``scorecard.csv``: preset, recipe id, metric, category, mean, 95 % interval, count;
* ``agreement_spearman.csv`` / ``agreement_kendall.csv``: rank agreement of the metrics over the presets;
* ``scorecard.png``, ``agreement.png``: the figures; ``scorecard.json``: settings, aliases, skipped presets, time.

``python scripts/readme_metric_agreement.py`` writes the README's table from these files.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: What the presets read: F1 and F2 for the Grad-CAM family and the rollouts, F3, q, k, v, attn_scores and
#: resid_pre for the published attention-gradient methods (Grad-SAM, AttCAT, AG-CAM, Grad-ECLIP's formula).
SITES = ("F1", "F2", "F3", "q", "k", "v", "attn_scores", "resid_pre")
#: The metrics of the committed report (reports/known_answer/scorecard.*).
REPORT_METRICS = ("pointing_game", "energy_pointing_game", "relevance_mass_accuracy", "relevance_rank_accuracy",
                  "auroc", "sparseness", "complexity", "effective_complexity", "deletion_auc", "insertion_auc",
                  "max_sensitivity", "avg_sensitivity", "randomised_logit")


def presets_for(trace):
    """``(names, recipes, aliases, skipped)``: each distinct preset recipe that computes on ``trace``.

    Example:
        >>> presets_for  # doctest: +SKIP
    """
    import vitcam_nb as vc
    from vitcam_nb.core.errors import DegenerateMapWarning, RecipeError, TraceError

    names, recipes, aliases, skipped = [], [], {}, {}
    label = int(trace.attrs.get("image_label", -1))
    for name in vc.presets.names():
        recipe = vc.presets.get(name)
        same = [n for n, r in zip(names, recipes, strict=True) if r.id == recipe.id]
        if same:
            aliases[name] = same[0]
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DegenerateMapWarning)
                rollout = recipe.layer_fusion == "rollout"  # uses no class
                vc.cam(trace, recipe.replace(class_=label) if label >= 0 and not rollout else recipe)
        except (RecipeError, TraceError, ValueError, TypeError) as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        names.append(name)
        recipes.append(recipe)
    return names, recipes, aliases, skipped


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Example:
        >>> main(["--n-images", "2", "--out", "/tmp/sc"])  # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-images", type=int, default=200)
    p.add_argument("--seed", type=int, default=2212)
    p.add_argument("--robustness-n", type=int, default=3, help="perturbations per image for robustness")
    p.add_argument("--deletion-step", type=int, default=16,
                   help="token cells per deletion/insertion step (16 = 4 steps on the 8x8 grid, as the report)")
    p.add_argument("--n-boot", type=int, default=1000)
    p.add_argument("--metrics", nargs="+", default=list(REPORT_METRICS),
                   help="metric names, or 'all' for every registered metric (default: the report's 13)")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "known_answer")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    import torch

    import vitcam_nb as vc
    from vitcam_nb.data import shapes

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = vc.load_model("shapes-vit").eval()
    images, labels, masks = shapes(args.n_images, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = vc.trace_many(model, list(images), Path(tmp) / "shapes.zarr", targets=f"top{model.num_classes}",
                             sites=list(SITES), image_labels=[int(v) for v in labels], masks=list(masks),
                             batch_size=32, progress=True)
        ds = vc.open_traces(path)
        names, recipes, aliases, skipped = presets_for(vc.image_trace(ds, 0))
        metrics = None if args.metrics == ["all"] else args.metrics
        card = vc.evaluate.scorecard(ds, recipes, metrics, model=model, target="label", n_boot=args.n_boot,
                                     seed=args.seed, settings={"robustness": {"n": args.robustness_n},
                                               "faithfulness": {"step": args.deletion_step}}, progress=True)
        card = card.load()
        ds.close()
    seconds = time.perf_counter() - t0
    card = card.assign_coords(preset=("recipe", names))
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    card.to_netcdf(out / "scorecard.nc")
    rows = ["preset,recipe_id,metric,category,higher_is_better,mean,low,high,count"]
    for i, name in enumerate(names):
        for j, metric in enumerate(card["metric"].values):
            one = card.isel(recipe=i, metric=j)
            rows.append(f"{name},{card['recipe'].values[i]},{metric},{one['category'].item()},"
                        f"{bool(one['higher_is_better'])},{float(one['mean']):.6g},{float(one['low']):.6g},"
                        f"{float(one['high']):.6g},{int(one['count'])}")
    (out / "scorecard.csv").write_text("\n".join(rows) + "\n")
    for method in ("spearman", "kendall"):
        mat = card.scorecard.agreement(method)
        metrics = [str(m) for m in mat["metric"].values]
        lines = ["metric," + ",".join(metrics)]
        lines += [f"{m}," + ",".join("" if np.isnan(v) else f"{v:.4f}" for v in mat.values[i])
                  for i, m in enumerate(metrics)]
        (out / f"agreement_{method}.csv").write_text("\n".join(lines) + "\n")
    card.scorecard.plot(labels=dict(zip(card["recipe"].values.tolist(), names, strict=True))).savefig(
        out / "scorecard.png", dpi=120)
    card.scorecard.plot_agreement().savefig(out / "agreement.png", dpi=120)
    settings = {
        "command": "python scripts/known_answer_scorecard.py" + (" " + " ".join(argv) if argv else
                                                                 " " + " ".join(sys.argv[1:])).rstrip(),
        "model": "shapes-vit", "sites": list(SITES), "n_images": args.n_images, "seed": args.seed,
        "target": "true label",
        "robustness": {"n": args.robustness_n, "radius": 0.2}, "n_boot": args.n_boot,
        "faithfulness": {"mode": "token", "step_cells": args.deletion_step, "score": "prob",
                         "deletion_substrate": "mean", "insertion_substrate": "blur"},
        "metrics": {str(m): str(c) for m, c in zip(card["metric"].values, card["category"].values, strict=True)},
        "presets": names, "aliases": aliases, "skipped": skipped, "seconds": round(seconds, 1),
        "torch_threads": 1,
    }
    (out / "scorecard.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(json.dumps(settings, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
