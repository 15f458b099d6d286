"""A recipe's map computed from one site's torch tensors on their device: the per-layer pipeline of
:mod:`vitcam_nb.compute.pipeline` (target combination, query rows, weighting kernel, head rule, grid, ReLU,
degeneracy, normalisation), layer fusion and the attention rollouts, for a batch of images at once, with the
torch kernels each registered weighting carries (``Weighting.torch_kernel``). NumPy stays the reference (and
what ``vc.cam`` runs on a trace held in memory); these maps equal it within float32 rounding.

The map comes back on the token grid, as ``vc.cam(trace, recipe.replace(upsample="none"))`` returns it; the
recipe's upsampling and normalisation are applied on read by :func:`vitcam_nb.compute.torch_spatial.read_map`.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
    >>> out = cam_tensors(vc.Recipe(site="F1", layer=0), tensors_of(tr, "F1"), layout_of(tr))
    >>> tuple(out.values.shape), out.degenerate.tolist()
    ((1, 4, 4), [False])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xarray as xr

from vitcam_nb.compute import torch_kernels as tk
from vitcam_nb.compute.pipeline import (
    CONSTANT_REASON,
    RELU_REASON,
    compact,
    score_call,
    weight_mask,
    zero_gradient_reason,
)
from vitcam_nb.compute.torch_spatial import normalise, to_grid
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, RecipeError
from vitcam_nb.core.recipe import INTEGRATED_ROLLOUTS, ROLLOUTS, Recipe
from vitcam_nb.core.schema import ATTENTION_SITE, TOKEN_SITES
from vitcam_nb.core.weighting import WEIGHTINGS

__all__ = ["TorchMap", "cam_tensors", "layout_of", "tensors_of", "token_layout", "torch_refusal"]

#: Per-layer verdicts of :attr:`TorchMap.codes`: fine, gradients all zero, constant, nothing left after the ReLU.
FINE, ZERO_GRADIENT, CONSTANT, NOTHING_LEFT = 0, 1, 2, 3


@dataclass
class TorchMap:
    """One recipe's maps for a batch of images, on the tensors' device.

    ``values`` (image, grid_h, grid_w) float32: the map on the token grid, as ``vc.cam`` returns it with
    ``upsample="none"`` (zeros where degenerate). ``degenerate`` (image,) bool: the map was returned as zeros.
    ``scale`` (image,) float32: the largest magnitude scale (sum of absolute terms of the formula) over the
    recipe's layer maps, what the degeneracy check compares each map's span with. ``codes`` (image, layer) int8:
    each layer's verdict (0 fine, 1 gradients all zero, 2 constant, 3 nothing left after the ReLU).
    ``fused_flat`` (image,) bool: the fused map is constant. :meth:`notes` turns these into ``vc.cam``'s text.

    Example:
        >>> t = TorchMap(torch.zeros(1, 2, 2), torch.tensor([True]), torch.ones(1), torch.tensor([[2]]),
        ...              torch.tensor([False]), Recipe(), [3], np.zeros((1, 5)))
        >>> t.notes(0)
        (['the map is constant (after the ReLU nothing is left, or only rounding noise remains)'], [])
    """

    values: torch.Tensor
    degenerate: torch.Tensor
    scale: torch.Tensor
    codes: torch.Tensor
    fused_flat: torch.Tensor
    recipe: Recipe
    layer_ids: list[int]
    logits: np.ndarray

    def notes(self, image: int) -> tuple[list[str], list[str]]:
        """Image ``image``'s (why the map is degenerate, which fused layers were degenerate and left out): the
        lists ``vc.cam`` puts in ``attrs["degenerate"]`` and ``attrs["degenerate_layers"]``."""
        texts = {ZERO_GRADIENT: zero_gradient_reason(self.recipe, self.logits[image]), CONSTANT: CONSTANT_REASON,
                 NOTHING_LEFT: RELU_REASON}
        codes = [int(c) for c in self.codes[image].tolist()]
        if self.recipe.layer_fusion in ROLLOUTS:
            return [texts[c] for c in codes if c], []
        several = len(self.layer_ids) > 1
        notes = [f"layer {lid}: {texts[c]}" if several else texts[c] for lid, c in zip(self.layer_ids, codes) if c]
        if len(notes) < len(self.layer_ids) and bool(self.fused_flat[image]):
            notes.append("the fused map is constant")
        return (notes, []) if bool(self.degenerate[image]) else ([], notes)


def torch_refusal(recipe: Recipe) -> str:
    """Why :func:`cam_tensors` cannot compute ``recipe`` ("" if it can), to refuse it before any model call.

    Example:
        >>> torch_refusal(Recipe()), torch_refusal(Recipe(weighting="agcam"))[:30]
        ('', 'weighting: agcam has no torch ')
    """
    if not isinstance(recipe, Recipe):
        raise ArgumentTypeError(f"recipe: expected a vitcam_nb.Recipe, got {type(recipe).__name__}")
    if WEIGHTINGS.get(recipe.weighting).torch_kernel is None:
        return (f"weighting: {recipe.weighting} has no torch kernel (a published method or a whole-image kind "
                "computed from several sites); compute it with vc.cam on a trace")
    if recipe.layer_fusion in INTEGRATED_ROLLOUTS:
        return (f"layer_fusion: {recipe.layer_fusion} integrates attention gradients stored by vc.score; it is "
                "computed by vc.cam on a trace only")
    if recipe.site != ATTENTION_SITE and recipe.site not in TOKEN_SITES:
        return f"site: {recipe.site} is not a token site or F2; compute it with vc.cam on a trace"
    if isinstance(recipe.layer, str) and recipe.layer != "all" or \
            isinstance(recipe.layer, tuple) and any(isinstance(v, str) for v in recipe.layer):
        return f"layer: {recipe.layer!r} is a 'stage.block' address (Swin); torch maps are of one token grid"
    return ""


def layout_of(trace: xr.Dataset) -> TraceView:
    """The token layout a trace's maps are computed on (token kinds, patch grid, traced blocks, heads, image size,
    storage tolerance): the trace's view. :func:`cam_tensors` reads its bookkeeping, never its arrays, so a view
    built for tensors that never were a trace serves as well (``TraceView(..., arrays={})``).

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> (layout_of(vc.trace(m, np.zeros((32, 32, 3), np.uint8))).gh, 4)[0]
        4
    """
    return TraceView.of(trace)


def token_layout(token_kind: Any, patch_row: Any, patch_col: Any, grid: tuple[int, int], layers: Any,
                 image_size: tuple[int, int], *, num_layers: int | None = None, num_heads: int = 1,
                 dtype: str = "float32", attrs: Mapping[str, Any] | None = None) -> TraceView:
    """The token layout of tensors that never were a trace: the coordinates a trace would have stored
    (``token_kind``, ``patch_row``, ``patch_col`` per token, as ``capture.assemble.token_coords`` gives them), the
    patch ``grid`` (h, w), the traced block ids of the layer axis, the image's (height, width), the model's block
    and head counts, the storage ``dtype`` (float16 storage makes the degeneracy tolerance 1e-2, as on a trace),
    and ``attrs`` for the padding a model adds (``dynamic_img_pad``, ``patch_size``).

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8))
        >>> lay = token_layout(tr["token_kind"].values, tr["patch_row"].values, tr["patch_col"].values, (4, 4),
        ...                    [0], (32, 32), num_heads=3)
        >>> lay.patch[:3].tolist(), lay.flat[:3].tolist(), lay.rtol
        ([1, 2, 3], [0, 1, 2], 1e-05)
    """
    kinds = np.asarray(token_kind).astype(str)
    if not np.shape(patch_row) == np.shape(patch_col) == kinds.shape:
        raise ArgumentError(f"patch_row, patch_col: one per token like token_kind {kinds.shape}, got "
                            f"{np.shape(patch_row)} and {np.shape(patch_col)}")
    patch = np.flatnonzero(kinds == "patch")
    gh, gw = (int(v) for v in grid)
    if patch.size != gh * gw:
        raise ArgumentError(f"token_kind: {patch.size} patch tokens for a {gh}x{gw} grid; give every token's kind")
    if dtype not in ("float32", "float16"):
        raise ArgumentError(f"dtype: expected 'float32' or 'float16', got {dtype!r}")
    layers = np.asarray(layers, np.int64)
    flat = np.asarray(patch_row)[patch] * gw + np.asarray(patch_col)[patch]
    return TraceView(attrs={"num_heads": num_heads, **(attrs or {})}, arrays={}, layers=layers, sites=[],
                     kinds=kinds, patch=patch, flat=flat.astype(np.int64), gh=gh, gw=gw,
                     height=int(image_size[0]), width=int(image_size[1]),
                     num_layers=int(num_layers if num_layers is not None else layers.max() + 1),
                     rtol=1e-2 if dtype == "float16" else 1e-5, signature=())


def tensors_of(trace: xr.Dataset, site: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """One site's tensors of a single-image trace, in :func:`cam_tensors`'s layout (an image axis of 1 in front),
    on ``device``: what a capture on the device hands over without the round trip through a trace.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> tuple(tensors_of(vc.trace(m, np.zeros((32, 32, 3), np.uint8)), "F1")["act"].shape)
        (1, 1, 17, 192)
    """
    def put(a: Any) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a)[None], device=device)

    out = {"logits": put(trace["logits"].values), "target_class": put(trace["target_class"].values)}
    if site == ATTENTION_SITE:
        out.update({k: put(trace[k].values) for k in ("attn", "attn_grad") if k in trace.variables})
        return out
    pos = [str(s) for s in trace["site"].values].index(site)
    out["act"] = put(trace["act"].values[:, pos])
    if "grad" in trace.variables:
        out["grad"] = put(trace["grad"].values[:, :, pos])
    for name in ("score", "ablation", "score_logsumexp", "ablation_logsumexp"):
        if name in trace.variables:
            out[name] = put(trace[name].values[:, pos])
    return out


def _need(tensors: Mapping[str, Any], name: str, ndim: int, batch: int | None = None) -> torch.Tensor:
    if name not in tensors:
        raise RecipeError(f"tensors: this recipe reads {name!r}, which the tensors given do not hold "
                          f"(given: {sorted(tensors)})")
    t = tensors[name]
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"tensors[{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim or (batch is not None and t.shape[0] != batch):
        raise ArgumentError(f"tensors[{name!r}]: expected {ndim} dimensions with {batch} images first, got shape "
                            f"{tuple(t.shape)}")
    return t


def _index(index: slice | np.ndarray, device: torch.device) -> slice | torch.Tensor:
    return index if isinstance(index, slice) else torch.as_tensor(index, device=device)


def _target_weights(layout: TraceView, recipe: Recipe, logits: np.ndarray, classes: np.ndarray,
                    device: torch.device) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    """(image, target) float32 coefficients of each image's gradient combination, its class, the position of
    that class among the targets, and the targets any image combines: the view's rules
    (``TraceView.target_weights``) run image by image."""
    weights = torch.zeros(classes.shape, dtype=torch.float32)
    cls_of, pos_of, used = [], [], set()
    for i in range(classes.shape[0]):
        one = dataclasses.replace(layout, arrays={"logits": logits[i], "target_class": classes[i]})
        w, cls = one.target_weights(recipe)
        for pos, coef in w.items():
            weights[i, pos] = float(np.float32(coef))  # rounded as pipeline.combine rounds it
        used |= set(w)
        cls_of.append(cls)
        pos_of.append(next(iter(w)))
    return weights.to(device), cls_of, pos_of, sorted(used)


def _combine(grad: torch.Tensor, combination: tuple[torch.Tensor, list[int]], layers: slice | torch.Tensor
             ) -> torch.Tensor:
    """sum over the targets used of weights[image, target] * grad[image, target, layers, ...] in float32
    (``pipeline.combine``; a coefficient of 0, a saturated softmax's, still gives zeros, not no gradient)."""
    weights, used = combination
    out = None
    for t in used:
        w = weights[:, t].reshape(-1, *([1] * (grad.ndim - 2)))
        term = grad[:, t, layers].to(torch.float32) * w  # one target's layers: the other targets are never read
        out = term if out is None else out + term
    return out


def _query_rows(layout: TraceView, x: torch.Tensor, rows: str) -> torch.Tensor:
    """(..., H, Tq, Tk) -> (..., Tk, H) by the recipe's query rows (``pipeline.query_rows``)."""
    if rows == "cls":
        sel = x[..., layout.token_index("cls", "attn_rows"), :]
    elif rows == "mean":
        sel = x.mean(dim=-2)
    else:
        sel = x[..., _index(compact(layout.patch), x.device), :].mean(dim=-2)
    return sel.transpose(-1, -2)


def _stored(tensors: Mapping[str, Any], recipe: Recipe, layer_pos: list[int], logits: np.ndarray,
            cls_of: list[int], pos_of: list[int], batch: int, device: torch.device) -> dict:
    """The stored model outputs a scored weighting reads, per image (``pipeline._stored``)."""
    name = WEIGHTINGS.get(recipe.weighting).scores
    if not name:
        return {}
    if name not in tensors:
        raise RecipeError(f"weighting: {recipe.weighting} needs model outputs the tensors do not hold (no {name!r}); "
                          f"a trace gets them with {score_call(recipe)}")
    layers = torch.as_tensor(layer_pos, device=device)
    every = _need(tensors, name, 4, batch)[:, layers].to(torch.float64)  # (image, layer, target, channel)
    pos = torch.as_tensor(pos_of, device=device).reshape(-1, 1, 1, 1).expand(-1, every.shape[1], 1, every.shape[3])
    scores = torch.gather(every, 2, pos)[:, :, 0]
    lg = logits.astype(np.float64)
    base = torch.as_tensor(lg[np.arange(batch), cls_of], device=device)[:, None].expand(-1, len(layer_pos))
    if recipe.target != "logit":
        lse = _need(tensors, f"{name}_logsumexp", 3, batch)[:, layers].to(torch.float64)
        top = lg.max(axis=-1)
        total = top + np.log(np.exp(lg - top[:, None]).sum(axis=-1))
        scores, base = scores - lse, base - torch.as_tensor(total, device=device)[:, None]
        if recipe.target == "prob":
            scores, base = torch.exp(scores), torch.exp(base)
    return {"scores": scores.to(torch.float32), "base": base.to(torch.float32), "k": recipe.k}


def _raw_maps(layout: TraceView, recipe: Recipe, tensors: Mapping[str, Any], layer_pos: list[int],
              combination: tuple[torch.Tensor, list[int]], stored: dict, batch: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(image, layer, gh, gw) raw maps and scales, and (image, layer) whether their gradients were all zero."""
    weighting = WEIGHTINGS.get(recipe.weighting)
    attention = recipe.site == ATTENTION_SITE
    if attention and "attn_window" in tensors:
        raise RecipeError("site: F2 of window attention (Swin) is computed by vc.cam on a stage trace; torch maps "
                          "read token-to-token attention ('attn') of one token grid")
    act_name, grad_name = ("attn", "attn_grad") if attention else ("act", "grad")
    A = _need(tensors, act_name, 5 if attention else 4, batch)
    device = A.device
    layers = _index(compact(np.asarray(layer_pos)), device)
    A = A[:, layers].to(torch.float32)
    if grad_name in tensors:
        G = _combine(_need(tensors, grad_name, A.ndim + 1, batch), combination, layers)
    elif weighting.uses_gradient:
        raise RecipeError(f"weighting: {recipe.weighting!r} reads gradients and the tensors hold no {grad_name!r}; "
                          "use a gradient-free weighting (e.g. 'eigencam') or capture the gradients")
    else:
        G = torch.zeros_like(A)
    if attention:
        A, G = _query_rows(layout, A, recipe.attn_rows), _query_rows(layout, G, recipe.attn_rows)
        groups = A.shape[-1]
    else:
        heads = int(layout.attrs.get("num_heads", 1))
        groups = heads if recipe.site == "F3" and recipe.heads != "channels" else 1
    wmask = _index(compact(weight_mask(layout, recipe)), device)
    patch = _index(compact(layout.patch), device)
    raw, scale = weighting.torch_kernel(A, G, wmask, patch, groups, **stored)
    if stored and bool(torch.isnan(raw).any()):
        raise RecipeError(f"weighting: {recipe.weighting} needs channel scores the tensors do not hold at "
                          f"{recipe.site}, layer {recipe.layer}; a trace gets them with {score_call(recipe)}")
    rule = recipe.heads if groups > 1 or isinstance(recipe.heads, int) else "channels"
    maps, scale = tk.apply_head_rule(raw, scale, rule)
    zero_grad = torch.zeros(maps.shape[:-1], dtype=torch.bool, device=device)
    if weighting.uses_gradient:
        tokens = wmask if weighting.pools_tokens else patch
        # NaN != 0 counts as a nonzero gradient, as the truth of a float does in the NumPy pass.
        zero_grad = ~(G[..., tokens, :] != 0).any(dim=-1).any(dim=-1)
    grid = (layout.gh, layout.gw)
    return to_grid(maps, layout.flat, grid), to_grid(scale, layout.flat, grid), zero_grad


def _finish(layout: TraceView, recipe: Recipe, raw: torch.Tensor, scale: torch.Tensor, zero_grad: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """ReLU, degeneracy verdicts and per-layer normalisation (``pipeline.finish_layers``): (maps, codes)."""
    maps = tk.relu(raw) if recipe.relu == "after" else raw
    span = maps.amax(dim=(-2, -1)) - maps.amin(dim=(-2, -1))
    ref = scale.amax(dim=(-2, -1))
    constant = span <= layout.rtol * ref
    codes = torch.where(constant, CONSTANT, FINE)
    if recipe.relu == "after":
        codes = torch.where(constant & (raw.amax(dim=(-2, -1)) <= layout.rtol * ref), NOTHING_LEFT, codes)
    codes = torch.where(zero_grad, ZERO_GRADIENT, codes).to(torch.int8)
    maps = torch.where((codes != FINE)[..., None, None], torch.zeros((), device=maps.device), maps)
    return normalise(maps, recipe.normalize), codes


def _rollout(layout: TraceView, recipe: Recipe, tensors: Mapping[str, Any], layer_pos: list[int],
             combination: tuple[torch.Tensor, list[int]], batch: int) -> torch.Tensor:
    """(image, gh, gw) rollout maps (``fusion.rollout``), products over blocks in forward order in float64."""
    layer_pos = sorted(set(layer_pos), key=lambda p: int(layout.layers[p]))
    attn = _need(tensors, "attn", 5, batch)
    layers = torch.as_tensor(layer_pos, device=attn.device)
    attn = attn[:, layers].to(torch.float64)
    n = attn.shape[-1]
    eye = torch.eye(n, dtype=torch.float64, device=attn.device)
    R = eye.expand(batch, n, n)
    if recipe.layer_fusion == "rollout":
        for li in range(attn.shape[1]):
            R = (0.5 * attn[:, li].mean(dim=1) + 0.5 * eye) @ R
    else:
        grads = _combine(_need(tensors, "attn_grad", 6, batch), combination, layers).to(torch.float64)
        for li in range(attn.shape[1]):
            R = R + tk.relu(grads[:, li] * attn[:, li]).mean(dim=1) @ R
    rows = _query_rows(layout, R[:, None].to(torch.float32), recipe.attn_rows)[..., 0]
    return to_grid(rows[..., _index(compact(layout.patch), rows.device)], layout.flat, (layout.gh, layout.gw))


def cam_tensors(recipe: Recipe, tensors: Mapping[str, torch.Tensor], layout: TraceView) -> TorchMap:
    """``recipe``'s map for a batch of images from one site's tensors, computed on their device.

    ``tensors`` holds the trace's variables of the recipe's site with an image axis in front (the layout
    ``vc.trace`` stores, float32 or float16, on one device; :func:`tensors_of` builds them from a trace):

    - ``logits`` (image, class) and ``target_class`` (image, target): the model outputs and the traced
      targets (class indices, -1 for the expected-logit target), from which each image's target combination
      follows as in ``vc.cam`` (copied to the host: a few numbers per image);
    - a token site (F1, F3, ...): ``act`` (image, layer, token, channel) and, for a weighting that reads
      gradients, ``grad`` (image, target, layer, token, channel);
    - F2 and the rollouts: ``attn`` (image, layer, head, query, key) and ``attn_grad`` (image, target, layer,
      head, query, key);
    - a scored weighting (``vc.score``'s outputs): ``score`` or ``ablation`` (image, layer, target, channel) and,
      for prob / logprob targets, ``score_logsumexp`` / ``ablation_logsumexp`` (image, layer, channel).

    The layer axis is the traced blocks (``layout.layers``); ``layout`` is the token layout (:func:`layout_of` of
    a trace, :func:`token_layout` of a capture's coordinates). Returns a :class:`TorchMap`: the map on the token
    grid, degenerate flags and scale. A recipe this path cannot compute is refused first (:func:`torch_refusal`).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
        >>> out = cam_tensors(vc.Recipe(layer=0), tensors_of(tr, "F1"), layout_of(tr))
        >>> bool(np.allclose(out.values[0].numpy(), vc.cam(tr, vc.Recipe(layer=0, upsample="none")), atol=1e-5))
        True
    """
    refusal = torch_refusal(recipe)
    if refusal:
        raise RecipeError(refusal)
    if not isinstance(layout, TraceView):
        raise ArgumentTypeError(f"layout: expected the token layout of vitcam_nb.compute.torch_maps.layout_of, got "
                                f"{type(layout).__name__}")
    if not isinstance(tensors, Mapping):
        raise ArgumentTypeError(f"tensors: expected a mapping of trace variable names to torch tensors, got "
                                f"{type(tensors).__name__}")
    logits_t = _need(tensors, "logits", 2)
    batch = int(logits_t.shape[0])
    logits = logits_t.detach().to("cpu", torch.float32).numpy()
    classes = _need(tensors, "target_class", 2, batch).detach().cpu().numpy()
    layer_pos = layout.layer_positions(recipe.layer)
    device = logits_t.device
    weights, cls_of, pos_of, used = _target_weights(layout, recipe, logits, classes, device)
    layer_ids = [int(layout.layers[p]) for p in layer_pos]
    if recipe.layer_fusion in ROLLOUTS:
        raw = _rollout(layout, recipe, tensors, layer_pos, (weights, used), batch)[:, None]
        maps, codes = _finish(layout, recipe, raw, raw.abs(), torch.zeros(raw.shape[:2], dtype=torch.bool,
                                                                          device=raw.device))
        return TorchMap(maps[:, 0], codes[:, 0] != FINE, raw.abs().amax(dim=(-3, -2, -1)), codes,
                        torch.zeros(batch, dtype=torch.bool, device=raw.device), recipe, layer_ids, logits)
    stored = _stored(tensors, recipe, layer_pos, logits, cls_of, pos_of, batch, device)
    raw, scale, zero_grad = _raw_maps(layout, recipe, tensors, layer_pos, (weights, used), stored, batch)
    maps, codes = _finish(layout, recipe, raw, scale, zero_grad)
    fused = maps[:, 0] if len(layer_pos) == 1 else tk.fuse(maps.transpose(0, 1), recipe.layer_fusion)
    flat = (fused.amax(dim=(-2, -1)) - fused.amin(dim=(-2, -1))) <= 0
    degenerate = (codes != FINE).all(dim=1) | flat
    values = torch.where(degenerate[:, None, None], torch.zeros((), device=fused.device),
                         normalise(fused, recipe.normalize))
    return TorchMap(values, degenerate, scale.amax(dim=(-3, -2, -1)), codes, flat, recipe, layer_ids, logits)
