"""The maps of many recipes on one flat trace, for the ambiguity analysis: attention (F2) recipes of one block
share their selected query rows and target-combined gradients, so those are read once per (block, rows, target)
instead of once per recipe; every other recipe is computed by its trace kind. The per-recipe steps are the
compute layer's own functions (weighting kernel and head rule, ReLU and degeneracy, normalisation, fusion).

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
    >>> recs = [vc.Recipe(site="F2", layer=0, heads=h, upsample="none") for h in ("max", "mean_then_relu")]
    >>> [v.shape for v, _ in recipe_maps(tr, recs)]
    [(4, 4), (4, 4)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.fusion import fuse_layers
from vitcam_nb.compute.pipeline import combine, compact, finish_layers, grid_maps, query_rows, weight_mask
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.schema import ATTENTION_SITE

__all__ = ["recipe_maps"]


def _shared_f2(recipe: Recipe, view: TraceView) -> bool:
    return (recipe.site == ATTENTION_SITE and recipe.layer_fusion == "none" and recipe.upsample == "none"
            and "attn" in view.arrays and not isinstance(recipe.layer, (tuple, str)))


def recipe_maps(trace: xr.Dataset, recipes: Sequence[Recipe]) -> list[tuple[np.ndarray, list[str]] | None]:
    """For each recipe its map and why it is degenerate (as ``kind.compute`` gives them), or None when the
    trace cannot compute it (a ``RecipeError``).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
        >>> recipe_maps(tr, [vc.Recipe(site="F2", layer=0, attn_rows="mean", upsample="none")])[0][0].shape
        (4, 4)
    """
    view = TraceView.of(trace)
    rows: dict[tuple, Any] = {}
    out: list[tuple[np.ndarray, list[str]] | None] = []
    for recipe in recipes:
        try:
            if _shared_f2(recipe, view):
                out.append(_f2(view, recipe, rows))
            else:
                values, notes, _ = kind_for(trace, recipe).compute(trace, recipe)
                out.append((values, notes))
        except RecipeError:
            out.append(None)
    return out


def _f2(view: TraceView, recipe: Recipe, rows: dict[tuple, Any]) -> tuple[np.ndarray, list[str]]:
    layer_pos = view.layer_positions(recipe.layer)
    weights, _ = view.target_weights(recipe)
    a_key = (layer_pos[0], recipe.attn_rows)
    if a_key not in rows:
        attn = view.arrays["attn"][layer_pos].astype(np.float32, copy=False)
        rows[a_key] = query_rows(view, attn, recipe.attn_rows)
    g_key = (*a_key, tuple(sorted(weights.items())))
    if g_key not in rows:
        rows[g_key] = query_rows(view, combine(view.arrays["attn_grad"], weights, (layer_pos,)), recipe.attn_rows)
    A, G = rows[a_key], rows[g_key]
    raw, scale, zero = grid_maps(view, recipe, A, G, compact(weight_mask(view, recipe)), compact(view.patch),
                                 A.shape[-1])
    maps, reasons = finish_layers(view, recipe, raw, scale, zero)
    values, notes, _ = fuse_layers(maps, reasons, [int(view.layers[p]) for p in layer_pos], recipe)
    return values, notes
