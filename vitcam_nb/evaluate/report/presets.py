"""The known-answer report of the published presets: every preset of ``vc.presets.names()`` on the bundled
shapes model, its pointing game and deletion AUC (as :func:`~vitcam_nb.evaluate.report.known_answer.report_known_answer`
measures them), or the reason it does not apply to the model (a vision-language preset on a classifier).

A preset is used at its default arguments with the image's true class; layer tuples counted from the end are
clipped to the model's blocks (``transition_attention_maps``' last 8 blocks are all 6 of shapes-vit), and the
recipe actually used is in the table. Presets that read model outputs (integrated gradients, ViT-CX scores,
Score-CAM) get them from ``vc.score`` at its defaults. The deletion is ordered by the token-grid map; a whole-image
map (ViT-CX) by its mean over each patch. Each image is traced at every site the model offers (the published
attention-gradient methods read q, k, v, attn_scores, resid_pre), and once more with one read-out score per block
for LeGrad (``vc.targets.layerwise``; once per read-out, ``legrad`` and ``legrad_cls``) and, for Grad-ECLIP's code
version, inside :func:`~vitcam_nb.adapters.single_head_attention` (its official code runs the block as one head). A
preset that reads a backward rule's relevance (``cp_lrp``, ``attnlrp``, ``libragrad``: :func:`rule_for`) gets the
image traced once more with that rule (same sites, ``vc.trace(..., rule=...)``); the ``rule`` column names the rule
of the trace each row was computed from. Exact Shapley values can be read from and written to a cache file
(:class:`~vitcam_nb.evaluate.report.shapley_cache.ShapleyCache`):
they depend on the image, never on the map.

Example:
    >>> table = report_presets(n_images=2, names=["attention_rollout", "albef_itm_gradcam"])  # doctest: +SKIP
    >>> table[["preset", "status"]].values.tolist()  # doctest: +SKIP
    [['attention_rollout', 'ok'], ['albef_itm_gradcam', 'skipped: ...']]
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.qkv import single_head_attention
from vitcam_nb.capture.scoring import score as score_trace
from vitcam_nb.capture.trace import trace
from vitcam_nb.compute.published import LEGRAD_READOUT
from vitcam_nb.core import presets
from vitcam_nb.core.arguments import as_flag, as_path
from vitcam_nb.core.errors import ArgumentError, DegenerateMapWarning, RecipeError, TraceError
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.outfiles import OutputFolder
from vitcam_nb.core.provenance import weights_sha256
from vitcam_nb.core.recipe import INTEGRATED_ROLLOUTS, Recipe, is_int
from vitcam_nb.core.rules import DEFAULT_RULE, RULES
from vitcam_nb.core.schema import EXTRA_SITES
from vitcam_nb.core.weighting import WEIGHTINGS
from vitcam_nb.data import shapes
from vitcam_nb.evaluate._common import MetricWarning
from vitcam_nb.evaluate.faithfulness.perturbation import (
    Scorer,
    area_under_curve,
    model_input,
    perturbation_scores,
    pixel_rank,
)
from vitcam_nb.evaluate.localisation.metrics import default_tolerance
from vitcam_nb.evaluate.report.shapley_cache import ShapleyCache
from vitcam_nb.evaluate.shapley.agreement import shapley_agreement
from vitcam_nb.evaluate.shapley.values import check_shapley, shapley_patches
from vitcam_nb.models import load_model
from vitcam_nb.targets.layerwise import layerwise

__all__ = ["fit_to_model", "needs_scores", "report_presets", "rule_for"]

_OUTPUTS = ("presets.csv", "presets.json")
_FAMILY_ONLY = {site: "needs a vision-language family with text cross-attention (BLIP/ALBEF); the model is an "
                      "image classifier without it" for site in EXTRA_SITES}


def fit_to_model(recipe: Recipe, num_layers: int) -> Recipe | None:
    """``recipe`` with its layer tuple clipped to the model's blocks (None when nothing is left).

    Example:
        >>> fit_to_model(Recipe(site="F2", layer=(-8, -2, -1), layer_fusion="transition"), 6).layer
        (-2, -1)
    """
    if not isinstance(recipe.layer, tuple):
        if is_int(recipe.layer) and not -num_layers <= recipe.layer < num_layers:
            return None
        return recipe
    kept = tuple(v for v in recipe.layer if is_int(v) and -num_layers <= v < num_layers)
    return recipe.replace(layer=kept) if kept else None


def needs_scores(recipe: Recipe) -> bool:
    """Whether ``vc.score`` must run before ``vc.cam`` can compute ``recipe``.

    Example:
        >>> needs_scores(presets.vit_cx()), needs_scores(presets.gradcam())
        (True, False)
    """
    return recipe.layer_fusion in INTEGRATED_ROLLOUTS or recipe.weighting == "vitcx" or \
        bool(WEIGHTINGS.get(recipe.weighting).scores)


#: Weightings that read a rule not named after them (Transformer Attribution reads Chefer's LRP pass).
_RULE_OF = {"transformer_attribution": "chefer_lrp"}


def rule_for(recipe: Recipe) -> str:
    """The backward rule of the trace ``recipe`` reads: a relevance weighting is named after its rule
    (:mod:`vitcam_nb.compute.relevance`) or listed in ``_RULE_OF``; every other weighting reads a plain
    (``"gradient"``) trace.

    Example:
        >>> rule_for(presets.get("attnlrp")), rule_for(presets.gradcam())
        ('attnlrp', 'gradient')
    """
    return _RULE_OF.get(recipe.weighting) or (recipe.weighting if recipe.weighting in RULES else DEFAULT_RULE)


def _pointing(up: np.ndarray, mask: np.ndarray, tol: float) -> float:
    from scipy import ndimage

    if np.ptp(up) <= 0:
        return float("nan")
    hit = ndimage.distance_transform_edt(~mask) <= tol
    peaks = up == up.max()
    return float((peaks & hit).sum() / peaks.sum())


def _cells(up: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """Mean of a full-resolution map over each patch: the token-grid order of a whole-image method."""
    gh, gw = grid
    h, w = up.shape
    return up[: h // gh * gh, : w // gw * gw].reshape(gh, h // gh, gw, w // gw).mean(axis=(1, 3))


def _grid_map(tr: Any, recipe: Recipe, up: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """The token-grid map that orders the deletion, as the known-answer report does (upsample "none"); a
    whole-image method without a grid map (ViT-CX) is averaged over each patch."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DegenerateMapWarning)
            return kind_for(tr, recipe).cam(tr, recipe.replace(upsample="none")).values.astype(np.float64)
    except RecipeError:
        return _cells(up, grid)


def _agreement(cells: np.ndarray, phi: Any) -> float:
    """Rank agreement of a token-grid map with the image's Shapley values (NaN for a constant pooled map)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MetricWarning)
        return float(shapley_agreement(cells, phi).attrs["value"])


def _shapley(model: torch.nn.Module, tr: Any, cache: ShapleyCache, where: tuple[int, int, int],
             grid: tuple[int, int], baseline: str, label: int, batch_size: int) -> Any:
    """The image's exact Shapley values (true class, logit): from ``cache`` when it holds them, else computed and
    stored there."""
    seed, n_images, index = where
    key = {"weights": weights_sha256(model), "seed": seed, "n_images": n_images, "image": index, "grid": grid,
           "baseline": baseline, "score": "logit", "target": label}
    phi = cache.get(**key)
    if phi is None:
        phi = shapley_patches(model, tr, grid, baseline, target=label, batch_size=batch_size, progress=False)
        cache.put(phi, **key)
    return phi


def _prepare(names: Sequence[str], num_layers: int) -> tuple[dict[str, Recipe], dict[str, str]]:
    recipes, skipped = {}, {}
    for name in names:
        recipe = presets.get(name)
        if recipe.site in _FAMILY_ONLY:
            skipped[name] = _FAMILY_ONLY[recipe.site]
            continue
        fitted = fit_to_model(recipe, num_layers)
        if fitted is None:
            skipped[name] = f"its blocks {recipe.layer!r} are not blocks of this {num_layers}-block model"
            continue
        recipes[name] = fitted
    return recipes, skipped


def report_presets(model: torch.nn.Module | str = "shapes-vit", n_images: int = 100, seed: int = 0, *,
                   names: Sequence[str] | None = None, deletion_steps: int = 16, substrate: str = "mean",
                   score: str = "prob", batch_size: int = 512, shapley_images: int = 0,
                   shapley_grid: tuple[int, int] = (4, 4), shapley_baseline: str = "mean",
                   shapley_cache: str | Path | None = None, out_dir: str | Path | None = None,
                   progress: bool | None = None, overwrite: bool = False) -> Any:
    """Pointing game and deletion AUC of every preset on ``n_images`` images of :func:`vitcam_nb.data.shapes`
    (one row per preset; a preset that does not apply has ``status`` "skipped: <reason>"). With ``out_dir``,
    writes ``presets.csv`` and ``presets.json`` (the settings) there, each atomically, listed in the folder's
    manifest (``.vitcam_nb-outputs.json``); a file of those names there that the kit did not write (or that changed
    since) is refused (:class:`~vitcam_nb.OutputExistsError`) before any work unless ``overwrite=True``.

    With ``shapley_images=k`` (at most ``n_images``), the first ``k`` images also get the exact Shapley values of
    ``shapley_grid`` patch groups for the true class's logit (:func:`~vitcam_nb.evaluate.shapley_patches`; 4x4
    groups: 65,536 model calls per image) and each preset the Spearman agreement of its token-grid map (the map
    that orders the deletion) pooled per group (:func:`~vitcam_nb.evaluate.shapley_agreement`): columns
    ``shapley_agreement`` (mean) and ``shapley_n_images``. With ``shapley_cache`` (a JSON file), values stored
    there for the same weights, image set, grid, baseline and class are read instead of computed, and computed
    ones are added to it; ``table.attrs["shapley_cache"]`` says how many were read.

    Each row's ``rule`` is the backward rule of the trace its map was computed from (``gradient`` except for the
    rule presets, whose images are traced once more with their rule).

    Example:
        >>> report_presets(n_images=20, out_dir="reports/known_answer")  # doctest: +SKIP
    """
    import pandas as pd

    from vitcam_nb.core.progress import progress_bar as tqdm

    overwrite = as_flag("overwrite", overwrite)
    # a file of these names that the kit did not write there is refused before the model is loaded
    folder = None if out_dir is None else OutputFolder(as_path("out_dir", out_dir), _OUTPUTS, "report_presets",
                                                       overwrite=overwrite)
    if isinstance(model, str):
        model = load_model(model)
    if isinstance(n_images, bool) or not isinstance(n_images, int) or n_images < 1:
        raise ArgumentError(f"n_images: expected a positive int, got {n_images!r}")
    if isinstance(shapley_images, bool) or not isinstance(shapley_images, int) or not 0 <= shapley_images <= n_images:
        raise ArgumentError(f"shapley_images: expected an int in 0..n_images ({n_images}), got {shapley_images!r}")
    names = list(presets.names() if names is None else names)
    images, labels, masks = shapes(n_images, seed)
    if shapley_images:  # grid, baseline and memory refused before any trace or model call
        check_shapley(model, images[0], shapley_grid, shapley_baseline, batch_size)
    scorer = Scorer(model, score)
    cache = ShapleyCache(shapley_cache) if shapley_images else None
    recipes: dict[str, Recipe] = {}
    skipped: dict[str, str] = {}
    pg: dict[str, list[float]] = {}
    auc: dict[str, list[float]] = {}
    used: dict[str, Recipe] = {}
    agree: dict[str, list[float]] = {}
    sites: list[str] | None = None
    for i in tqdm(range(n_images), desc="preset report", disable=not (n_images > 4 if progress is None else progress)):
        label = int(labels[i])
        image = images[i]
        if sites is None:  # every site the model offers: the published methods read optional ones
            attrs = trace(model, image, targets=[label], sites=["F1"], layers=[-1]).attrs
            sites = [s for key in ("model_sites", "model_optional_sites") for s in str(attrs.get(key, "")).split(",")
                     if s]
        tr = trace(model, image, targets=[label], sites=sites)
        # LeGrad's trace (one read-out score per block) and Grad-ECLIP's (its blocks run as one head), made when needed
        by_block: dict[str, Any] = {}  # LeGrad's traces, one per read-out ("mean": legrad, "model": legrad_cls)
        one_head = None
        by_rule: dict[str, Any] = {}  # this image traced with a backward rule, once per rule a preset needs
        if not recipes and not skipped:
            recipes, skipped = _prepare(names, int(tr.attrs["num_layers"]))
        h, w = masks[i].shape
        grid = (int(tr.attrs["grid_h"]), int(tr.attrs["grid_w"]))
        tol = default_tolerance((h, w))
        n_cells = grid[0] * grid[1]
        step = max(1, int(np.ceil(n_cells / deletion_steps)))
        counts = np.unique(np.append(np.arange(0, n_cells, step), n_cells))
        # exact Shapley values of this image (true class, logit)
        phi = _shapley(model, tr, cache, (seed, n_images, i), shapley_grid, shapley_baseline, label, batch_size) \
            if cache is not None and i < shapley_images else None
        for name, base in list(recipes.items()):
            try:  # a gradient-free rollout keeps class_ at its default (its recipe refuses a class)
                recipe = base.replace(class_=label)
            except RecipeError:
                recipe = base
            try:
                readout = LEGRAD_READOUT.get(recipe.weighting)
                if readout is not None and readout not in by_block:
                    by_block[readout] = trace(model, image, targets=layerwise(label, readout=readout), sites=["F2"])
                if recipe.weighting == "grad_eclip" and one_head is None:  # its official code's single-head block
                    blocks = list(recipe.layer) if isinstance(recipe.layer, tuple) else [recipe.layer]
                    with single_head_attention(model, layers=blocks):
                        one_head = trace(model, image, targets=[label], sites=["F3", "v", "q_out", "k_out"],
                                         layers=blocks)
                rule = rule_for(recipe)
                if rule != DEFAULT_RULE and rule not in by_rule:
                    by_rule[rule] = trace(model, image, targets=[label], sites=sites, rule=rule)
                if needs_scores(recipe):
                    tr = score_trace(tr, model, recipe, image, progress=False)
                src = by_block[readout] if readout is not None else one_head if recipe.weighting == "grad_eclip" \
                    else by_rule.get(rule, tr)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DegenerateMapWarning)
                    up = kind_for(src, recipe).cam(src, recipe)
            except (RecipeError, TraceError) as exc:  # the preset does not fit this model: say why, once
                skipped[name] = str(exc).split("\n")[0]
                del recipes[name]
                continue
            used[name] = base
            values = up.values.astype(np.float64)
            bad = bool(up.attrs.get("degenerate"))
            pg.setdefault(name, []).append(float("nan") if bad else _pointing(values, masks[i], tol))
            cells = None if bad else _grid_map(src, recipe, values, grid)
            if phi is not None:
                agree.setdefault(name, []).append(float("nan") if bad else _agreement(cells, phi))
            if bad:
                auc.setdefault(name, []).append(float("nan"))
                continue
            rank = pixel_rank(cells, (h, w), "morf")
            curve = perturbation_scores(scorer, model_input(model, tr)[0], [rank], counts, kind="deletion",
                                        substrate=substrate, target=label, batch_size=batch_size, seed=seed,
                                        nli_noise=0.01, blur_sigma=5.0 * np.sqrt(h * w) / 224.0, progress=False,
                                        desc="deletion")[0]
            auc.setdefault(name, []).append(area_under_curve(curve, counts / n_cells))
    rows = []
    for name in names:
        if name in skipped:
            rows.append({"preset": name, "status": f"skipped: {skipped[name]}"})
            continue
        p, a = np.array(pg[name]), np.array(auc[name])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            rows.append({"preset": name, "status": "ok", "pointing_game_all": float(np.nan_to_num(p).mean()),
                         "pointing_game": float(np.nanmean(p)), "deletion_auc": float(np.nanmean(a)),
                         "degenerate_frac": float(np.isnan(p).mean()), "n_images": int(np.sum(~np.isnan(p))),
                         "rule": rule_for(used[name]), "recipe_id": used[name].id, "recipe": used[name].to_json()})
            if shapley_images:
                s = np.array(agree[name])
                rows[-1].update(shapley_agreement=float(np.nanmean(s)), shapley_n_images=int(np.isfinite(s).sum()))
    table = pd.DataFrame(rows)
    table.attrs = {"model": str(getattr(model, "pretrained_cfg", {}).get("tag", type(model).__name__)),
                   "n_images": n_images, "seed": seed, "deletion_steps": deletion_steps, "substrate": substrate,
                   "score": score, "deletion_mode": "token (whole-image maps: mean over each patch)",
                   "class": "true label of each image", "layers": "tuples counted from the end clipped to the model",
                   "scores": "vc.score at its defaults (20 integration steps; ViT-CX threshold 0.1, noise 0.1, seed 0)",
                   "sites": ",".join(sites or []),
                   "legrad": "a second trace, targets=vc.targets.layerwise(label) (legrad_cls: readout='model')",
                   "grad_eclip": "a third trace inside vc.adapters.single_head_attention(model, its blocks)",
                   "rules": "rule presets (cp_lrp, attnlrp, libragrad): the image traced once more per rule, same "
                            "sites, vc.trace(..., rule=<rule>); column rule = the rule of each row's trace"}
    if shapley_images:
        gy, gx = shapley_grid
        table.attrs["shapley"] = (
            f"exact Shapley values of {gy}x{gx} patch groups (all {2 ** (gy * gx):,} masked passes per image), "
            f"baseline {shapley_baseline}, logit of the true class, on the first {shapley_images} image(s); "
            "shapley_agreement = mean Spearman of the token-grid map pooled (mean) per group against them")
        table.attrs["shapley_cache"] = (f"{cache.hits} image(s) read from {cache.path}, {cache.misses} computed"
                                        if cache.path is not None else f"none: all {cache.misses} computed")
    if folder is not None:
        folder.root.mkdir(parents=True, exist_ok=True)
        text = json.dumps(table.attrs, indent=2, default=str)
        folder.write("presets.csv", lambda p: table.to_csv(p, index=False))
        folder.write("presets.json", lambda p: p.write_text(text, encoding="utf-8"))
    return table
