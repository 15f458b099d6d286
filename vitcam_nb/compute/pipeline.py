"""The per-layer pipeline of a recipe on a trace view: select the arrays (target combination, query rows,
window attention, weight tokens), apply the weighting kernel and head rule, place the result on the grid,
then ReLU, degeneracy check, normalisation and upsampling per layer.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> img = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), img, targets="top1")
    >>> maps, reasons = layer_maps(TraceView.of(tr), vc.Recipe(site="F1", upsample="none"), [10, 11])
    >>> maps.shape, reasons.tolist()
    ((2, 14, 14), ['', ''])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vitcam_nb.compute.kernels import (
    apply_head_rule,
    channel_token_maps,
    relu,
    token_maps,
    zero_gradient_gives_zero_map,
)
from vitcam_nb.compute.maps import NOTHING_AFTER_RELU
from vitcam_nb.compute.spatial import normalise, to_grid, upsample
from vitcam_nb.compute.view import ActivationNorms, TraceView
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.schema import ATTENTION_SITE
from vitcam_nb.core.weighting import WEIGHTINGS

__all__ = ["CONSTANT_REASON", "RELU_REASON", "combine", "compact", "finish_layers", "grid_maps", "layer_maps",
           "query_rows", "raw_maps", "score_call", "weight_mask", "window_rows", "zero_gradient_reason"]


def compact(index: np.ndarray) -> slice | np.ndarray:
    """A contiguous index (positions or a boolean mask) as a slice, so numpy returns a view, not a copy.

    Example:
        >>> compact(np.array([False, True, True])), compact(np.array([0, 2]))
        (slice(1, 3, None), array([0, 2]))
    """
    positions = np.flatnonzero(index) if index.dtype == bool else np.asarray(index)
    if positions.size and np.array_equal(positions, np.arange(positions[0], positions[0] + positions.size)):
        return slice(int(positions[0]), int(positions[0]) + positions.size)
    return positions


def combine(grad: np.ndarray, weights: dict[int, float], index: tuple) -> np.ndarray:
    """Weighted sum over targets of ``grad[(target, *index)]`` in float32 (prob/logprob are derived this way).

    Example:
        >>> combine(np.array([[1.0, 2.0], [10.0, 20.0]]), {0: 1.0, 1: -0.5}, (slice(None),))
        array([-4., -8.], dtype=float32)
    """
    out = None
    for pos, w in weights.items():
        # Select the target first: numpy would move mixed integer/array indices to the front.
        term = grad[pos][index].astype(np.float32, copy=False)
        term = term if w == 1.0 else term * np.float32(w)
        out = term if out is None else out + term
    return out


def query_rows(view: TraceView, x: np.ndarray, rows: str) -> np.ndarray:
    """Select F2 query rows of (..., H, Tq, Tk) and return (..., Tk, H).

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> view = TraceView.of(vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)))
        >>> query_rows(view, view.arrays["attn"], "mean").shape
        (2, 17, 3)
    """
    if rows == "cls":
        sel = x[..., view.token_index("cls", "attn_rows"), :]
    elif rows == "mean":
        sel = x.mean(axis=-2)
    else:
        sel = x[..., view.patch, :].mean(axis=-2)
    return np.swapaxes(sel, -1, -2)


def window_rows(view: TraceView, x: np.ndarray, rows: str, layer_pos: list[int]) -> np.ndarray:
    """:func:`query_rows` for window attention (layer, H, Tq, window position) -> (layer, Tk, H): the mean over
    query rows of the dense matrix, each key token summing its entries from every window (padding dropped).

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1),
        ...                       num_heads=(2, 4), embed_dim=16, img_size=56, window_size=7)
        >>> stage = vc.stages.stage_dataset(vc.trace(m, np.zeros((56, 56, 3), np.uint8), sites="F2"), 0)
        >>> view = TraceView.of(stage)
        >>> window_rows(view, view.arrays["attn_window"], "mean", [0]).sum(axis=1).round(3)  # rows sum to 1
        array([[1., 1.]], dtype=float32)
    """
    if rows == "cls":
        view.token_index("cls", "attn_rows")
    query = slice(None) if rows == "mean" else view.patch
    keys = view.arrays["attn_window_key"][layer_pos][:, query]
    n_layers, n_heads = x.shape[:2]
    out = np.zeros((n_layers, view.kinds.size, n_heads), np.float32)
    for li in range(n_layers):
        k = keys[li].reshape(-1)
        valid = k >= 0
        flat = x[li][:, query, :].reshape(n_heads, -1)[:, valid]
        for h in range(n_heads):
            out[li, :, h] = np.bincount(k[valid], weights=flat[h], minlength=view.kinds.size)
    return out / keys.shape[1]


def weight_mask(view: TraceView, recipe: Recipe) -> np.ndarray:
    """Tokens whose gradients form channel weights (``weight_tokens``) as a boolean mask over tokens.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> view = TraceView.of(vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)))
        >>> int(weight_mask(view, vc.Recipe()).sum()), int(weight_mask(view, vc.Recipe(weight_tokens="all")).sum())
        (16, 17)
    """
    mask = np.zeros(view.kinds.shape, bool)
    if recipe.weight_tokens == "patch":
        mask[view.patch] = True
    elif recipe.weight_tokens == "all":
        mask[:] = True
    else:
        mask[view.token_index("cls", "weight_tokens")] = True
    return mask


def score_call(recipe: Recipe) -> str:
    """The ``vc.score`` call that stores the model outputs ``recipe`` reads (its fields other than the defaults).

    Example:
        >>> score_call(Recipe(weighting="scorecam", layer=0))
        "vc.score(tr, model, vc.Recipe(layer=0, weighting='scorecam'), image)"
    """
    default = Recipe()
    fields = ", ".join(f"{name}={value!r}" for name, value in recipe.to_dict().items()
                       if name not in ("upsample", "normalize", "relu") and getattr(default, name) != value)
    return f"vc.score(tr, model, vc.Recipe({fields}), image)"


def _stored(view: TraceView, recipe: Recipe, weights: dict[int, float], cls: int, index: tuple) -> dict:
    """The stored model outputs a scored weighting reads, for the recipe's target at ``index`` (layer, site)."""
    name = WEIGHTINGS.get(recipe.weighting).scores
    if not name:
        return {}
    if name not in view.arrays:
        raise RecipeError(f"weighting: {recipe.weighting} needs model outputs this trace does not hold (no "
                          f"{name!r} variable); add them with {score_call(recipe)}")
    pos = next(iter(weights))  # the recipe's class; prob / logprob add the expected target after it
    scores = view.arrays[name][index][..., pos, :].astype(np.float64)
    base = np.full(scores.shape[:-1], view.arrays["logits"][cls], np.float64)
    if recipe.target != "logit":  # log p_c = z_c - logsumexp(z), for each perturbed input and the traced one
        lse = f"{name}_logsumexp"
        if lse not in view.arrays:
            raise RecipeError(f"target: {recipe.target} needs the logsumexp of each perturbed input, which this "
                              f"trace does not hold; add it with {score_call(recipe)}")
        logits = view.arrays["logits"].astype(np.float64)
        scores = scores - view.arrays[lse][index]
        base = base - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
        if recipe.target == "prob":
            scores, base = np.exp(scores), np.exp(base)
    return {"scores": scores.astype(np.float32), "base": base.astype(np.float32), "k": recipe.k}


def raw_maps(view: TraceView, recipe: Recipe, layer_pos: list[int], site_pos: list[int] | None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw per-layer maps on the grid, their scale and whether their gradients were all zero.

    For token sites the leading dims are (layer, site); for F2 (site_pos None) just (layer,).

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> view = TraceView.of(vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)))
        >>> raw, scale, zero = raw_maps(view, vc.Recipe(), [0, 1], [0, 1])  # F1 and F3 of both blocks
        >>> raw.shape, zero.tolist()  # the last block's F3 patch tokens never reach the CLS-pooled output
        ((2, 2, 4, 4), [[False, False], [False, True]])
    """
    grad = "grad" if site_pos is not None else "attn_window_grad" if "attn_window" in view.arrays else "attn_grad"
    if grad not in view.arrays and WEIGHTINGS.get(recipe.weighting).uses_gradient:
        raise RecipeError(f"weighting: {recipe.weighting!r} reads gradients and this trace has no {grad!r} "
                          "variable; use a gradient-free weighting (e.g. 'eigencam') or trace again")
    weights, cls = view.target_weights(recipe)
    stored: dict = {}
    wmask = compact(weight_mask(view, recipe))
    patch = compact(view.patch)
    if site_pos is None and "attn_window" in view.arrays:
        A = view.arrays["attn_window"][layer_pos].astype(np.float32, copy=False)
        G = combine(view.arrays[grad], weights, (layer_pos,)) if grad in view.arrays else np.zeros_like(A)
        A, G = (window_rows(view, A, recipe.attn_rows, layer_pos),
                window_rows(view, G, recipe.attn_rows, layer_pos))
        groups = A.shape[-1]
    elif site_pos is None:
        A = view.arrays["attn"][layer_pos].astype(np.float32, copy=False)
        G = combine(view.arrays[grad], weights, (layer_pos,)) if grad in view.arrays else np.zeros_like(A)
        A, G = query_rows(view, A, recipe.attn_rows), query_rows(view, G, recipe.attn_rows)
        groups = A.shape[-1]
    else:
        heads = int(view.attrs.get("num_heads", 1))
        groups = heads if (view.sites[site_pos[0]] == "F3" and recipe.heads != "channels") else 1
        layers = compact(np.asarray(layer_pos))
        sites = compact(np.asarray(site_pos))
        if isinstance(sites, slice) and not WEIGHTINGS.get(recipe.weighting).scores:
            # Consecutive stored sites are one view of the (layer, site, ...) array: one pass for all of them
            # (each map's arithmetic is the same as alone; fewer, larger numpy calls).
            A = view.arrays["act"][layers, sites].astype(np.float32, copy=False)
            G = combine(view.arrays["grad"], weights, (layers, sites)) if "grad" in view.arrays else np.zeros_like(A)
            norms = view.activation_norms(groups, layers, sites)
            return grid_maps(view, recipe, A, G, wmask, patch, groups, norms=norms)
        per_site = []
        # One site at a time: a site of the stored (layer, site, ...) array is a view, where a list of sites
        # would be a fancy-indexed copy of every activation and gradient read.
        for sp in site_pos:
            A = view.arrays["act"][layers, sp].astype(np.float32, copy=False)
            G = combine(view.arrays["grad"], weights, (layers, sp)) if "grad" in view.arrays else np.zeros_like(A)
            stored = _stored(view, recipe, weights, cls, (layers, sp))
            per_site.append(grid_maps(view, recipe, A, G, wmask, patch, groups,
                                      norms=view.activation_norms(groups, layers, sp), **stored))
        return tuple(np.stack(parts, axis=1) for parts in zip(*per_site))
    return grid_maps(view, recipe, A, G, wmask, patch, groups, **stored)


def grid_maps(view: TraceView, recipe: Recipe, A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any, groups: int,
              norms: ActivationNorms | None = None, **stored: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighting and head rule over (..., token, channel) A and G: maps and scales on the grid, and whether
    the gradients the formula reads were all zero. ``stored``: the model outputs a scored weighting reads
    (a map that needs a channel ``vc.score`` has not scored is refused with the call that scores it).
    ``norms``: the cached activation norms of A's cells (:meth:`TraceView.activation_norms`). A channel-weighted
    map then fills them the first time, and later uses them to bound its scale, made exact where
    :func:`finish_layers` could not decide on the bound, so its verdicts are the exact scale's.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> view = TraceView.of(vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)))
        >>> A = view.arrays["act"][0, 0]; G = np.zeros_like(A)
        >>> maps, scale, zero = grid_maps(view, vc.Recipe(), A, G, compact(view.patch), compact(view.patch), 1)
        >>> maps.shape, bool(zero)
        ((4, 4), True)
    """
    channel = None if norms is None else channel_token_maps(A, G, recipe.weighting, wmask, patch, groups,
                                                            norms.get(), **stored)
    bounded = channel is not None and channel[2] is None
    if channel is None:
        raw, scale = token_maps(A, G, recipe.weighting, wmask, patch, groups, **stored)
    else:
        raw, scale, new_norms = channel
        if new_norms is not None:
            norms.put(new_norms)
    if stored and np.isnan(raw).any():
        raise RecipeError(f"weighting: {recipe.weighting} needs channel scores this trace does not hold at "
                          f"{recipe.site}, layer {recipe.layer}; add them with {score_call(recipe)}")
    rule = recipe.heads if groups > 1 or isinstance(recipe.heads, int) else "channels"
    maps, scale = apply_head_rule(raw, scale, rule)
    if bounded:
        # A map clearing the bound is real whatever the exact scale; a flat one (span 0) is constant whatever
        # it. Between the two, the kernel's exact scale decides, as it would have without the bound.
        span = _span(recipe, maps, -1)
        for idx in map(tuple, np.argwhere(~(span > view.rtol * scale.max(axis=-1)) & (span != 0))):
            part = {k: v[idx] if isinstance(v, np.ndarray) else v for k, v in stored.items()}
            scale[idx] = apply_head_rule(*token_maps(A[idx], G[idx], recipe.weighting, wmask, patch, groups, **part),
                                         rule)[1]
    weighting = WEIGHTINGS.get(recipe.weighting)
    zero_grad = np.zeros(maps.shape[:-1], bool)
    if weighting.uses_gradient:
        tokens = wmask if weighting.pools_tokens else patch
        # Scanning every gradient costs as much as the map; a nonzero map of such a kernel proves them nonzero.
        unproven = ~np.any(np.abs(raw) > 0, axis=(-2, -1)) if zero_gradient_gives_zero_map(recipe.weighting) \
            else np.ones(zero_grad.shape, bool)
        G = np.broadcast_to(G, (*zero_grad.shape, *G.shape[-2:]))
        for idx in map(tuple, np.argwhere(unproven)):
            zero_grad[idx] = not np.any(G[idx][..., tokens, :])  # truth of a float: nonzero (NaN too)
    return to_grid(view, maps), to_grid(view, scale), zero_grad


def _span(recipe: Recipe, raw: np.ndarray, axes: int | tuple[int, ...]) -> np.ndarray:
    """max - min of each map after the recipe's ReLU: what the degeneracy check compares with the scale."""
    maps = relu(raw) if recipe.relu == "after" else raw
    return maps.max(axis=axes) - maps.min(axis=axes)


def _saturated(logits: np.ndarray) -> bool:
    z = np.asarray(logits, np.float32).ravel()
    return bool(np.float32(1.0) / np.sum(np.exp(z - z.max())) == np.float32(1.0))


#: Why a map within rounding noise of a constant is degenerate (and why the ReLU left nothing of one).
CONSTANT_REASON = "the map is constant (after the ReLU nothing is left, or only rounding noise remains)"
RELU_REASON = f"{NOTHING_AFTER_RELU} (every value is <= 0, or within rounding noise of 0, before it)"


def zero_gradient_reason(recipe: Recipe, logits: np.ndarray, attrs: Any = None) -> str:
    """Why a map whose gradients are all zero is degenerate, for ``recipe`` on an image of these ``logits``;
    ``attrs`` (the trace's) may state the model's own cause (``zero_gradient_cause``, e.g. a VLM's tower layers
    its language model never reads).

    Example:
        >>> zero_gradient_reason(Recipe(target="prob"), np.array([0.0]))[:31]
        "target 'prob': a softmax over o"
    """
    attrs = attrs if attrs is not None else {}
    # an answer trace's prob is a softmax over the LM's vocabulary, not over its traced entries: those tests
    # would speak of the wrong softmax
    answer = str(attrs.get("target_kind", "")) == "answer"
    if not answer and recipe.target in ("prob", "logprob") and int(np.shape(logits)[-1]) == 1:
        return (f"target {recipe.target!r}: a softmax over one score is constant, so its gradient is zero; use "
                "target='logit' on a one-logit model")
    if not answer and recipe.target in ("prob", "logprob") and _saturated(logits):
        return (f"target {recipe.target!r}: the softmax is saturated (one score exceeds the others by so much "
                "that its probability is 1 in float32), so its gradient is exactly zero; use target='logit'")
    cause = str(attrs.get("zero_gradient_cause", ""))
    if cause:
        return f"gradients are exactly zero at these tokens (the target does not depend on them: {cause})"
    return ("gradients are exactly zero at these tokens (the target does not depend on them: with CLS "
            "pooling, the last block's patch tokens never reach the output)")


def finish_layers(view: TraceView, recipe: Recipe, raw: np.ndarray, scale: np.ndarray,
                   zero_grad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ReLU, degeneracy check, per-layer normalisation. Returns (maps, reasons) with reasons '' if fine.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> view = TraceView.of(vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)))
        >>> raw = np.stack([np.eye(4, dtype=np.float32), np.full((4, 4), -1, np.float32)])
        >>> maps, why = finish_layers(view, vc.Recipe(), raw, np.abs(raw), np.zeros(2, bool))
        >>> maps[0].max(), why[1][:15]
        (np.float32(1.0), 'the map is cons')
    """
    maps = relu(raw) if recipe.relu == "after" else raw
    span = _span(recipe, raw, (-2, -1))
    ref = scale.max(axis=(-2, -1))
    constant = span <= view.rtol * ref
    why_zero = zero_gradient_reason(recipe, view.arrays["logits"], view.attrs)
    why_constant = np.where(constant, CONSTANT_REASON, "")
    if recipe.relu == "after" and constant.any():
        # Every value at most rounding noise above 0: the ReLU left nothing (a cause of its own, not a flat map).
        negative = constant & (raw.max(axis=(-2, -1)) <= view.rtol * ref)
        why_constant = np.where(negative, RELU_REASON, why_constant)
    reasons = np.where(zero_grad, why_zero, why_constant)
    bad = reasons != ""
    maps = np.where(bad[..., None, None], np.float32(0), maps)
    return normalise(maps, recipe.normalize), reasons



def layer_maps(view: TraceView, recipe: Recipe, layer_pos: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer maps (ReLU, degeneracy, normalised, upsampled) before fusion, and why each is degenerate.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> view = TraceView.of(vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)))
        >>> maps, why = layer_maps(view, vc.Recipe(site="F4"), [0, 1])
        >>> maps.shape
        (2, 32, 32)
    """
    site_pos = None if recipe.site == ATTENTION_SITE else [view.sites.index(recipe.site)]
    raw, scale, zero_grad = raw_maps(view, recipe, layer_pos, site_pos)
    if site_pos is not None:
        raw, scale, zero_grad = raw[:, 0], scale[:, 0], zero_grad[:, 0]
    maps, reasons = finish_layers(view, recipe, raw, scale, zero_grad)
    return upsample(maps, (view.height, view.width), recipe.upsample, view.pad), reasons
