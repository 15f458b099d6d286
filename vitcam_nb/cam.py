"""Pure computations from a trace Dataset to heatmaps: no model call, vectorised over layers and sites.

Pipeline per layer (DESIGN.md section 5): map over patch tokens -> raster grid -> ReLU -> normalise ->
upsample; then fuse layers and normalise again.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.errors import DegenerateMapWarning, RecipeError, TraceError
from vitcam_nb.taxonomy import ROLLOUTS, Recipe, build_checklist, describe

SUPPORTED_SCHEMAS = (1,)
_TOKEN_VARS = ("act", "grad")
_ATTN_VARS = ("attn", "attn_grad")


_VIEWS: dict[int, tuple[weakref.ref, _TraceView]] = {}


@dataclass
class _TraceView:
    """Plain numpy views of a trace plus the bookkeeping every computation needs (cached per trace)."""

    attrs: dict
    arrays: dict[str, np.ndarray]
    layers: np.ndarray
    sites: list[str]
    kinds: np.ndarray
    patch: np.ndarray
    flat: np.ndarray
    gh: int
    gw: int
    height: int
    width: int
    num_layers: int
    rtol: float
    signature: tuple

    @staticmethod
    def _signature(trace: xr.Dataset) -> tuple:
        # Identity of each variable's data: a trace whose arrays were replaced gets a fresh view.
        return tuple((k, id(v._data)) for k, v in trace.variables.items())

    @classmethod
    def of(cls, trace: Any) -> _TraceView:
        if not isinstance(trace, xr.Dataset):
            raise TypeError(f"trace: expected an xarray.Dataset from vitcam_nb.trace(), got {type(trace).__name__}")
        key = id(trace)
        signature = cls._signature(trace)
        ref, cached = _VIEWS.get(key, (None, None))
        if cached is not None and ref() is trace and cached.signature == signature:
            return cached
        view = cls._build(trace, signature)
        # Datasets are unhashable, so cache by id and drop the entry when the trace is collected.
        _VIEWS[key] = (weakref.ref(trace, lambda _r, k=key: _VIEWS.pop(k, None)), view)
        return view

    @classmethod
    def _build(cls, trace: xr.Dataset, signature: tuple) -> _TraceView:
        version = trace.attrs.get("schema_version")
        if version is None:
            raise TraceError("trace: not a vitcam_nb trace (no schema_version attribute)")
        if int(version) not in SUPPORTED_SCHEMAS:
            raise TraceError(f"trace: schema_version {version} is not supported (this vitcam_nb reads "
                             f"{list(SUPPORTED_SCHEMAS)}); re-trace the model with this version")
        missing = [k for k in ("token_kind", "patch_row", "patch_col", "logits", "target_class")
                   if k not in trace.variables]
        if missing:
            raise TraceError(f"trace: missing {missing}; it does not follow the vitcam_nb schema")
        arrays = {k: trace.variables[k].values for k in ("act", "grad", "attn", "attn_grad", "logits",
                                                         "target_class", "site", "attn_window", "attn_window_grad",
                                                         "attn_window_key") if k in trace.variables}
        kinds = trace.variables["token_kind"].values
        patch = np.flatnonzero(kinds == "patch")
        gh, gw = int(trace.attrs["grid_h"]), int(trace.attrs["grid_w"])
        rows = trace.variables["patch_row"].values[patch]
        cols = trace.variables["patch_col"].values[patch]
        sites = [str(s) for s in arrays["site"]] if "site" in arrays else []
        if "attn" in arrays or "attn_window" in arrays:
            sites.append("F2")
        stored = [arrays[k] for k in ("grad", "attn_grad", "attn_window_grad") if k in arrays]
        if not stored:
            raise RecipeError("site: this trace holds no block sites (e.g. only 'xattn'); use site='xattn' or "
                              "trace again with sites=[..., 'F1']")
        dtype = stored[0].dtype
        height = int(trace.sizes.get("y", trace.attrs.get("img_height", gh)))
        width = int(trace.sizes.get("x", trace.attrs.get("img_width", gw)))
        return cls(
            attrs=trace.attrs, arrays=arrays, layers=trace.variables["layer"].values, sites=sites,
            kinds=kinds, patch=patch, flat=rows * gw + cols, gh=gh, gw=gw, height=height, width=width,
            num_layers=int(trace.attrs.get("num_layers", int(trace.variables["layer"].values.max()) + 1)),
            rtol=1e-2 if dtype == np.float16 else 1e-5, signature=signature,
        )

    def token_index(self, kind: str, field: str) -> int:
        where = np.flatnonzero(self.kinds == kind)
        if where.size == 0:
            present = sorted(set(map(str, self.kinds)) - {"patch"})
            has = f"prefix tokens {present}" if present else "no prefix tokens (e.g. class_token=False)"
            instead = {"weight_tokens": "weight_tokens='patch' or 'all'",
                       "attn_rows": "attn_rows='mean' or 'patch_mean'"}.get(field, "another choice")
            raise RecipeError(f"{field}={kind!r}: needs a {kind} token, but this model has {has}; "
                              f"use {instead} instead")
        return int(where[0])

    def layer_positions(self, layer: int | tuple | str) -> list[int]:
        traced = [int(v) for v in self.layers]
        if layer == "all":
            return list(range(len(traced)))
        wanted = layer if isinstance(layer, tuple) else (layer,)
        out = []
        for v in wanted:
            if isinstance(v, str):
                raise RecipeError(f"layer: {v!r} is a 'stage.block' address, which only hierarchical (Swin) traces "
                                  "have; this trace's blocks are numbered by int")
            if not -self.num_layers <= v < self.num_layers:
                raise RecipeError(f"layer: {v} is out of range for a model with {self.num_layers} blocks "
                                  f"(allowed -{self.num_layers}..{self.num_layers - 1})")
            absolute = v % self.num_layers
            if absolute not in traced:
                raise RecipeError(f"layer: block {absolute} was not traced (traced: {traced}); trace again "
                                  "with layers=None or include it")
            if traced.index(absolute) in out:
                raise RecipeError(f"layer: {wanted!r} names block {absolute} twice on a model with "
                                  f"{self.num_layers} blocks; list each block once")
            out.append(traced.index(absolute))
        return out

    def site_check(self, site: str) -> None:
        model_sites = str(self.attrs.get("model_sites", "")).split(",")
        if site not in self.sites and self.attrs.get("model_sites") and site not in model_sites:
            raise RecipeError(f"site: this {self.attrs.get('model_family', '')} model has no {site!r} (its blocks "
                              f"lack that module); its sites are {model_sites}")
        if site not in self.sites:
            raise RecipeError(f"site: {site!r} is not in this trace (traced sites: {self.sites}); trace again "
                              f"with sites=[..., {site!r}]")

    def target_weights(self, recipe: Recipe) -> tuple[dict[int, float], int]:
        """Target positions and coefficients whose combination is the recipe's gradient, and the class."""
        logits = self.arrays["logits"].astype(np.float64)
        classes = [int(c) for c in self.arrays["target_class"]]
        if isinstance(recipe.class_, str):
            rank = int(recipe.class_[3:])
            if rank > logits.size:
                raise RecipeError(f"class_: {recipe.class_} but the model has {logits.size} classes")
            cls = int(np.argmax(logits)) if rank == 1 else int(np.argsort(-logits, kind="stable")[rank - 1])
        else:
            cls = int(recipe.class_)
            if cls >= logits.size:
                raise RecipeError(f"class_: {cls} is out of range (the model has {logits.size} classes)")
        traced = [c for c in classes if c >= 0]
        if cls not in classes:
            raise RecipeError(f"class_: class {cls} was not traced (traced classes: {traced}); trace again with "
                              f"targets=[..., {cls}] or targets='topK' with a larger K")
        pos = classes.index(cls)
        if recipe.target == "logit" or recipe.layer_fusion == "rollout":
            return {pos: 1.0}, cls
        if -1 not in classes:
            raise RecipeError(f"target: {recipe.target!r} is derived from the expected-logit gradient, which this "
                              "trace lacks; use target='logit' or trace again with vitcam_nb.trace()")
        expected = classes.index(-1)
        if recipe.target == "logprob":
            return {pos: 1.0, expected: -1.0}, cls
        p = np.exp(logits - logits.max())
        p_c = float(p[cls] / p.sum())
        return {pos: p_c, expected: -p_c}, cls


def _compact(index: np.ndarray) -> slice | np.ndarray:
    """A contiguous index (positions or a boolean mask) as a slice, so numpy returns a view, not a copy."""
    positions = np.flatnonzero(index) if index.dtype == bool else np.asarray(index)
    if positions.size and np.array_equal(positions, np.arange(positions[0], positions[0] + positions.size)):
        return slice(int(positions[0]), int(positions[0]) + positions.size)
    return positions


def _combine(grad: np.ndarray, weights: dict[int, float], index: tuple) -> np.ndarray:
    """Weighted sum over targets of ``grad[(target, *index)]`` in float32 (prob/logprob are derived this way)."""
    out = None
    for pos, w in weights.items():
        # Select the target first: numpy would move mixed integer/array indices to the front.
        term = grad[pos][index].astype(np.float32, copy=False)
        term = term if w == 1.0 else term * np.float32(w)
        out = term if out is None else out + term
    return out


# -- per-layer maps over tokens -------------------------------------------------------------------
def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0)


def _group(x: np.ndarray, groups: int) -> np.ndarray:
    return x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)


def token_maps(A: np.ndarray, G: np.ndarray, weighting: str, wmask: np.ndarray, patch: np.ndarray,
               groups: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per-group maps over patch tokens and their magnitude scale, for any leading batch dimensions.

    ``A`` and ``G`` are (..., T, K); ``wmask`` selects the tokens that form channel weights; ``patch``
    indexes the patch tokens; ``groups`` splits channels into heads. Returns ``maps`` (..., P, groups)
    and ``scale`` (..., P, groups), the same sums taken over absolute terms (for degeneracy checks).

    Example:
        >>> A = np.ones((3, 2), np.float32); G = np.ones((3, 2), np.float32)
        >>> token_maps(A, G, "gradcam", np.array([False, True, True]), np.array([1, 2]))[0][..., 0]
        array([2., 2.], dtype=float32)
    """
    if weighting in ("eigencam", "eigengradcam"):
        X = A[..., patch, :] if weighting == "eigencam" else (G * A)[..., patch, :]
        X = X - X.mean(axis=-2, keepdims=True)
        _, _, vt = np.linalg.svd(X, full_matrices=False)
        v = vt[..., 0, :]
        proj = np.einsum("...tk,...k->...t", X, v)
        peak = np.take_along_axis(proj, np.abs(proj).argmax(-1)[..., None], -1)
        proj = proj * np.where(peak < 0, -1, 1)
        scale = np.einsum("...tk,...k->...t", np.abs(X), np.abs(v))
        return proj[..., None], scale[..., None]
    if weighting in ("gradcam", "gradcampp", "xgradcam"):
        Gw, Aw = G[..., wmask, :], A[..., wmask, :]
        if weighting == "gradcam":
            alpha = Gw.mean(axis=-2)
        elif weighting == "gradcampp":
            g2 = Gw * Gw
            a = g2 / (2 * g2 + Aw.sum(axis=-2, keepdims=True) * g2 * Gw + 1e-6)
            alpha = (_relu(Gw) * np.where(Gw != 0, a, 0)).sum(axis=-2)
        else:
            alpha = (Gw * Aw / (Aw.sum(axis=-2, keepdims=True) + 1e-7)).sum(axis=-2)
        Ap = _group(A[..., patch, :], groups)
        alpha = _group(alpha, groups)
        maps = np.einsum("...tgd,...gd->...tg", Ap, alpha)
        scale = np.einsum("...tgd,...gd->...tg", np.abs(Ap), np.abs(alpha))
        return maps, scale
    Ap, Gp = A[..., patch, :], G[..., patch, :]
    if weighting == "hirescam":
        terms = Gp * Ap
    elif weighting == "gradcam_elementwise":
        terms = _relu(Gp * Ap)
    elif weighting == "layercam":
        terms = _relu(Gp) * Ap
    elif weighting == "gradient":
        terms = Gp
    else:
        raise RecipeError(f"weighting: unknown {weighting!r}")
    terms = _group(terms, groups)
    return terms.sum(axis=-1), np.abs(terms).sum(axis=-1)


def _heads(maps: np.ndarray, scale: np.ndarray, rule: str | int) -> tuple[np.ndarray, np.ndarray]:
    """Aggregate the trailing group axis of (..., P, groups) by the recipe's head rule."""
    groups = maps.shape[-1]
    if isinstance(rule, int):
        if rule >= groups:
            raise RecipeError(f"heads: head {rule} does not exist (the model has {groups} heads: 0..{groups - 1})")
        return maps[..., rule], scale[..., rule]
    if rule == "channels":
        return maps.sum(-1), scale.sum(-1)
    if rule == "mean_then_relu":
        return maps.mean(-1), scale.mean(-1)
    if rule == "relu_then_mean":
        return _relu(maps).mean(-1), scale.mean(-1)
    return maps.max(-1), scale.max(-1)


# -- grid, normalisation, upsampling --------------------------------------------------------------
def _normalise(x: np.ndarray, how: str) -> np.ndarray:
    if how == "none":
        return x
    axes = (-2, -1)
    hi = x.max(axis=axes, keepdims=True)
    if how == "max":
        return np.where(hi > 0, x / np.where(hi > 0, hi, 1), 0).astype(np.float32)
    lo = x.min(axis=axes, keepdims=True)
    span = hi - lo
    return np.where(span > 0, (x - lo) / np.where(span > 0, span, 1), 0).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _interp_matrix(n_in: int, n_out: int, mode: str, transpose: bool = False) -> np.ndarray:
    """(n_out, n_in) matrix of torch's 1-D interpolation (or its contiguous transpose, which BLAS needs
    to be fast); the 2-D modes are separable products of it."""
    import torch
    import torch.nn.functional as F

    eye = torch.eye(n_in, dtype=torch.float64)
    # Interpolating each unit impulse along one axis gives that input's column of the weight matrix.
    kwargs = {} if mode == "nearest" else {"align_corners": False}
    cols = F.interpolate(eye[:, None, None, :], size=(1, n_out), mode=mode, **kwargs)[:, 0, 0, :]
    weights = cols if transpose else cols.T
    return np.ascontiguousarray(weights.numpy(), dtype=np.float32)


def upsample(grid: np.ndarray, size: tuple[int, int], mode: str) -> np.ndarray:
    """Upsample (..., h, w) maps to ``size`` with torch's bilinear/bicubic/nearest rules (half-pixel centres).

    Example:
        >>> upsample(np.eye(2, dtype=np.float32), (4, 4), "nearest")[0]
        array([1., 1., 0., 0.], dtype=float32)
    """
    if mode == "none":
        return grid
    wy = _interp_matrix(grid.shape[-2], size[0], mode)
    wx_t = _interp_matrix(grid.shape[-1], size[1], mode, transpose=True)
    return wy @ grid.astype(np.float32, copy=False) @ wx_t


def _to_grid(view: _TraceView, raw: np.ndarray) -> np.ndarray:
    out = np.zeros((*raw.shape[:-1], view.gh * view.gw), np.float32)
    out[..., view.flat] = raw
    return out.reshape(*raw.shape[:-1], view.gh, view.gw)


# -- the per-recipe computation --------------------------------------------------------------------
def _rows(view: _TraceView, x: np.ndarray, rows: str) -> np.ndarray:
    """Select F2 query rows of (..., H, Tq, Tk) and return (..., Tk, H)."""
    if rows == "cls":
        sel = x[..., view.token_index("cls", "attn_rows"), :]
    elif rows == "mean":
        sel = x.mean(axis=-2)
    else:
        sel = x[..., view.patch, :].mean(axis=-2)
    return np.swapaxes(sel, -1, -2)


def _window_rows(view: _TraceView, x: np.ndarray, rows: str, layer_pos: list[int]) -> np.ndarray:
    """:func:`_rows` for window attention (layer, H, Tq, window position) -> (layer, Tk, H): the mean over
    query rows of the dense matrix, each key token summing its entries from every window (padding dropped)."""
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


def _weight_mask(view: _TraceView, recipe: Recipe) -> np.ndarray:
    mask = np.zeros(view.kinds.shape, bool)
    if recipe.weight_tokens == "patch":
        mask[view.patch] = True
    elif recipe.weight_tokens == "all":
        mask[:] = True
    else:
        mask[view.token_index("cls", "weight_tokens")] = True
    return mask


def _raw_maps(view: _TraceView, recipe: Recipe, layer_pos: list[int], site_pos: list[int] | None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw per-layer maps on the grid, their scale and whether their gradients were all zero.

    For token sites the leading dims are (layer, site); for F2 (site_pos None) just (layer,).
    """
    weights, _ = view.target_weights(recipe)
    wmask = _compact(_weight_mask(view, recipe))
    patch = _compact(view.patch)
    if site_pos is None and "attn_window" in view.arrays:
        A = view.arrays["attn_window"][layer_pos].astype(np.float32, copy=False)
        G = _combine(view.arrays["attn_window_grad"], weights, (layer_pos,))
        A, G = (_window_rows(view, A, recipe.attn_rows, layer_pos),
                _window_rows(view, G, recipe.attn_rows, layer_pos))
        groups = A.shape[-1]
    elif site_pos is None:
        A = view.arrays["attn"][layer_pos].astype(np.float32, copy=False)
        G = _combine(view.arrays["attn_grad"], weights, (layer_pos,))
        A, G = _rows(view, A, recipe.attn_rows), _rows(view, G, recipe.attn_rows)
        groups = A.shape[-1]
    else:
        idx = (_compact(np.asarray(layer_pos)), _compact(np.asarray(site_pos)))
        if not any(isinstance(i, slice) for i in idx):
            idx = np.ix_(*idx)
        A = view.arrays["act"][idx].astype(np.float32, copy=False)
        G = _combine(view.arrays["grad"], weights, idx)
        heads = int(view.attrs.get("num_heads", 1))
        groups = heads if (view.sites[site_pos[0]] == "F3" and recipe.heads != "channels") else 1
    return _grid_maps(view, recipe, A, G, wmask, patch, groups)


def _grid_maps(view: _TraceView, recipe: Recipe, A: np.ndarray, G: np.ndarray, wmask: Any, patch: Any,
               groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighting and head rule over (..., token, channel) A and G: maps and scales on the grid, and whether
    the gradients the formula reads were all zero."""
    maps, scale = token_maps(A, G, recipe.weighting, wmask, patch, groups)
    maps, scale = _heads(maps, scale, recipe.heads if groups > 1 or isinstance(recipe.heads, int) else "channels")
    if recipe.weighting == "eigencam":
        zero_grad = np.zeros(maps.shape[:-1], bool)
    elif recipe.weighting in ("gradcam", "gradcampp", "xgradcam"):
        zero_grad = ~np.any(G[..., wmask, :] != 0, axis=(-2, -1))
    else:
        zero_grad = ~np.any(G[..., patch, :] != 0, axis=(-2, -1))
    return _to_grid(view, maps), _to_grid(view, scale), zero_grad


def _finish_layers(view: _TraceView, recipe: Recipe, raw: np.ndarray, scale: np.ndarray,
                   zero_grad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ReLU, degeneracy check, per-layer normalisation. Returns (maps, reasons) with reasons '' if fine."""
    maps = _relu(raw) if recipe.relu == "after" else raw
    span = maps.max(axis=(-2, -1)) - maps.min(axis=(-2, -1))
    ref = scale.max(axis=(-2, -1))
    constant = span <= view.rtol * ref
    reasons = np.where(zero_grad, "gradients are exactly zero at these tokens (the target does not depend on "
                                  "them: with CLS pooling, the last block's patch tokens never reach the output)",
                       np.where(constant, "the map is constant (after the ReLU nothing is left, or only "
                                          "rounding noise remains)", ""))
    bad = reasons != ""
    maps = np.where(bad[..., None, None], np.float32(0), maps)
    return _normalise(maps, recipe.normalize), reasons


def _rollout(view: _TraceView, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    # A rollout is a product over blocks in forward order, whatever order the recipe's tuple lists them in.
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
        grads = _combine(view.arrays["attn_grad"], weights, (layer_pos,)).astype(np.float64)
        for a, g in zip(attn, grads):
            R = R + _relu(g * a).mean(axis=0) @ R
    rows = _rows(view, R[None].astype(np.float32), recipe.attn_rows)[..., 0]
    return _to_grid(view, rows[..., view.patch])


def _compute(view: _TraceView, recipe: Recipe) -> tuple[np.ndarray, list[str], list[str]]:
    """One recipe to one map: (H, W), or the (gh, gw) grid with upsample 'none'; then why the map is
    degenerate (returned as zeros) and which fused layers were degenerate and left out."""
    layer_pos = view.layer_positions(recipe.layer)
    view.site_check(recipe.site)
    size = (view.height, view.width)
    if recipe.layer_fusion in ROLLOUTS:
        if "attn" not in view.arrays:
            raise RecipeError(f"layer_fusion: {recipe.layer_fusion!r} multiplies token-to-token attention across "
                              "blocks; this trace holds window attention (Swin), for which a rollout is not "
                              "applicable. Use layer_fusion 'mean', 'sum' or 'max'")
        if recipe.layer_fusion == "grad_rollout":
            view.target_weights(recipe)
        raw = _rollout(view, recipe, layer_pos)
        maps, reasons = _finish_layers(view, recipe, raw[None], np.abs(raw)[None], np.zeros(1, bool))
        out = upsample(maps[0], size, recipe.upsample)
        return _normalise(out, recipe.normalize), [r for r in reasons if r], []
    maps, reasons = _layer_maps(view, recipe, layer_pos)
    return _fuse_layers(maps, reasons, [int(view.layers[p]) for p in layer_pos], recipe)


def _layer_maps(view: _TraceView, recipe: Recipe, layer_pos: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer maps (ReLU, degeneracy, normalised, upsampled) before fusion, and why each is degenerate."""
    site_pos = None if recipe.site == "F2" else [view.sites.index(recipe.site)]
    raw, scale, zero_grad = _raw_maps(view, recipe, layer_pos, site_pos)
    if site_pos is not None:
        raw, scale, zero_grad = raw[:, 0], scale[:, 0], zero_grad[:, 0]
    maps, reasons = _finish_layers(view, recipe, raw, scale, zero_grad)
    return upsample(maps, (view.height, view.width), recipe.upsample), reasons


def _fuse_layers(maps: np.ndarray, reasons: np.ndarray, layer_ids: list[int], recipe: Recipe
                 ) -> tuple[np.ndarray, list[str], list[str]]:
    """Fuse per-layer maps; degenerate layers enter as zeros and are named, and a fusion that is all
    degenerate or constant is returned as zeros with the reasons."""
    fused = _fuse(maps, recipe.layer_fusion)
    notes = [f"layer {layer}: {r}" if len(layer_ids) > 1 else r for layer, r in zip(layer_ids, reasons) if r]
    if len(notes) < len(layer_ids) and np.ptp(fused) <= 0:
        notes.append("the fused map is constant")
    if notes and (len(notes) >= len(layer_ids) or np.ptp(fused) <= 0):
        return np.zeros_like(fused), notes, []
    return _normalise(fused, recipe.normalize), [], notes


def _fuse(maps: np.ndarray, how: str) -> np.ndarray:
    if how in ("none", "mean"):
        return maps.mean(axis=0)
    if how == "sum":
        return maps.sum(axis=0)
    return maps.max(axis=0)


def _dims(recipe: Recipe) -> tuple[str, str]:
    # Dimensions without coordinate indexes: building pandas indexes would cost more than the map itself.
    return ("patch_row", "patch_col") if recipe.upsample == "none" else ("y", "x")


_CHECKLISTS: dict[tuple, tuple[str, str]] = {}


def _report(trace: xr.Dataset, recipe: Recipe) -> tuple[str, str]:
    key = (recipe, trace.attrs.get("trace_id"), trace.attrs.get("num_prefix_tokens"))
    if key not in _CHECKLISTS:
        if len(_CHECKLISTS) > 4096:
            _CHECKLISTS.clear()
        _CHECKLISTS[key] = (build_checklist(recipe, trace).to_json(), describe(recipe, trace))
    return _CHECKLISTS[key]


def _warn(recipe: Recipe, notes: list[str]) -> str:
    reason = "; ".join(notes)
    warnings.warn(f"recipe {recipe.id} ({recipe.site}, layer {recipe.layer}, {recipe.weighting}) is degenerate "
                  f"and was returned as zeros: {reason}", DegenerateMapWarning, stacklevel=3)
    return reason


def cam(trace: xr.Dataset, recipe: Recipe | None = None, *, grid: bool = False, **fields: Any) -> xr.DataArray:
    """Compute the heatmap of ``recipe`` from ``trace`` — no model call.

    Returns a DataArray (y, x) at the input size (or (patch_row, patch_col) with ``upsample="none"`` or
    ``grid=True``) whose attrs hold the recipe JSON, recipe id, trace id, the checklist (JSON), a methods
    paragraph and ``degenerate`` (empty, or why the map was returned as zeros). Keyword fields build or
    modify the recipe: ``cam(tr, site="F4")``.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), np.zeros((224, 224, 3), np.uint8))
        >>> m = vc.cam(tr, vc.Recipe(site="F1", layer=-1))
        >>> m.dims, m.shape, m.attrs["recipe_id"]
        (('y', 'x'), (224, 224), '36db00aafece')
    """
    if isinstance(trace, xr.Dataset) and "image" in trace.dims:
        from vitcam_nb.many import cam_many

        return cam_many(trace, recipe, grid=grid, **fields)
    if recipe is None:
        recipe = Recipe.from_dict(fields)
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"recipe: expected a vitcam_nb.Recipe, got {type(recipe).__name__}")
    elif fields:
        recipe = recipe.replace(**fields)
    if not isinstance(grid, bool):
        raise TypeError(f"grid: expected True or False, got {grid!r}")
    if grid and recipe.upsample != "none":
        recipe = recipe.replace(upsample="none")
    if isinstance(trace, xr.DataTree):
        from vitcam_nb.stages import cam_stages

        return cam_stages(trace, recipe)
    if recipe.site == "xattn":
        from vitcam_nb.vlm.xattn import xattn_cam

        return xattn_cam(trace, recipe)
    view = _TraceView.of(trace)
    values, notes, partial = _compute(view, recipe)
    reason = _warn(recipe, notes) if notes else ""
    checklist, methods = _report(trace, recipe)
    return xr.DataArray(
        values.astype(np.float32, copy=False), dims=_dims(recipe), name="cam",
        attrs={"recipe": recipe.to_json(), "recipe_id": recipe.id, "trace_id": str(view.attrs.get("trace_id", "")),
               "checklist": checklist, "methods": methods, "degenerate": reason,
               "degenerate_layers": "; ".join(partial)},
    )


def _vary_values(view: _TraceView, base: Recipe, field: str, values: Any) -> list:
    if field not in Recipe.__dataclass_fields__:
        raise RecipeError(f"vary: unknown recipe field {field!r}; fields are {list(Recipe.__dataclass_fields__)}")
    if isinstance(values, str) and values == "all":
        if field == "layer":
            return [int(v) for v in view.layers]
        if field == "site":
            return list(view.sites)
        raise RecipeError(f"vary: 'all' is supported for layer and site only, not {field!r}")
    if isinstance(values, (str, int)) or not isinstance(values, Sequence) or len(values) == 0:
        raise RecipeError(f"vary: {field} needs a non-empty list of values or 'all', got {values!r}")
    return list(values)


def with_site(recipe: Recipe, site: str, has_cls: bool = True, **changes: Any) -> Recipe:
    """``recipe.replace(site=site, ...)`` keeping the F2 query-row choice valid: other sites take the default
    row rule, and F2 on a model without a CLS token reads the mean over query rows.

    Example:
        >>> with_site(Recipe(site="F2", attn_rows="mean"), "F3").attn_rows
        'cls'
    """
    rows = recipe.attn_rows if has_cls or recipe.attn_rows != "cls" else "mean"
    return recipe.replace(site=site, attn_rows=rows if site == "F2" else "cls", **changes)


def gallery(trace: xr.Dataset, recipe: Recipe | None = None,
            vary: Mapping[str, Any] | Sequence[str] = ("layer", "site")) -> xr.DataArray:
    """Many variants at once: the recipe with some fields varied, as one labeled DataArray.

    ``vary`` maps field names to value lists (or "all" for layer and site); a sequence of field names
    means "all" of each. Layers and token sites are computed together in one array expression; other
    fields loop over their values. Each map's recipe id and degeneracy are coordinates.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), np.zeros((224, 224, 3), np.uint8))
        >>> g = vc.gallery(tr, vc.Recipe(), vary={"layer": "all", "site": ["F1", "F4"]})
        >>> g.dims
        ('layer', 'site', 'y', 'x')
    """
    if isinstance(trace, xr.Dataset) and "image" in trace.dims:
        raise TraceError("trace: gallery() takes one image's trace; pick one with vc.image_trace(ds, i)")
    if isinstance(vary, str):
        vary = (vary,)
    if not isinstance(vary, Mapping):
        vary = {field: "all" for field in vary}
    ups = vary.get("upsample", ())
    if isinstance(ups, Sequence) and not isinstance(ups, str) and len({u == "none" for u in ups}) > 1:
        raise RecipeError("vary: upsample mixes 'none' (token grid) with an input-size upsampling, and a gallery "
                          "stacks maps of one size; make one gallery for 'none' and one for the others")
    varied_sites = vary.get("site", ())
    if isinstance(trace, xr.DataTree) or (recipe is not None and getattr(recipe, "site", "") == "xattn") \
            or (isinstance(varied_sites, Sequence) and "xattn" in varied_sites):
        from vitcam_nb.stages import gallery_loop

        return gallery_loop(trace, recipe, vary)
    base = recipe if recipe is not None else Recipe()
    if not isinstance(base, Recipe):
        raise TypeError(f"recipe: expected a vitcam_nb.Recipe, got {type(base).__name__}")
    view = _TraceView.of(trace)
    fields = list(vary)
    values = {f: _vary_values(view, base, f, vary[f]) for f in fields}
    if ("layer" in values or "site" in values) and base.layer_fusion in ROLLOUTS:
        raise RecipeError("vary: a rollout fuses all its layers at site F2; vary other fields instead")
    others = [f for f in fields if f not in ("layer", "site")]
    layers = values.get("layer", [base.layer])
    sites = values.get("site", [base.site])
    shape = [len(values[f]) for f in fields]
    dims_out = _dims(base)
    size = (view.height, view.width)
    out = np.zeros((*shape, *((view.gh, view.gw) if base.upsample == "none" else size)), np.float32)
    ids = np.empty(shape, object)
    reasons_out = np.full(shape, "", object)
    pos = {f: i for i, f in enumerate(fields)}
    notes_all = []
    for combo in itertools.product(*(range(len(values[f])) for f in others)):
        changes = {f: values[f][i] for f, i in zip(others, combo)}
        try:
            rec = base.replace(**changes)
            if "layer" in values or "site" in values:
                has_cls = bool(np.any(view.kinds == "cls"))
                probe = [with_site(rec, s, has_cls, layer=v) if "site" in values else rec.replace(layer=v)
                         for v in layers for s in sites]
        except RecipeError as exc:
            raise RecipeError(f"vary: the combination {changes} is not a valid recipe: {exc}") from exc
        if "layer" not in values and "site" not in values:
            maps, notes, _ = _compute(view, rec)
            block = maps[None, None]
            reasons = np.array([["; ".join(notes)]], object)
            recipes = [[rec]]
        else:
            block, reasons, recipes = _batch(view, rec, layers, sites, size, probe)
        for li, layer in enumerate(layers):
            for si, site in enumerate(sites):
                index = [0] * len(fields)
                for f, i in zip(others, combo):
                    index[pos[f]] = i
                if "layer" in pos:
                    index[pos["layer"]] = li
                if "site" in pos:
                    index[pos["site"]] = si
                out[tuple(index)] = block[li, si]
                ids[tuple(index)] = recipes[li][si].id
                reasons_out[tuple(index)] = reasons[li, si]
                if reasons[li, si]:
                    notes_all.append(f"{recipes[li][si].id} ({site}, layer {layer})")
    if notes_all:
        warnings.warn(f"{len(notes_all)} of {ids.size} gallery maps are degenerate and were returned as zeros: "
                      + ", ".join(notes_all[:8]) + (" ..." if len(notes_all) > 8 else ""),
                      DegenerateMapWarning, stacklevel=2)
    coords = {f: np.array(values[f], dtype=object if f in ("class_", "heads") else None) for f in fields}
    coords["recipe_id"] = (fields, ids.astype(str))
    coords["degenerate"] = (fields, reasons_out.astype(str))
    checklist, methods = _report(trace, base)
    return xr.DataArray(out, dims=(*fields, *dims_out), coords=coords, name="gallery",
                        attrs={"recipe": base.to_json(), "recipe_id": base.id, "vary": ",".join(fields),
                               "trace_id": str(view.attrs.get("trace_id", "")), "checklist": checklist,
                               "methods": methods})


def _batch(view: _TraceView, rec: Recipe, layers: list, sites: list, size: tuple[int, int],
           probe: list[Recipe]) -> tuple[np.ndarray, np.ndarray, list[list[Recipe]]]:
    """Maps for every (layer, site) pair of one recipe, token sites in one batched expression."""
    if rec.layer_fusion != "none" and len(layers) > 1:
        raise RecipeError("vary: varying layer needs layer_fusion='none' (each map is one layer)")
    layer_pos = [view.layer_positions(v)[0] for v in layers] if rec.layer_fusion == "none" else None
    for s in sites:
        view.site_check(s)
    recipes = [[probe[li * len(sites) + si] for si in range(len(sites))] for li in range(len(layers))]
    h, w = (view.gh, view.gw) if rec.upsample == "none" else size
    block = np.zeros((len(layers), len(sites), h, w), np.float32)
    reasons = np.full((len(layers), len(sites)), "", object)
    if layer_pos is None:  # one fused recipe per site
        for si in range(len(sites)):
            maps, notes, _ = _compute(view, recipes[0][si])
            block[0, si], reasons[0, si] = maps, "; ".join(notes)
        return block, reasons, recipes
    token_idx = [i for i, s in enumerate(sites) if s != "F2"]
    if token_idx:
        site_pos = [view.sites.index(sites[i]) for i in token_idx]
        if rec.heads != "channels" and any(sites[i] != "F3" for i in token_idx):
            raise RecipeError("vary: heads applies to F2/F3 only; vary sites with heads='channels'")
        by_site = {}
        for i, sp in zip(token_idx, site_pos):
            # F3 may group channels into heads; other token sites never do, so compute F3 on its own.
            by_site.setdefault(sites[i] == "F3", []).append((i, sp))
        for _is_f3, members in by_site.items():
            cols = [i for i, _ in members]
            raw, scale, zero = _raw_maps(view, rec, layer_pos, [sp for _, sp in members])
            maps, why = _finish_layers(view, rec, raw, scale, zero)
            block[:, cols] = _normalise(upsample(maps, size, rec.upsample), rec.normalize)
            reasons[:, cols] = why
    if "F2" in sites:
        si = sites.index("F2")
        raw, scale, zero = _raw_maps(view, recipes[0][si], layer_pos, None)
        maps, why = _finish_layers(view, rec, raw, scale, zero)
        block[:, si] = _normalise(upsample(maps, size, rec.upsample), rec.normalize)
        reasons[:, si] = why
    block[reasons != ""] = 0
    return block, reasons, recipes
