"""Robustness: how much a map moves when the input moves a little, for every recipe at once.

The kit traces the original and each perturbed copy once, in memory (batched forward and backward passes of the
tracer, only the sites and layers the recipes read; no store); every recipe's maps are then recomputed from those
traces with no model call (recipes that differ only in their layer in one gallery call per trace), and the metrics
are pure functions of the maps, inputs and logits
(:func:`robustness_scores`). Quantus instead reruns the explainer per recipe and per perturbation.

Perturbations are uniform noise ``U(-radius, radius)`` on every element of the normalised model input, drawn from
``numpy.random.default_rng(seed)`` (:func:`perturb`); the seed, radius and count are recorded in the result.

* **max_sensitivity** / **avg_sensitivity** (Yeh et al. 2019): the largest / mean ``||m_j - m||_F / ||m||_F``.
* **local_lipschitz** (Alvarez-Melis and Jaakkola 2018): the largest ``||m_j - m||_2 / ||x_j - x||_2``.
* **relative_input_stability** / **relative_output_stability** (Agarwal et al. 2022): the largest
  ``||(m - m_j) / m||_2`` over ``max(||(x - x_j) / x||_2, eps)``, resp. over ``max(||z - z_j||_2, eps)`` with
  ``z`` the logits; a zero in ``m`` or ``x`` is replaced by ``eps`` (as Quantus does). Unlike Quantus's default
  (``return_nan_when_prediction_changes=True``) no perturbation is dropped when the prediction changes; the result
  records how many did.

Lower is more robust for all five.

Example:
    >>> m, x, z = np.ones((2, 2)), np.ones(3), np.ones(2)
    >>> s = robustness_scores(m, np.stack([m, 2 * m]), x, np.stack([x, x + 0.5]), z, np.stack([z, z]))
    >>> s["max_sensitivity"], s["avg_sensitivity"]
    (1.0, 0.5)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from vitcam_nb.capture.assemble import assemble
from vitcam_nb.capture.passes import run_pass
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.runtime import exclusive, on_device
from vitcam_nb.core.errors import ArgumentError, DegenerateMapWarning
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.weighting import WEIGHTINGS
from vitcam_nb.evaluate._common import nan_because
from vitcam_nb.evaluate.faithfulness.perturbation import Scorer, model_input
from vitcam_nb.preprocess import prepare_input

__all__ = ["ROBUSTNESS_METRICS", "perturb", "robustness", "robustness_scores"]

ROBUSTNESS_METRICS = ("max_sensitivity", "avg_sensitivity", "local_lipschitz", "relative_input_stability",
                      "relative_output_stability")
_EPS = 1e-6  # Quantus's eps_min for the relative stabilities


def perturb(x: torch.Tensor, n: int = 10, radius: float = 0.2, seed: int = 0) -> torch.Tensor:
    """``n`` copies of the model input ``x`` (1, C, H, W) with uniform noise in ``[-radius, radius]`` added to every
    element, drawn from ``numpy.random.default_rng(seed)``: ``(n, C, H, W)``.

    Example:
        >>> p = perturb(torch.zeros(1, 3, 2, 2), n=4, radius=0.1)
        >>> tuple(p.shape), bool(p.abs().max() <= 0.1)
        ((4, 3, 2, 2), True)
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ArgumentError(f"n: expected a positive int number of perturbations, got {n!r}")
    if isinstance(radius, bool) or not isinstance(radius, (int, float)) or not (np.isfinite(radius) and radius > 0):
        raise ArgumentError(f"radius: expected a positive finite noise bound (model-input units), got {radius!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ArgumentError(f"seed: expected a non-negative int, got {seed!r}")
    noise = np.random.default_rng(seed).uniform(-radius, radius, size=(int(n),) + tuple(x.shape[1:]))
    return x[0].unsqueeze(0) + torch.from_numpy(noise.astype(np.float32))


def _relative(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``||(a - b_j) / a||_2`` per row of ``b``, a zero in ``a`` replaced by eps."""
    a = a.ravel()
    b = b.reshape(len(b), -1)
    den = np.where(a == 0, _EPS, a)
    return np.linalg.norm((a - b) / den, axis=1)


def robustness_scores(
    saliency: np.ndarray, perturbed: np.ndarray, x: np.ndarray, x_perturbed: np.ndarray, logits: np.ndarray,
    logits_perturbed: np.ndarray, metrics: Sequence[str] = ROBUSTNESS_METRICS,
) -> dict[str, float]:
    """The robustness metrics of one map from the map of the input and the maps of its perturbed copies (pure).

    Args:
        saliency: the map of the original input; perturbed: the maps of the ``n`` copies, ``(n, ...)``.
        x, x_perturbed: the model inputs (original and ``(n, ...)``); logits, logits_perturbed: the model's logits.
        metrics: names from :data:`ROBUSTNESS_METRICS`.

    Example:
        >>> robustness_scores(np.ones(2), np.ones((1, 2)), np.ones(2), np.zeros((1, 2)), np.ones(2),
        ...                   np.ones((1, 2)), ["local_lipschitz"])
        {'local_lipschitz': 0.0}
    """
    unknown = [m for m in metrics if m not in ROBUSTNESS_METRICS]
    if unknown:
        raise ArgumentError(f"metrics: unknown robustness metric(s) {unknown}; expected names from "
                            f"{ROBUSTNESS_METRICS}")
    m = np.asarray(saliency, np.float64)
    mj = np.asarray(perturbed, np.float64).reshape(-1, *m.shape)
    n = len(mj)
    diff = np.linalg.norm((mj - m).reshape(n, -1), axis=1)
    base = float(np.linalg.norm(m))
    out: dict[str, float] = {}
    for name in metrics:
        if name in ("max_sensitivity", "avg_sensitivity"):
            if base == 0.0:
                out[name] = nan_because(name, "the map of the original input is all zeros (nothing to move)")
                continue
            ratio = diff / base
            out[name] = float(ratio.max() if name == "max_sensitivity" else ratio.mean())
        elif name == "local_lipschitz":
            dx = np.linalg.norm((np.asarray(x_perturbed, np.float64) - np.asarray(x, np.float64)).reshape(n, -1),
                                axis=1)
            out[name] = float(np.max(diff / np.maximum(dx, _EPS)))
        else:
            num = _relative(m, mj)
            if name == "relative_input_stability":
                den = _relative(np.asarray(x, np.float64), np.asarray(x_perturbed, np.float64).reshape(n, -1))
            else:
                dz = np.asarray(logits_perturbed, np.float64).reshape(n, -1) - np.asarray(logits, np.float64).ravel()
                den = np.linalg.norm(dz, axis=1)
            out[name] = float(np.max(num / np.maximum(den, _EPS)))
    return out


def _traced_sites(trace: xr.Dataset) -> set[str]:
    sites = {str(s) for s in trace["site"].values} if "site" in trace.coords else set()
    return sites | {site for var, site in (("attn", "F2"), ("attn_scores", "attn_scores")) if var in trace}


def _traces(model: torch.nn.Module, inputs: torch.Tensor, target: int, recipes: list[Recipe],
            batch_size: int, source: object) -> list[xr.Dataset]:
    """One in-memory single-image trace per input row, of only the sites and layers the recipes read."""
    sites = {r.site for r in recipes}
    if isinstance(source, xr.Dataset) and any(WEIGHTINGS.get(r.weighting).method for r in recipes):
        sites |= _traced_sites(source)  # a published method reads several sites: those the user traced
    sites = sorted(sites)
    layers = None
    if all(isinstance(r.layer, (int, tuple)) for r in recipes):
        layers = sorted({int(v) for r in recipes for v in (r.layer if isinstance(r.layer, tuple) else (r.layer,))})
    plan = TracePlan.for_store(model, int(target), sites=sites, layers=layers)
    inner = plan.model
    prepared = [prepare_input(inner, row.unsqueeze(0)) for row in inputs]
    out: list[xr.Dataset] = []
    with exclusive(inner), on_device(inner, plan.run_device):
        for start in range(0, len(prepared), batch_size):
            chunk = prepared[start:start + batch_size]
            run = run_pass(plan, torch.cat([p.tensor for p in chunk]))
            out += [assemble(plan, p, run.image(b), run) for b, p in enumerate(chunk)]
    return out


def _for_class(recipe: Recipe, target: int) -> Recipe:
    """The recipe explaining ``target``; attention rollout uses no class and stays as it is."""
    return recipe if recipe.layer_fusion == "rollout" else recipe.replace(class_=target)


def _all_maps(traces: list[xr.Dataset], recipes: list[Recipe]) -> list[np.ndarray]:
    """For each recipe its maps on every trace ``(n_traces, ...)``; recipes equal but for an int layer share one
    gallery over the layers per trace (the same maps as ``cam``, computed together)."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(recipes):
        key = r.replace(layer=0).id if isinstance(r.layer, int) else f"single:{i}"
        groups.setdefault(key, []).append(i)
    out: list[np.ndarray | None] = [None] * len(recipes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateMapWarning)
        for members in groups.values():
            first = recipes[members[0]]
            if len(members) == 1:
                out[members[0]] = np.stack([np.asarray(kind_for(t, first).cam(t, first).values, np.float64)
                                            for t in traces])
                continue
            layers = [recipes[i].layer for i in members]
            distinct = list(dict.fromkeys(layers))
            per = np.stack([np.asarray(kind_for(t, first).gallery(t, first, {"layer": distinct}).values, np.float64)
                            for t in traces])  # (trace, layer, ...)
            per = per.reshape(len(traces), len(distinct), *per.shape[-2:])
            for i, layer in zip(members, layers, strict=True):
                out[i] = per[:, distinct.index(layer)]
    return out  # type: ignore[return-value]


def robustness(
    model: torch.nn.Module,
    image: object,
    recipes: Sequence[Recipe],
    *,
    n: int = 10,
    radius: float = 0.2,
    seed: int = 0,
    target: int | None = None,
    metrics: Sequence[str] = ROBUSTNESS_METRICS,
    batch_size: int = 8,
) -> xr.DataArray:
    """Robustness of every recipe to ``n`` seeded input perturbations, from one trace per perturbed input.

    The original input and its ``n`` perturbed copies (:func:`perturb`) are traced once, in memory, for the one
    class ``target`` (default the class the model predicts for the original input; the maps of the copies explain
    the same class). Every recipe's map is then computed on each of the ``n + 1`` traces and scored by
    :func:`robustness_scores`.

    Args:
        model: the model (as for :func:`vitcam_nb.trace_many`); image: as for :func:`model_input`.
        recipes: the recipes to score (their ``class_`` is replaced by ``target``; attention rollout has none).
        n, radius, seed: perturbations (see :func:`perturb`); target: the class explained.
        metrics: names from :data:`ROBUSTNESS_METRICS`.
        batch_size: inputs per forward/backward pass of the tracing.

    Returns:
        DataArray ``(recipe, metric)`` (recipe ids as the ``recipe`` coordinate, the recipe JSON as ``recipe_json``);
        attrs record the seed, radius, count, target and how many perturbations changed the predicted class.

    Example:
        >>> import timm, numpy as np
        >>> m = timm.create_model("vit_tiny_patch16_224", depth=2).eval()
        >>> r = robustness(m, np.zeros((224, 224, 3), np.uint8), [Recipe(site="F1", layer=-1)], n=2)
        >>> r.dims, r.attrs["n_perturbations"]
        (('recipe', 'metric'), 2)
    """
    recipes = list(recipes)
    if not recipes or not all(isinstance(r, Recipe) for r in recipes):
        raise ArgumentError("recipes: expected a non-empty sequence of vitcam_nb.Recipe")
    robustness_scores(np.ones(1), np.ones((1, 1)), np.ones(1), np.ones((1, 1)), np.ones(1), np.ones((1, 1)), metrics)
    x, _ = model_input(model, image)
    xs = perturb(x, n, radius, seed)
    logits = Scorer(model, "logit").logits(torch.cat([x, xs]))
    n_classes = logits.shape[1]
    if target is None:
        target = int(torch.argmax(logits[0]))
    elif isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= target < n_classes:
        raise ArgumentError(f"target: expected a class index in 0..{n_classes - 1} or None, got {target!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ArgumentError(f"batch_size: expected a positive int, got {batch_size!r}")
    fixed = [_for_class(r, int(target)) for r in recipes]
    traces = _traces(model, torch.cat([x, xs]), int(target), fixed, int(batch_size), image)
    rows = []
    for maps in _all_maps(traces, fixed):
        s = robustness_scores(maps[0], maps[1:], x[0].numpy(), xs.numpy(), logits[0].numpy(), logits[1:].numpy(),
                              metrics)
        rows.append([s[name] for name in metrics])
    changed = int((logits[1:].argmax(1) != logits[0].argmax()).sum())
    return xr.DataArray(
        np.array(rows), dims=("recipe", "metric"),
        coords={"recipe": [r.id for r in fixed], "metric": list(metrics),
                "recipe_json": ("recipe", [r.to_json() for r in fixed])},
        name="robustness",
        attrs={"n_perturbations": int(n), "radius": float(radius), "seed": int(seed), "target": int(target),
               "perturbation": "uniform noise U(-radius, radius) per element of the normalised input, "
                               "numpy default_rng(seed)",
               "prediction_changed": changed, "traces": "one per input (original + perturbed), in memory"},
    )
