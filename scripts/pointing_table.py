"""Pointing-game accuracy of Grad-CAM per site (F1..F6) and layer on a bundled known-answer model.

Usage::

    python scripts/pointing_table.py [--model shapes-vit] [--n-images 300] [--seed 424242] [--layers 3]

For each of ``n`` fresh images of :func:`vitcam_nb.data.shapes` (a seed no model was trained or tested
on) the model is traced once, for its true class, and the default recipe (``gradcam`` weighting,
``logit`` target, patch tokens, bilinear upsampling, ReLU, min-max) is evaluated at every site of the
last ``--layers`` blocks, plus a few other weightings and layer fusions, Score-CAM and Ablation-CAM (their
forward passes stored by ``vc.score``).

Two scores per recipe, both on the map upsampled to 64x64 (ties count fractionally):

* ``strict``: the map's maximum lies inside the mask of the class object (tolerance 0);
* ``pointing``: the pointing game of Zhang et al. (2016) as ``vitcam_nb.evaluate.pointing_game``
  computes it, with its default tolerance (15 px at 224x224, scaled: 4.3 px at 64x64).

With 8x8-pixel patches the maximum of a bilinearly upsampled map sits at a patch centre, so a model
that looks at a ring's hole, a triangle's tip or a cross's inner corner (the parts that tell the classes
apart) misses the strict score by a pixel or two; the tolerance is there for that. Degenerate maps
(all-zero gradients, e.g. F3-F6 of the last block of a class-token model) point nowhere and count as
misses; a cell where every map is degenerate reads "degenerate". Prints a markdown
table (rows: layer, columns: site) and a few fused and attention-based recipes.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

SITES = ("F1", "F2", "F3", "F4", "F5", "F6")


def hit(saliency: np.ndarray, mask: np.ndarray) -> float:
    """1.0 if the map's maximum is inside ``mask`` (ties: the fraction of tied maxima inside), 0.0 for a
    constant map.

    Example:
        >>> m = np.zeros((4, 4)); m[0, 0] = 1; mask = np.zeros((4, 4), bool); mask[0, 0] = True
        >>> hit(m, mask), hit(m, ~mask), hit(np.zeros((4, 4)), mask)
        (1.0, 0.0, 0.0)
    """
    if not np.isfinite(saliency).all() or np.ptp(saliency) == 0:
        return 0.0
    peaks = saliency == saliency.max()
    return float(mask[peaks].mean())


def pointing_table(
    model_name: str = "shapes-vit", n_images: int = 300, seed: int = 424_242, n_layers: int = 3
) -> tuple[dict, dict, dict]:
    """Pointing-game accuracies: ``(per_site, extra, info)``.

    ``per_site[(layer, site)]`` is ``(pointing, strict)`` for ``Recipe(site=site, layer=layer)``;
    ``extra`` maps a description of a few other recipes to the same pair; ``info`` holds the model
    accuracy and timing.

    Example:
        >>> per_site, extra, info = pointing_table(n_images=4)  # doctest: +SKIP
    """
    import torch

    import vitcam_nb as vc
    from vitcam_nb.data import shapes
    from vitcam_nb.evaluate import pointing_game
    from vitcam_nb.models import load_model

    torch.set_num_threads(1)  # a tiny model: one thread is fastest

    model = load_model(model_name)
    depth = len(model.blocks)
    layers = list(range(depth - n_layers, depth))
    extra_recipes = {
        "F1, all layers, layer_fusion=mean": vc.Recipe(site="F1", layer="all", layer_fusion="mean"),
        "F1, all layers, layer_fusion=max": vc.Recipe(site="F1", layer="all", layer_fusion="max"),
        "F2 (attention Grad-CAM, CLS row), last layer": vc.Recipe(site="F2", layer=-1),
        "F2, all layers, grad_rollout": vc.Recipe(site="F2", layer="all", layer_fusion="grad_rollout"),
        "F2, all layers, rollout": vc.Recipe(site="F2", layer="all", layer_fusion="rollout"),
        "F1, last layer, layercam": vc.Recipe(site="F1", layer=-1, weighting="layercam"),
        "F1, last layer, hirescam": vc.Recipe(site="F1", layer=-1, weighting="hirescam"),
        "F1, last layer, gradcam_elementwise": vc.Recipe(site="F1", layer=-1, weighting="gradcam_elementwise"),
        "F1, all layers, hirescam, layer_fusion=mean": vc.Recipe(
            site="F1", layer="all", weighting="hirescam", layer_fusion="mean"
        ),
        "F1, all layers, layercam, layer_fusion=mean": vc.Recipe(
            site="F1", layer="all", weighting="layercam", layer_fusion="mean"
        ),
        # model-in-the-loop weightings: vc.score stores their forward passes in the trace first
        "F1, last layer, scorecam (Wang et al. 2020)": vc.Recipe(site="F1", layer=-1, weighting="scorecam"),
        "F1, last layer, ablationcam (Ramaswamy et al. 2020)": vc.Recipe(site="F1", layer=-1, weighting="ablationcam"),
    }
    scored = [r for r in extra_recipes.values() if r.weighting in ("scorecam", "ablationcam")]
    images, labels, masks = shapes(n_images, seed=seed)
    hits = {(layer, site): [] for layer in layers for site in SITES}
    extra_hits = {k: [] for k in extra_recipes}
    correct = 0
    t0 = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        for img, label, mask in zip(images, labels, masks):
            tr = vc.trace(model, img, targets=[int(label)])
            tr = vc.score(tr, model, scored, img, batch_size=64, progress=False)
            correct += int(int(np.argmax(tr["logits"].values)) == int(label))
            for layer in layers:
                for site in SITES:
                    m = vc.cam(tr, vc.Recipe(site=site, layer=layer, class_=int(label)))
                    hits[(layer, site)].append(_scores(m, mask, pointing_game))
            for key, recipe in extra_recipes.items():
                if recipe.layer_fusion != "rollout":  # rollout uses no gradient and no class
                    recipe = recipe.replace(class_=int(label))
                extra_hits[key].append(_scores(vc.cam(tr, recipe), mask, pointing_game))
    per_site = {k: _mean_scores(v) for k, v in hits.items()}
    extra = {k: _mean_scores(v) for k, v in extra_hits.items()}
    info = {
        "model": model_name,
        "n_images": n_images,
        "seed": seed,
        "accuracy": correct / n_images,
        "seconds": time.time() - t0,
        "depth": depth,
    }
    return per_site, extra, info


def _scores(m: object, mask: np.ndarray, pointing_game: object) -> tuple[float, float]:
    """(pointing, strict) of one map; NaN for a degenerate map."""
    values = m.values
    if m.attrs.get("degenerate") or not np.isfinite(values).all() or np.ptp(values) == 0:
        return (np.nan, np.nan)
    return (float(pointing_game(values, mask)), hit(values, mask))


def _mean_scores(scores: list[tuple[float, float]]) -> tuple[float, float]:
    # a degenerate map points nowhere (a miss); a cell whose maps are all degenerate becomes NaN
    arr = np.array(scores, dtype=float)
    if np.isnan(arr).all():
        return (float("nan"), float("nan"))
    return tuple(float(x) for x in np.nan_to_num(arr).mean(axis=0))


def _cell(value: tuple[float, float]) -> str:
    if np.isnan(value[0]):
        return "degenerate"
    return f"{value[0]:.2f} ({value[1]:.2f})"


def to_markdown(per_site: dict, extra: dict, info: dict) -> str:
    """Render the results of :func:`pointing_table` as markdown.

    Example:
        >>> print(to_markdown({(5, "F1"): (0.9, 0.5)}, {}, {"model": "m", "n_images": 1, "seed": 0,
        ...     "accuracy": 1.0, "seconds": 0.0, "depth": 6}).splitlines()[4])
        | 5 (= -1) | 0.90 (0.50) |
    """
    layers = sorted({layer for layer, _ in per_site})
    sites = [s for s in SITES if any((layer, s) in per_site for layer in layers)]
    lines = [
        f"Pointing game on `{info['model']}` ({info['n_images']} fresh images, `shapes(seed={info['seed']})`, "
        f"model accuracy {info['accuracy']:.3f}); target: logit of the true class; default recipe otherwise. "
        "Each cell: pointing game with the standard tolerance (4.3 px at 64x64), in brackets the strict "
        "score (maximum inside the object mask).",
        "",
        "| layer | " + " | ".join(sites) + " |",
        "|---|" + "---|" * len(sites),
    ]
    for layer in layers:
        name = f"{layer} (= {layer - info['depth']})"
        cells = [_cell(per_site[(layer, s)]) for s in sites]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if extra:
        lines += ["", "| other recipe | pointing (strict) |", "|---|---|"]
        lines += [f"| {k} | {_cell(v)} |" for k, v in extra.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Example:
        >>> main(["--n-images", "4"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shapes-vit")
    parser.add_argument("--n-images", type=int, default=300)
    parser.add_argument("--seed", type=int, default=424_242)
    parser.add_argument("--layers", type=int, default=3, help="how many of the last blocks to tabulate")
    parser.add_argument("--readme", default=None, help="also write the table into this README between "
                        "<!-- pointing:start --> and <!-- pointing:end -->")
    args = parser.parse_args(argv)
    per_site, extra, info = pointing_table(args.model, args.n_images, args.seed, args.layers)
    table = to_markdown(per_site, extra, info)
    print(table)
    if args.readme:
        path = Path(args.readme)
        text = path.read_text()
        start, end = "<!-- pointing:start -->", "<!-- pointing:end -->"
        if start not in text or end not in text:
            print(f"{path} has no {start} ... {end} markers", file=sys.stderr)
            return 1
        head, rest = text.split(start, 1)
        path.write_text(head + start + "\n" + table.strip() + "\n" + end + rest.split(end, 1)[1])
    print(f"\n({info['seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
