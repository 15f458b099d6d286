"""The rollouts weighted by the integrated gradient of the last attention: Transition Attention Maps (Yuan et al.
2021, ``layer_fusion="transition"``) and Beyond Intuition head-wise and token-wise (Chen et al. 2023,
``"bt_head"``, ``"bt_token"``), computed from a trace that ``vc.score`` has given the integrated gradient
(``attn_grad_ig``) and, for the token-wise rule, the value-norm ratios (``value_ratio``).

Each follows its official code (github.com/XianrenYty/Transition_Attention_Maps,
github.com/jiaminchen-1031/transformerinterp), with ``mean_h`` the mean over heads and ``W = mean_h relu(IG)``:

- transition: ``S = mean_h A_L (mean_h A_{L-1} + I) ... (mean_h A_s + I)``, map = ``(S * W)`` at the query rows;
- bt_head: ``R = I``, for each block in forward order ``R <- R + (sum_h I_h A_h) R`` with ``I_h = mean_ij
  |(A_h^T G_h)_ij|`` normalised to sum 1 over heads (G the gradient at the input), map = ``(W * R)``;
- bt_token: ``R = I``, ``R <- R + mean_h(A_l) diag(r_l) R`` with ``r_l`` the stored value ratios, map =
  ``(W * |R|)``.

Example:
    >>> import numpy as np
    >>> transition_matrix(np.ones((2, 1, 2, 2)) / 2).round(2).tolist()
    [[1.0, 1.0], [1.0, 1.0]]
"""

from __future__ import annotations

import numpy as np

from vitcam_nb.compute.kernels import relu
from vitcam_nb.compute.pipeline import combine, query_rows, score_call
from vitcam_nb.compute.spatial import to_grid
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.recipe import Recipe

__all__ = ["bt_head_matrix", "bt_token_matrix", "integrated_rollout", "transition_matrix"]


def transition_matrix(attn: np.ndarray) -> np.ndarray:
    """TAM's state for every query row: ``mean_h A_last`` times ``(mean_h A_l + I)`` for the earlier blocks,
    nearest first. ``attn`` is (layer, head, query, key) in forward order, the last entry the last block.

    Example:
        >>> transition_matrix(np.stack([np.eye(2)[None], np.eye(2)[None]])).tolist()
        [[2.0, 0.0], [0.0, 2.0]]
    """
    mean = attn.astype(np.float64).mean(axis=1)
    eye = np.eye(mean.shape[-1])
    state = mean[-1]
    for a in mean[-2::-1]:
        state = state @ (a + eye)
    return state


def bt_head_matrix(attn: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """Beyond Intuition's head-wise rollout over (layer, head, query, key) attention and gradients, forward order.

    Example:
        >>> bt_head_matrix(np.ones((1, 2, 2, 2)) / 2, np.ones((1, 2, 2, 2))).tolist()
        [[1.5, 0.5], [0.5, 1.5]]
    """
    attn, grad = attn.astype(np.float64), grad.astype(np.float64)
    R = np.eye(attn.shape[-1])
    for a, g in zip(attn, grad):
        importance = np.abs(np.swapaxes(a, -1, -2) @ g).mean(axis=(-1, -2))
        total = importance.sum()
        # All-zero gradients leave no head more important than another: the heads are weighted equally.
        importance = importance / total if total > 0 else np.full_like(importance, 1.0 / importance.size)
        R = R + np.tensordot(importance, a, axes=1) @ R
    return R


def bt_token_matrix(attn: np.ndarray, ratio: np.ndarray) -> np.ndarray:
    """Beyond Intuition's token-wise rollout: (layer, head, query, key) attention and (layer, token) value ratios.

    Example:
        >>> bt_token_matrix(np.ones((1, 1, 2, 2)) / 2, np.array([[2.0, 0.0]])).tolist()
        [[2.0, 0.0], [1.0, 1.0]]
    """
    attn = attn.astype(np.float64)
    R = np.eye(attn.shape[-1])
    for a, r in zip(attn, ratio.astype(np.float64)):
        R = R + (a.mean(axis=0) * r[None, :]) @ R
    return R


def _ig_weight(view: TraceView, recipe: Recipe, weights: dict[int, float]) -> np.ndarray:
    """W = mean_h relu(IG) of the recipe's target: (query, key)."""
    if "attn_grad_ig" not in view.arrays:
        raise RecipeError(f"layer_fusion: {recipe.layer_fusion} needs the integrated gradient of the last "
                          f"attention, which this trace does not hold; add it with {score_call(recipe)}")
    ig = combine(view.arrays["attn_grad_ig"], weights, (slice(None),)).astype(np.float64)
    return relu(ig).mean(axis=0)


def integrated_rollout(view: TraceView, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    """The map of a ``transition``, ``bt_head`` or ``bt_token`` recipe on the grid, at its query rows. The
    listed blocks must end with the model's last block, whose attention the integrated gradient is taken of.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        >>> recipe = vc.presets.transition_attention_maps(start_layer=-2)
        >>> tr = vc.score(vc.trace(m, img, targets="top1", sites="F2"), m, recipe, img, steps=4)
        >>> integrated_rollout(TraceView.of(tr), recipe, [0, 1]).shape
        (4, 4)
    """
    layer_pos = sorted(set(layer_pos), key=lambda p: int(view.layers[p]))
    last = int(view.layers[layer_pos[-1]])
    if last != view.num_layers - 1:
        raise RecipeError(f"layer: {recipe.layer_fusion} ends at the model's last block {view.num_layers - 1}, "
                          f"whose attention the integrated gradient is taken of; the recipe's blocks end at {last}")
    weights, _ = view.target_weights(recipe)
    W = _ig_weight(view, recipe, weights)
    attn = view.arrays["attn"][layer_pos]
    if recipe.layer_fusion == "transition":
        M = W * transition_matrix(attn)
    elif recipe.layer_fusion == "bt_head":
        grads = combine(view.arrays["attn_grad"], weights, (layer_pos,))
        M = W * bt_head_matrix(attn, grads)
    else:
        if "value_ratio" not in view.arrays:
            raise RecipeError(f"layer_fusion: bt_token needs the value-norm ratios of each block, which this trace "
                              f"does not hold; add them with {score_call(recipe)}")
        ratio = view.arrays["value_ratio"][layer_pos]
        if not np.isfinite(ratio).all():
            raise RecipeError(f"layer_fusion: bt_token needs value ratios of blocks "
                              f"{[int(view.layers[p]) for p in layer_pos]}; add them with {score_call(recipe)}")
        M = W * np.abs(bt_token_matrix(attn, ratio))
    rows = query_rows(view, M[None].astype(np.float32), recipe.attn_rows)[..., 0]
    return to_grid(view, rows[..., view.patch])
