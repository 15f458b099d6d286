"""Layer fusion: per-layer maps fused into one (mean, sum, max, with degenerate layers named), and the
attention rollouts that multiply attention across blocks (Abnar & Zuidema 2020; Chefer et al. 2021b).

Example:
    >>> m = np.stack([np.eye(2, dtype=np.float32), np.zeros((2, 2), np.float32)])
    >>> import vitcam_nb as vc
    >>> fused, notes, partial = fuse_layers(m, np.array(["", "dead"]), [0, 1], vc.Recipe(layer=(0, 1),
    ...                                     layer_fusion="sum"))
    >>> fused.tolist(), notes, partial
    ([[1.0, 0.0], [0.0, 1.0]], [], ['layer 1: dead'])
"""

from __future__ import annotations

import numpy as np

from vitcam_nb.compute.integrated import integrated_rollout
from vitcam_nb.compute.kernels import relu
from vitcam_nb.compute.pipeline import combine, query_rows
from vitcam_nb.compute.spatial import normalise, to_grid
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.recipe import INTEGRATED_ROLLOUTS, Recipe

__all__ = ["fuse", "fuse_layers", "rollout"]


def rollout(view: TraceView, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    """The rollout map on the grid (``rollout``: attention only; ``grad_rollout``: gradient-weighted), read at
    the recipe's query rows. A rollout is a product over blocks in forward order, whatever order the recipe's
    tuple lists them in.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
        >>> from vitcam_nb.compute.view import TraceView
        >>> rollout(TraceView.of(tr), vc.presets.attention_rollout(), [0, 1]).shape
        (4, 4)
    """
    if recipe.layer_fusion in INTEGRATED_ROLLOUTS:
        return integrated_rollout(view, recipe, layer_pos)
    layer_pos = sorted(set(layer_pos), key=lambda p: int(view.layers[p]))
    attn = view.arrays["attn"][layer_pos].astype(np.float64)
    n = attn.shape[-1]
    eye = np.eye(n)
    R = eye.copy()
    if recipe.layer_fusion == "rollout":
        for a in attn:
            R = (0.5 * a.mean(axis=0) + 0.5 * eye) @ R
    else:
        weights, _ = view.target_weights(recipe)
        grads = combine(view.arrays["attn_grad"], weights, (layer_pos,)).astype(np.float64)
        for a, g in zip(attn, grads):
            R = R + relu(g * a).mean(axis=0) @ R
    rows = query_rows(view, R[None].astype(np.float32), recipe.attn_rows)[..., 0]
    return to_grid(view, rows[..., view.patch])


def fuse_layers(maps: np.ndarray, reasons: np.ndarray, layer_ids: list[int], recipe: Recipe,
                label: str = "layer") -> tuple[np.ndarray, list[str], list[str]]:
    """Fuse per-layer maps; degenerate layers enter as zeros and are named, and a fusion that is all
    degenerate or constant is returned as zeros with the reasons (each named "``label`` <layer>: reason"). Returns
    (map, why it is degenerate, which fused layers were degenerate and left out).

    Example:
        >>> import vitcam_nb as vc
        >>> dead = np.zeros((2, 2, 2), np.float32)
        >>> fuse_layers(dead, np.array(["no gradient", "no gradient"]), [3, 4], vc.Recipe(layer=(3, 4),
        ...             layer_fusion="mean"))[1]
        ['layer 3: no gradient', 'layer 4: no gradient']
    """
    order = sorted(range(len(layer_ids)), key=lambda i: layer_ids[i])
    if order != list(range(len(layer_ids))):  # in block order whatever the recipe's order: one map, one canonical id
        maps, reasons, layer_ids = maps[order], np.asarray(reasons, object)[order], [layer_ids[i] for i in order]
    # One layer fuses to itself under every rule (x / 1 is x): a copy costs less than the reduction.
    fused = maps[0].copy() if len(maps) == 1 else fuse(maps, recipe.layer_fusion)
    notes = [f"{label} {layer}: {r}" if len(layer_ids) > 1 else r for layer, r in zip(layer_ids, reasons) if r]
    if len(notes) < len(layer_ids) and np.ptp(fused) <= 0:
        notes.append("the fused map is constant")
    if notes and (len(notes) >= len(layer_ids) or np.ptp(fused) <= 0):
        return np.zeros_like(fused), notes, []
    return normalise(fused, recipe.normalize, inplace=True), [], notes  # fused is a fresh array of ours


def fuse(maps: np.ndarray, how: str) -> np.ndarray:
    """Fuse (layer, h, w) maps by a layer fusion ("none" and "mean" average; "sum"; "max").

    Example:
        >>> fuse(np.array([[[0.0]], [[2.0]]]), "max")
        array([[2.]])
    """
    if how in ("none", "mean"):
        return maps.mean(axis=0)
    if how == "sum":
        return maps.sum(axis=0)
    return maps.max(axis=0)
