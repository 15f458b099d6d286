"""The generative-VLM trace kind (sites ``projector``, ``lm_resid``, ``lm_attn``): maps of an answer token over
the image tokens a decoder-only language model reads, computed from the trace with no model call.

The image tokens are the positions; their cells come from the trace's image-token layout (``image_token_row``,
``image_token_col``, written by :class:`vitcam_nb.adapters.hf_vlm.HfVlmAdapter`), so the map is on the layout's
grid, not on an assumed raster. A multi-tile layout (tiles and a global view, a base view and crops) is computed
over all image tokens as one set and placed tile by tile on the image, one map per tile group
(:mod:`~vitcam_nb.compute.vlm_tiles`). ``projector`` and ``lm_resid`` are (token, channel) sites like F1: every
weighting applies (Grad-CAM: ``weighting="gradcam"``). ``lm_attn`` is the LM's attention from the query row that
predicts the recipe's answer token (``class_`` an answer-token index; the mean over all answer rows for the
sequence score or a ranked class) to the image keys, heads as the channels, as site ``xattn`` treats BLIP's
cross-attention. ``layer`` indexes the LM's decoder layers (``projector`` has one).

Example:
    >>> import vitcam_nb as vc
    >>> VLM.accepts(xr.Dataset(), vc.Recipe(site="lm_resid")), VLM.accepts(xr.Dataset(), vc.Recipe())
    (True, False)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.fusion import fuse_layers
from vitcam_nb.compute.maps import warn_degenerate
from vitcam_nb.compute.pipeline import combine, compact, finish_layers, grid_maps, weight_mask
from vitcam_nb.compute.report import build_checklist, describe, map_words
from vitcam_nb.compute.spatial import upsample
from vitcam_nb.compute.view import TraceView
from vitcam_nb.compute.vlm_gallery import answer_gallery
from vitcam_nb.compute.vlm_tiles import is_tiled, place, placed_map, stacked, trace_layout
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import ArgumentTypeError, RecipeError, TraceError
from vitcam_nb.core.kinds import TRACE_KINDS, MapValues, TraceKind
from vitcam_nb.core.recipe import ROLLOUTS, Recipe, is_int
from vitcam_nb.core.schema import SITE_MEANINGS

__all__ = ["VLM", "VLM_SITES", "VlmKind"]

VLM_SITES = ("projector", "lm_resid", "lm_attn")
_WHAT = {"projector": "the projector's output per image token (the embeddings the LM reads at the image positions)",
         "lm_resid": "the LM decoder layer's input residual stream at the image-token positions",
         "lm_attn": "the LM's attention probabilities (after softmax and dropout) from the query row predicting the "
                    "answer token to the image-token keys; heads are the channels k, image tokens the positions t"}


def _n_layers(trace: xr.Dataset, site: str) -> int:
    return 1 if site == "projector" else int(trace.sizes["lm_layer"])


def _view(trace: xr.Dataset, site: str) -> TraceView:
    """A :class:`TraceView` over the image tokens on the layout's one tile, so the pipeline's steps apply; over
    a multi-tile layout, all image tokens as one row (weights, ReLU and normalisation see them as one set, as the
    LM reads them), placed on the image afterwards (:mod:`~vitcam_nb.compute.vlm_tiles`)."""
    rows, cols = trace["image_token_row"].values, trace["image_token_col"].values
    n = int(trace.sizes["image_token"])
    if is_tiled(trace):
        rows, cols = np.zeros(n, np.int64), np.arange(n)
    gh, gw = int(rows.max()) + 1, int(cols.max()) + 1
    arrays = {k: trace.variables[k].values for k in ("logits", "target_class")}
    dtype = trace.variables[f"{site}_grad"].dtype
    return TraceView(
        attrs=dict(trace.attrs), arrays=arrays, layers=np.arange(_n_layers(trace, site)), sites=[site],
        kinds=np.array(["patch"] * n), patch=np.arange(n), flat=rows * gw + cols, gh=gh, gw=gw,
        height=int(trace.sizes.get("y", gh)), width=int(trace.sizes.get("x", gw)),
        num_layers=_n_layers(trace, site), rtol=1e-2 if dtype == np.float16 else 1e-5, signature=(),
    )


def _layers(layer: Any, n: int, site: str) -> list[int]:
    """Positions of the recipe's LM layers (ints, negative from the end, a tuple or "all")."""
    if layer == "all":
        return list(range(n))
    out = []
    for v in layer if isinstance(layer, tuple) else (layer,):
        if not is_int(v) or not -n <= v < n:
            raise RecipeError(f"layer: site {site!r} has {n} layer(s) (allowed -{n}..{n - 1}), got {v!r}")
        if v % n in out:
            raise RecipeError(f"layer: {layer!r} names layer {v % n} twice; list each layer once")
        out.append(v % n)
    return out


def _answer_rows(trace: xr.Dataset, recipe: Recipe) -> tuple[np.ndarray, str]:
    """The lm_attn query rows: the row predicting answer token ``class_`` (``"topK"``: the answer token ranked K-th
    by logit, the one whose gradient the map weighs), else every answer row (mean: the sequence score)."""
    labels = [str(s) for s in trace["answer_token_str"].values]
    n = len(labels)
    cls = recipe.class_
    if isinstance(cls, str) and cls.startswith("top") and 1 <= int(cls[3:]) <= n:
        logits = np.asarray(trace["logits"].values, dtype=np.float64).ravel()[:n]
        cls = int(np.argsort(-logits, kind="stable")[int(cls[3:]) - 1])
    if is_int(cls) and 0 <= int(cls) < n:
        k = int(cls)
        return np.array([k]), f"the row predicting answer token {k} ({labels[k]!r})"
    return np.arange(n), f"mean over the {n} rows predicting the answer tokens {labels}"


def _check(trace: xr.Dataset, recipe: Recipe) -> None:
    if not isinstance(trace, xr.Dataset):
        raise ArgumentTypeError(f"trace: expected an xarray.Dataset from vitcam_nb.trace(), got {type(trace).__name__}")
    if not isinstance(recipe, Recipe):
        raise ArgumentTypeError(f"recipe: expected a vitcam_nb.Recipe, got {type(recipe).__name__}")
    if recipe.site not in VLM_SITES:
        raise RecipeError(f"site: the vlm kind computes sites {list(VLM_SITES)}, got {recipe.site!r}")
    if recipe.site not in trace.variables or f"{recipe.site}_grad" not in trace.variables:
        family = trace.attrs.get("model_family", "?")
        raise RecipeError(f"site: {recipe.site!r} is not in this trace (model family {family!r}); trace a generative "
                          f"VLM with targets=vc.targets.answer(...) and sites including {recipe.site!r}")
    if recipe.layer_fusion in ROLLOUTS:
        raise RecipeError(f"layer_fusion: {recipe.layer_fusion!r} multiplies self-attention matrices; site "
                          f"{recipe.site!r} fuses layers with 'mean', 'sum' or 'max'")


def _layer_maps(trace: xr.Dataset, recipe: Recipe) -> tuple[TraceView, list[int], np.ndarray, np.ndarray, np.ndarray]:
    """The recipe's per-layer maps on the layout's grid (after ReLU, degeneracy check and per-layer normalisation,
    before upsampling and fusion): the view, the LM layers, the maps, their reasons and per-layer scales. Shared by
    :func:`_values` and the map store of answers (:mod:`vitcam_nb.compute.map_vlm_maps`), which stores these."""
    _check(trace, recipe)
    site = recipe.site
    view = _view(trace, site)
    weights = view.target_weights(recipe)[0]
    layers = _layers(recipe.layer, view.num_layers, site)
    act, grad = trace[site].values, trace[f"{site}_grad"].values
    if site == "projector":
        act, grad = act[None], grad[:, None]  # one "layer"
    if site == "lm_attn":
        rows, _ = _answer_rows(trace, recipe)
        A = act[layers][..., rows, :].astype(np.float32, copy=False).mean(axis=-2)  # (L, H, K)
        G = combine(grad, weights, (layers,))[..., rows, :].mean(axis=-2)
        # (L, K, H): heads are the channels; contiguous, so the sums run in one order whatever the stored arrays'
        # alignment (a loaded trace then gives the bitwise same map)
        A, G = np.ascontiguousarray(np.swapaxes(A, -1, -2)), np.ascontiguousarray(np.swapaxes(G, -1, -2))
        groups = A.shape[-1]
    else:
        A = act[layers].astype(np.float32, copy=False)
        G = combine(grad, weights, (layers,))
        groups = 1
    wmask = compact(weight_mask(view, recipe))
    patch = compact(view.patch)
    maps, scale, zero_grad = grid_maps(view, recipe, A, G, wmask, patch, groups)
    per_layer, reasons = finish_layers(view, recipe, maps, scale, zero_grad)
    return view, layers, per_layer, reasons, scale


def _values(trace: xr.Dataset, recipe: Recipe) -> MapValues:
    site = recipe.site
    view, layers, per_layer, reasons, _ = _layer_maps(trace, recipe)
    if is_tiled(trace):  # one value per image token, placed by the layout after the fusion
        return fuse_layers(per_layer, reasons, layers, recipe, label=f"{site} layer")
    per_layer = upsample(per_layer, (view.height, view.width), recipe.upsample, view.pad)
    return fuse_layers(per_layer, reasons, layers, recipe, label=f"{site} layer")


def _placed(trace: xr.Dataset, recipe: Recipe) -> tuple[np.ndarray, tuple[str, ...], dict, list[str], list[str]]:
    """A multi-tile trace's map: (values with a leading view/tile dim, that dim, its coords, notes, partial)."""
    fused, notes, partial = _values(trace, recipe)
    lay = trace_layout(trace, recipe.site)
    size = (int(trace.sizes.get("y", 1)), int(trace.sizes.get("x", 1)))
    names, maps = place(lay, fused[0], size, recipe.upsample)
    values, dim, coords = stacked(names, maps, lay, recipe.upsample)
    return values, dim, coords, notes, partial


def _map_words(recipe: Recipe) -> str:
    """:func:`map_words` of the kit site this one is computed as (F1: a token site; xattn: attention rows over
    image keys, heads as channels), with this site's meaning in its place."""
    proxy = "xattn" if recipe.site == "lm_attn" else "F1"
    text = map_words(recipe.replace(site=proxy))
    text = text.replace(f"the {SITE_MEANINGS[proxy]} ({proxy})", f"{_WHAT[recipe.site]} ({recipe.site})")
    return text.replace("patch token", "image token").replace("the text tokens pay", "the answer rows pay")


def _report(trace: xr.Dataset, recipe: Recipe) -> tuple[Checklist, str]:
    """The checklist and methods of a VLM-site recipe: the module, the LM layers, the layout, the answer rows."""
    site = recipe.site
    view = _view(trace, site)
    layers = _layers(recipe.layer, view.num_layers, site)
    var_attrs = trace[site].attrs
    attrs = {**trace.attrs, f"hook_{site}": str(var_attrs.get("hook", "")), "num_layers": view.num_layers,
             "num_prefix_tokens": 0}
    shim = xr.Dataset(coords={"token_kind": ("token", view.kinds)}, attrs=attrs)
    checklist = build_checklist(recipe, shim)
    fr, th = checklist["feature representation"], checklist["token handling"]
    fr["site"] = f"{site} ({_WHAT[site]})"
    if site == "projector":
        fr["layer"] = "the projector (one layer)"
    else:
        fr["layer"] = (f"LM decoder layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))} of "
                       f"0..{view.num_layers - 1}" + (" (the last)" if layers == [view.num_layers - 1] else ""))
    fr["what the map shows"] = _map_words(recipe)
    th["image tokens"] = str(var_attrs.get("layout", "")) + (
        f"; dropped: {var_attrs['layout_dropped']}" if var_attrs.get("layout_dropped") else "")
    th["map over"] = "the image tokens at their layout cells (text tokens are not stored at this site)"
    if is_tiled(trace):
        groups = list(dict.fromkeys(t.group_name for t in trace_layout(trace, site).tiles))
        th["map over"] = (
            f"all {view.gw} image tokens of the {np.unique(trace['image_token_tile'].values).size} tiles as one set "
            "(weights, ReLU, normalisation and layer fusion over them together, as the LM reads them), then each "
            f"tile's cells placed in its box on the image: one map per tile group ({', '.join(groups)}), groups "
            + ("never averaged" if recipe.upsample != "none" else "never averaged; upsample='none': per-tile grids"))
    if site == "lm_attn":
        th["answer rows"] = _answer_rows(trace, recipe)[1]
    # the paragraph from this checklist (its site, layer and map words), not one rebuilt from the shim, whose map
    # words would call lm_resid an attention site
    methods = describe(recipe, shim, checklist=checklist)
    methods += f" Image-token layout: {th['image tokens']}."
    return checklist, methods


class VlmKind(TraceKind):
    """Recipes with a generative VLM's LM-side site on a single-image answer trace.

    Example:
        >>> import vitcam_nb as vc
        >>> VLM.accepts(xr.Dataset(), vc.Recipe(site="lm_attn"))
        True
    """

    name = "vlm"

    def layer_count(self, trace: Any) -> int:
        """LM sites index the LM's decoder layers; ``projector`` has one."""
        return 1 if "lm_layer" not in trace.sizes else int(trace.sizes["lm_layer"])

    def traced_layers(self, trace: Any) -> list[int]:
        return list(range(self.layer_count(trace)))

    def resolve(self, trace: Any, recipe: Any) -> Any:
        n = _n_layers(trace, recipe.site)
        layers = _layers(recipe.layer, n, recipe.site)
        return recipe.replace(layer=tuple(layers) if isinstance(recipe.layer, tuple) or recipe.layer == "all"
                              else layers[0])

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        return isinstance(trace, xr.Dataset) and "image" not in trace.dims and recipe is not None \
            and recipe.site in VLM_SITES

    def compute(self, trace: xr.Dataset, recipe: Recipe) -> MapValues:
        _check(trace, recipe)
        if is_tiled(trace):
            values, _, _, notes, partial = _placed(trace, recipe)
            return values, notes, partial
        return _values(trace, recipe)

    def cam(self, trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
        """A DataArray (y, x) at the input size, or (patch_row, patch_col) on the layout's grid with
        ``upsample="none"``, with the recipe, ids, checklist, methods and degeneracy in its attrs; over a
        multi-tile layout (view, y, x), one map per tile group, or (tile, patch_row, patch_col)."""
        _check(trace, recipe)
        if is_tiled(trace):
            values, dim, coords, notes, partial = _placed(trace, recipe)
        else:
            (values, notes, partial), dim, coords = _values(trace, recipe), (), {}
        reason = warn_degenerate(recipe, notes) if notes else ""
        checklist, methods = _report(trace, recipe)
        return placed_map(values, dim, coords, recipe, trace, checklist.to_json(), methods, reason, partial)

    def gallery(self, trace: xr.Dataset, recipe: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
        return answer_gallery(trace, recipe, vary)  # each cell vc.cam's map, its view dim kept

    def checklist(self, recipe: Recipe, trace: xr.Dataset) -> Checklist:
        return self._describable(recipe, trace)[0]

    def describe(self, recipe: Recipe, trace: xr.Dataset) -> str:
        return self._describable(recipe, trace)[1]

    @staticmethod
    def _describable(recipe: Recipe, trace: xr.Dataset) -> tuple[Checklist, str]:
        try:
            _check(trace, recipe)
            return _report(trace, recipe)
        except (RecipeError, TraceError):
            return build_checklist(recipe, trace), describe(recipe, trace)


VLM = VlmKind()
# Lookup priority: after flat.
TRACE_KINDS.register(VLM.name, VLM, replace=True, priority=130)

# For the map store of answers (compute.map_vlm_maps), which computes these maps' per-layer steps as _values does.
lm_layer_positions, layer_maps, trace_view_of = _layers, _layer_maps, _view
