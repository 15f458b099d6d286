"""Robustness of many recipes at once (issue #22): ``vc.evaluate.robustness`` (one trace per perturbed input, then
pure computation for every recipe) against Quantus 0.6 ``MaxSensitivity`` driving pytorch-grad-cam 1.5.7 recipe by
recipe, in the same run, on the same image and the same seeded perturbations.

The recipes are pytorch-grad-cam's ViT recipe (site F1 = ``blocks[i].norm1`` output, its ``reshape_transform``) with
five weightings (GradCAM, HiResCAM, GradCAM++, XGradCAM, LayerCAM) on the last ten blocks: 50 recipes. Quantus gets a
``perturb_func`` that replays the kit's perturbations, so both see the same inputs.

The two sides run in interleaved rounds (kit, Quantus, kit, Quantus, ...). Quantus's cost is the same for every
recipe (it reruns pytorch-grad-cam, a full forward and backward pass of the model, on the input and on each
perturbation: ``n + 1`` passes per recipe whatever the layer or weighting), so by default each round runs Quantus on
a *subset* of the recipes (``--quantus-recipes``, default 5 per round: one per weighting, at layers that differ from
round to round) and the full 50-recipe time is that round's time per recipe x 50; ``--quantus-recipes 50`` runs
them all (about 40 min on one thread of the shared 2-core machine). The kit side always scores all 50 recipes.

    python -m benchmarks.robustness --threads 1                 # ViT-B/16 (random init, no download), 50 recipes
    python -m benchmarks.robustness --quick                     # tiny ViT, 4 recipes, 2 perturbations: smoke run

Writes ``benchmarks/ROBUSTNESS.json`` (full run) or ``benchmarks/results/robustness_quick.json`` (``--quick``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path

import numpy as np
import torch

WEIGHTINGS = {"gradcam": "GradCAM", "hirescam": "HiResCAM", "gradcampp": "GradCAMPlusPlus", "xgradcam": "XGradCAM",
              "layercam": "LayerCAM"}


def _model(quick: bool) -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    if quick:
        return timm.create_model("vit_tiny_patch16_224", depth=4, pretrained=False).eval()
    return timm.create_model("vit_base_patch16_224", pretrained=False).eval()


def _recipes(model: torch.nn.Module, n_layers: int, weightings: list[str]) -> list[tuple[str, int]]:
    depth = len(model.blocks)
    return [(w, layer) for w in weightings for layer in range(depth - n_layers, depth)]


def _quantus_side(model, x, xs, target, recipes) -> tuple[np.ndarray, float]:
    import pytorch_grad_cam
    import quantus
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    from benchmarks.peers import vit_reshape_transform

    values = []
    t0 = time.perf_counter()
    for weighting, layer in recipes:
        cls = getattr(pytorch_grad_cam, WEIGHTINGS[weighting])
        with cls(model=model, target_layers=[model.blocks[layer].norm1],
                 reshape_transform=vit_reshape_transform(model)) as cam:

            def explain(model, inputs, targets, cam=cam, **kw):
                t = torch.as_tensor(np.asarray(inputs, np.float32))
                return cam(input_tensor=t, targets=[ClassifierOutputTarget(int(c)) for c in np.atleast_1d(targets)])[
                    :, None]

            replay = iter(xs)
            metric = quantus.MaxSensitivity(nr_samples=len(xs), disable_warnings=True,
                                            perturb_func=lambda arr, indices=None, replay=replay, **k: next(
                                                replay).reshape(arr.shape))
            a = explain(model, x, [target])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                values.append(float(metric(model=model, x_batch=x, y_batch=np.array([target]), a_batch=a,
                                           explain_func=explain, channel_first=True, device="cpu")[0]))
    return np.array(values), time.perf_counter() - t0


def _kit_side(model, x, target, recipes, n, seed) -> tuple[np.ndarray, float]:
    import vitcam_nb as vc
    from vitcam_nb.evaluate import robustness

    rs = [vc.presets.pytorch_grad_cam_vit().replace(weighting=w, layer=layer) for w, layer in recipes]
    t0 = time.perf_counter()
    out = robustness(model, x, rs, n=n, radius=0.2, seed=seed, target=target, metrics=("max_sensitivity",))
    return out.values[:, 0], time.perf_counter() - t0


def _subset(recipes: list[tuple[str, int]], k: int, rnd: int) -> list[int]:
    """``k`` recipe indices, round-robin over the weightings, shifted by round so rounds cover other layers."""
    by_w: dict[str, list[int]] = {}
    for i, (w, _) in enumerate(recipes):
        by_w.setdefault(w, []).append(i)
    order = [idx[(j * 3 + rnd * 7) % len(idx)] for j in range(max(len(v) for v in by_w.values()))
             for idx in by_w.values()]
    return list(dict.fromkeys(order))[:k]


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison and write the JSON; returns the result.

    Example:
        >>> callable(main)
        True
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--n", type=int, default=10, help="perturbations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (kit, Quantus) x rounds")
    p.add_argument("--quantus-recipes", type=int, default=5, help="recipes Quantus runs per round (50 = all)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from vitcam_nb.evaluate import model_input, perturb

    model = _model(args.quick)
    n = 2 if args.quick else args.n
    recipes = _recipes(model, 2 if args.quick else 10, ["gradcam", "layercam"] if args.quick else list(WEIGHTINGS))
    img = np.random.default_rng(args.seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    x, _ = model_input(model, img)
    with torch.no_grad():
        target = int(model(x).argmax())
    xs = perturb(x, n, 0.2, args.seed).numpy()
    rounds = []
    for rnd in range(args.rounds):
        ours, t_ours = _kit_side(model, x, target, recipes, n, args.seed)
        pick = _subset(recipes, min(args.quantus_recipes, len(recipes)), rnd)
        theirs, t_theirs = _quantus_side(model, x.numpy(), xs, target, [recipes[i] for i in pick])
        per_recipe = t_theirs / len(pick)
        rounds.append({"kit_s": t_ours, "quantus_recipes": [f"{w}@{layer}" for w, layer in (recipes[i] for i in pick)],
                       "quantus_s": t_theirs, "quantus_s_per_recipe": per_recipe,
                       "quantus_all_recipes_s": per_recipe * len(recipes),
                       "speedup": per_recipe * len(recipes) / t_ours,
                       "max_abs_diff_max_sensitivity": float(np.nanmax(np.abs(ours[pick] - theirs))),
                       "kit_values": ours[pick].tolist(), "quantus_values": theirs.tolist()})
        print(json.dumps(rounds[-1]), flush=True)
    kit_s = float(np.median([r["kit_s"] for r in rounds]))
    q_s = float(np.median([r["quantus_all_recipes_s"] for r in rounds]))
    result = {
        "command": "python -m benchmarks.robustness" + (" --quick" if args.quick else "")
                   + (f" --threads {args.threads}" if args.threads else "")
                   + f" --rounds {args.rounds} --quantus-recipes {args.quantus_recipes}",
        "model": "vit_tiny_patch16_224 (depth 4)" if args.quick else "vit_base_patch16_224 (random init)",
        "n_recipes": len(recipes), "n_perturbations": n, "seed": args.seed, "radius": 0.2,
        "method": "interleaved rounds; the kit scores all recipes each round, Quantus+pytorch-grad-cam a subset per "
                  "round (its cost per recipe does not depend on the recipe), scaled to all recipes",
        "kit_s": kit_s, "quantus_pytorch_grad_cam_s": q_s, "speedup": q_s / kit_s,
        "speedup_per_round": [r["speedup"] for r in rounds],
        "target_speedup": 20.0, "target_met": bool(min(r["speedup"] for r in rounds) >= 20.0),
        "max_abs_diff_max_sensitivity": max(r["max_abs_diff_max_sensitivity"] for r in rounds),
        "rounds": rounds,
        "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "load_average_at_end": list(__import__("os").getloadavg()),
        "versions": {"torch": torch.__version__},
    }
    out = args.out or (Path("benchmarks/results/robustness_quick.json") if args.quick
                       else Path("benchmarks/ROBUSTNESS.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
