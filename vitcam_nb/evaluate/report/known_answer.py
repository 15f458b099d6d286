"""The known-answer report: every site x layer x weighting x target variant on the bundled shapes model,
ranked by how well it points at the class object (pointing game) and how fast deleting what it
highlights lowers the class probability (deletion AUC), saved as a table and a figure."""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vitcam_nb.capture.scoring import score as score_channels
from vitcam_nb.capture.trace import trace
from vitcam_nb.core.arguments import as_flag, as_path
from vitcam_nb.core.errors import ArgumentError, DegenerateMapWarning
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.outfiles import OutputFolder
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.schema import TOKEN_SITES
from vitcam_nb.core.weighting import WEIGHTINGS, channel_weighting_names
from vitcam_nb.data import shapes
from vitcam_nb.evaluate.faithfulness.perturbation import (
    Scorer,
    area_under_curve,
    model_input,
    perturbation_scores,
    pixel_rank,
)
from vitcam_nb.evaluate.localisation.metrics import default_tolerance
from vitcam_nb.models import load_model

__all__ = ["report_known_answer"]

_TOKEN_SITES = ("F1", "F2", "F3", "F4", "F5", "F6")
_OUTPUTS = ("known_answer_report.csv", "known_answer_report.png", "known_answer_report.json")


def _pointing(maps: np.ndarray, mask: np.ndarray, tol: float) -> np.ndarray:
    """Pointing game of many maps (V, H, W) against one mask, ties counted fractionally; NaN if constant."""
    from scipy import ndimage

    hit = ndimage.distance_transform_edt(~mask) <= tol
    flat = maps.reshape(len(maps), -1)
    peaks = flat == flat.max(axis=1, keepdims=True)
    out = (peaks & hit.ravel()).sum(axis=1) / peaks.sum(axis=1)
    return np.where(np.ptp(flat, axis=1) > 0, out, np.nan)


def report_known_answer(
    model: torch.nn.Module | str = "shapes-vit",
    n_images: int = 300,
    seed: int = 0,
    *,
    sites: Sequence[str] = _TOKEN_SITES,
    weightings: Sequence[str] | None = None,
    targets: Sequence[str] = ("logit", "prob", "logprob"),
    deletion_steps: int = 16,
    substrate: str = "mean",
    score: str = "prob",
    tolerance: float | None = None,
    batch_size: int = 512,
    device: str | torch.device | None = None,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    overwrite: bool = False,
):
    """Rank every variant on the known-answer model over ``n_images`` images of :func:`vitcam_nb.data.shapes`.

    For each image the model is traced for the true class; every site x layer x weighting x target
    recipe (gradient-free weightings once) gives a map. Pointing game: the upsampled map against the
    class object's mask (tolerance as :func:`~vitcam_nb.evaluate.pointing_game`). Deletion AUC: token
    mode, patches ordered by the token-grid map, ``deletion_steps`` steps, ``substrate`` and ``score``
    as in :func:`~vitcam_nb.evaluate.deletion`. Degenerate maps count as NaN (their share is reported).
    Variants are ranked by mean pointing game over all images with degenerate maps counted as misses
    (``pointing_game_all``, higher first), then mean deletion AUC (lower first); ``pointing_game`` is the
    mean over the images where the map is not degenerate.

    Args:
        model: the model or a bundled name (``vc.load_model``).
        n_images, seed: images from ``vitcam_nb.data.shapes(n_images, seed)``.
        sites, weightings, targets: the variants (weightings default: every channel weighting but gscorecam,
            whose ``k`` has no default, and ViT-CX, which scores one target only (its preset); Score-CAM and
            Ablation-CAM run ``vc.score`` on every image, site and layer).
        device: run on this device (a deep copy of the model is moved there; the model passed in is
            left where it is). The full report scores about 10^4 inputs per image: use a GPU for a few
            hundred images.
        out_dir: if given, writes ``known_answer_report.csv``, ``known_answer_report.png`` and
            ``known_answer_report.json`` (the settings) there, each atomically, listed in the folder's manifest
            (``.vitcam_nb-outputs.json``). A file of those names there that the kit did not write (or that changed
            since) is refused (:class:`~vitcam_nb.OutputExistsError`) before any work unless ``overwrite=True``.
        overwrite: replace such files (True or False).

    Returns:
        ``(table, figure)``: a pandas DataFrame (one row per variant; settings in ``table.attrs``) and a
        matplotlib Figure.

    Example:
        >>> table, fig = report_known_answer(n_images=200, out_dir="report")  # doctest: +SKIP
        >>> table.iloc[0][["site", "layer", "weighting", "target"]]  # doctest: +SKIP
    """
    import pandas as pd

    from vitcam_nb.core.progress import progress_bar as tqdm

    overwrite = as_flag("overwrite", overwrite)
    # a file of these names that the kit did not write there is refused before the model is loaded
    folder = None if out_dir is None else OutputFolder(as_path("out_dir", out_dir), _OUTPUTS, "report_known_answer",
                                                       overwrite=overwrite)
    if isinstance(model, str):
        model = load_model(model)
    if device is not None:
        model = copy.deepcopy(model).to(device)
    if isinstance(n_images, bool) or not isinstance(n_images, int) or n_images < 1:
        raise ArgumentError(f"n_images: expected a positive int, got {n_images!r}")
    if isinstance(deletion_steps, bool) or not isinstance(deletion_steps, int) or deletion_steps < 1:
        raise ArgumentError(f"deletion_steps: expected a positive int, got {deletion_steps!r}")
    if weightings is None:
        weightings = [w for w in channel_weighting_names()
                      if w != "gscorecam" and WEIGHTINGS.get(w).scored_target == "logit"]
    weightings = list(weightings)
    scored = [w for w in weightings if WEIGHTINGS.get(w).scores]
    targets = list(targets)
    images, labels, masks = shapes(n_images, seed)
    scorer = Scorer(model, score)

    variants: list[tuple] = []  # (site, layer, weighting, target)
    pg_rows, auc_rows, degenerate_rows = [], [], []
    show = n_images > 4 if progress is None else bool(progress)
    settings = {}
    for i in tqdm(range(n_images), desc="known-answer report", disable=not show):
        label = int(labels[i])
        tr = trace(model, images[i], targets=[label])
        h, w = tr.sizes["y"], tr.sizes["x"]
        if (h, w) != masks[i].shape:
            raise ArgumentError(f"model: its input size {(h, w)} differs from the shapes images "
                                f"{masks[i].shape}; the masks would not line up with the maps")
        tol = default_tolerance((h, w)) if tolerance is None else float(tolerance)
        layers = [int(v) for v in tr["layer"].values]
        if scored:  # the forward passes Score-CAM / Ablation-CAM read, stored in this image's trace
            tr = score_channels(tr, model, [Recipe(weighting=w, site=s, layer=layer, class_=label) for w in scored
                                            for s in sites if s in TOKEN_SITES for layer in layers], images[i],
                                batch_size=batch_size, progress=False)
        gh, gw = int(tr.attrs["grid_h"]), int(tr.attrs["grid_w"])
        n_cells = gh * gw
        step = max(1, int(np.ceil(n_cells / deletion_steps)))
        counts = np.unique(np.append(np.arange(0, n_cells, step), n_cells))
        frac = counts / n_cells
        pgs, degs, grid_all = [], [], []
        names = []
        for weighting in weightings:
            # Score-CAM and Ablation-CAM score the channels of token sites; F2 is a matrix per head
            on = [s for s in sites if s in TOKEN_SITES] if WEIGHTINGS.get(weighting).scores else list(sites)
            for target in targets if WEIGHTINGS.get(weighting).uses_gradient else targets[:1]:
                base = Recipe(class_=label, weighting=weighting, target=target)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DegenerateMapWarning)
                    vary = {"layer": layers, "site": on}
                    up = kind_for(tr, base).gallery(tr, base, vary)
                    grid = kind_for(tr, base).gallery(tr, base.replace(upsample="none"), vary)
                bad = up["degenerate"].values.ravel() != ""
                pg = _pointing(up.values.reshape(-1, h, w), masks[i], tol)
                pg[bad] = np.nan
                pgs.append(pg)
                degs.append(bad)
                grid_all.append(grid.values.reshape(-1, gh, gw))
                names += [(site, layer, weighting, target) for layer in layers for site in on]
        # one batched deletion run per image over the distinct removal orders of all variants
        bad_all, grid_all = np.concatenate(degs), np.concatenate(grid_all)
        ranks, keys, index = [], {}, np.full(len(bad_all), -1)
        for v, (g, is_bad) in enumerate(zip(grid_all, bad_all, strict=True)):
            if is_bad:
                continue
            r = pixel_rank(g.astype(np.float64), (h, w), "morf")
            index[v] = keys.setdefault(r.tobytes(), len(ranks))
            if index[v] == len(ranks):
                ranks.append(r)
        auc = np.full(len(index), np.nan)
        if ranks:
            curves = perturbation_scores(
                scorer, model_input(model, tr)[0], ranks, counts, kind="deletion", substrate=substrate,
                target=label, batch_size=batch_size, seed=seed, nli_noise=0.01,
                blur_sigma=5.0 * np.sqrt(h * w) / 224.0, progress=False, desc="deletion")
            areas = np.array([area_under_curve(c, frac) for c in curves])
            auc[index >= 0] = areas[index[index >= 0]]
        if not variants:
            variants = names
            settings = {"n_cells": n_cells, "deletion_step": step, "tolerance": tol}
        pg_rows.append(np.concatenate(pgs))
        auc_rows.append(auc)
        degenerate_rows.append(bad_all)
    pg_all, auc_all, deg_all = np.array(pg_rows), np.array(auc_rows), np.array(degenerate_rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # variants degenerate on every image: NaN means
        table = pd.DataFrame({
            "site": [v[0] for v in variants],
            "layer": [v[1] for v in variants],
            "weighting": [v[2] for v in variants],
            "target": [v[3] for v in variants],
            # A map that is degenerate on an image points nowhere: it counts as a miss in the ranking score.
            "pointing_game_all": np.nan_to_num(pg_all, nan=0.0).mean(axis=0),
            "pointing_game": np.nanmean(pg_all, axis=0),
            "pointing_game_std": np.nanstd(pg_all, axis=0),
            "deletion_auc": np.nanmean(auc_all, axis=0),
            "deletion_auc_std": np.nanstd(auc_all, axis=0),
            "degenerate_frac": deg_all.mean(axis=0),
            "n_images": np.sum(~np.isnan(pg_all), axis=0),
        })
    table["recipe_id"] = [Recipe(site=s, layer=layer, weighting=w, target=t).id
                          for s, layer, w, t in variants]
    table = table.sort_values(["pointing_game_all", "deletion_auc"], ascending=[False, True], na_position="last",
                              kind="stable").reset_index(drop=True)
    table.insert(0, "rank", np.arange(1, len(table) + 1))
    table.attrs = {
        "model": str(getattr(model, "pretrained_cfg", {}).get("architecture", type(model).__name__)),
        "n_images": n_images, "seed": seed, "substrate": substrate, "score": score, "deletion_mode": "token",
        "deletion_steps": deletion_steps, "batch_size": batch_size, "device": str(scorer.device),
        "class": "true label of each image",
        "recipe_id": "id of the recipe with class_='top1'; the report uses class_=<true label> per image",
        **settings,
    }
    fig = _figure(table)
    if folder is not None:
        folder.root.mkdir(parents=True, exist_ok=True)
        text = json.dumps(table.attrs, indent=2, default=str)
        folder.write("known_answer_report.csv", lambda p: table.to_csv(p, index=False))
        # the temporary file has no .png suffix for matplotlib to read the format from
        folder.write("known_answer_report.png", lambda p: fig.savefig(p, dpi=150, format="png"))
        folder.write("known_answer_report.json", lambda p: p.write_text(text, encoding="utf-8"))
    return table, fig


def _figure(table):
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    for site, group in table.groupby("site", sort=True):
        left.scatter(group["pointing_game"], group["deletion_auc"], s=14, alpha=0.7, label=site)
    left.set_xlabel("pointing game (higher is better)")
    left.set_ylabel("deletion AUC (lower is better)")
    left.legend(title="site", fontsize=8)
    left.set_title(f"{len(table)} variants, {table.attrs.get('n_images', '?')} images", fontsize=9)
    top = table.dropna(subset=["pointing_game_all"]).head(15).iloc[::-1]
    names = [f"{r.site} L{r.layer} {r.weighting} {r.target}" for r in top.itertuples()]
    right.barh(range(len(top)), top["pointing_game_all"], xerr=None, color="tab:blue", alpha=0.8)
    right.set_yticks(range(len(top)), names, fontsize=7)
    for y, (pg, auc) in enumerate(zip(top["pointing_game_all"], top["deletion_auc"], strict=True)):
        right.text(pg, y, f" AUC {auc:.2f}", va="center", fontsize=6)
    right.set_xlim(0, 1.15)
    right.set_xlabel("pointing game")
    right.set_title("top variants (ranked by pointing game, then deletion AUC)", fontsize=9)
    return fig
