"""The cross-attention trace kind (site ``xattn``): heatmaps from text-token queries attending to image keys, as
in the ALBEF/BLIP Grad-CAM (Li et al. 2021, 2022), computed from a vision-language trace with no model call.

For the selected text rows, the attention A[h, t] and its gradient G[h, t] over image keys t are treated like
site F2's: heads are the channels k, image key tokens the positions t. The recipe's weighting, head rule,
target (logit, prob, logprob), ReLU, normalisation, upsampling and layer fusion (mean, sum, max) then apply
exactly as in :func:`vitcam_nb.cam`. The ALBEF/BLIP map is ``weighting="layercam", heads="mean_then_relu"``:
mean over heads of relu(G) * A.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.fusion import fuse_layers
from vitcam_nb.compute.galleries import loop_gallery, normalise_vary, vary_values
from vitcam_nb.compute.maps import map_array, warn_degenerate
from vitcam_nb.compute.pipeline import combine, compact, finish_layers, grid_maps, weight_mask
from vitcam_nb.compute.report import build_checklist, describe
from vitcam_nb.compute.spatial import upsample
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import ArgumentTypeError, RecipeError, TraceError
from vitcam_nb.core.kinds import TRACE_KINDS, MapValues, TraceKind
from vitcam_nb.core.recipe import ROLLOUTS, Recipe, is_int

__all__ = ["XATTN", "CrossAttentionKind", "text_rows"]

XATTN_HOOK = "text_encoder.encoder.layer.{layer}.crossattention.self.dropout:output"
_ZERO_ROWS = ("gradients are exactly zero at these cross-attention rows (the target does not depend on them: at "
              "the last text layer only the first text token's row reaches the ITM head; use an earlier layer "
              "or text_tokens='cls')")
_PREFIXES = ("##", "Ġ", "▁")


def _view(trace: xr.Dataset) -> TraceView:
    """A :class:`~vitcam_nb.compute.view.TraceView` over the cross-attention's image keys, so the pipeline's
    steps (target weights, weight tokens, grid, ReLU and degeneracy) apply unchanged."""
    kinds = trace["key_kind"].values
    patch = np.flatnonzero(kinds == "patch")
    gh, gw = int(trace.attrs["grid_h"]), int(trace.attrs["grid_w"])
    rows, cols = trace["key_patch_row"].values[patch], trace["key_patch_col"].values[patch]
    n_layers = int(trace.sizes["xattn_layer"])
    arrays = {k: trace.variables[k].values for k in ("logits", "target_class")}
    dtype = trace.variables["xattn_grad"].dtype
    return TraceView(
        attrs=dict(trace.attrs), arrays=arrays, layers=trace["xattn_layer"].values, sites=["xattn"], kinds=kinds,
        patch=patch, flat=rows * gw + cols, gh=gh, gw=gw, height=int(trace.sizes.get("y", gh)),
        width=int(trace.sizes.get("x", gw)), num_layers=n_layers, rtol=1e-2 if dtype == np.float16 else 1e-5,
        signature=(),
    )


def _layers(layer: Any, n: int) -> list[int]:
    """Positions of the recipe's cross-attention layers (ints, negative from the end, a tuple or "all")."""
    if layer == "all":
        return list(range(n))
    wanted = layer if isinstance(layer, tuple) else (layer,)
    out = []
    for v in wanted:
        if not is_int(v):
            raise RecipeError(f"layer: site 'xattn' indexes cross-attention layers with ints, got {v!r}")
        if not -n <= v < n:
            raise RecipeError(f"layer: {v} is out of range for {n} cross-attention layers (allowed -{n}..{n - 1})")
        if v % n in out:
            raise RecipeError(f"layer: {wanted!r} names cross-attention layer {v % n} twice; list each layer once")
        out.append(v % n)
    return out


def _norm_token(s: str) -> str:
    s = s.strip()
    for p in _PREFIXES:
        if s.startswith(p):
            s = s[len(p):]
    return s.lower()


def text_rows(trace: xr.Dataset, text_tokens: str | int) -> tuple[np.ndarray, str]:
    """Text-token positions selected by a recipe's ``text_tokens`` and a description naming them.

    "all": every unmasked text token; "cls": position 0; an int: that position; a word: every token whose
    text equals it (case-insensitive, ignoring WordPiece "##" and BPE/SentencePiece word markers).

    Example:
        >>> rows, text = text_rows(tr, "cls")  # doctest: +SKIP
        >>> rows, text  # doctest: +SKIP
        (array([0]), "the first text token (position 0, '[CLS]'), which the ITM head reads")
    """
    strings = [str(s) for s in trace["text_token_str"].values]
    mask = trace["text_token_mask"].values.astype(bool)
    n = len(strings)

    def named(rows: np.ndarray) -> str:
        return ", ".join(f"{int(i)} ({strings[i]!r}{'' if mask[i] else ', masked'})" for i in rows)

    if text_tokens == "all":
        rows = np.flatnonzero(mask)
        return rows, f"mean over the {rows.size} unmasked text tokens at positions {named(rows)}"
    if text_tokens == "cls":
        return np.array([0]), f"the first text token (position 0, {strings[0]!r}), which the ITM head reads"
    if is_int(text_tokens):
        if not 0 <= text_tokens < n:
            raise RecipeError(f"text_tokens: position {text_tokens} is out of range; the text has {n} tokens "
                              f"(0..{n - 1}): {strings}")
        return np.array([int(text_tokens)]), f"position {named(np.array([int(text_tokens)]))}"
    word = _norm_token(str(text_tokens))
    rows = np.array([i for i, s in enumerate(strings) if _norm_token(s) == word], dtype=np.int64)
    if rows.size == 0:
        raise RecipeError(f"text_tokens: no text token equals {text_tokens!r}; the tokens are {strings} "
                          "(give one of them, a position, 'cls' or 'all')")
    what = "the token" if rows.size == 1 else f"the mean over the {rows.size} tokens"
    return rows, f"{what} equal to {text_tokens!r} at position(s) {named(rows)}"


def _shim(trace: xr.Dataset, view: TraceView) -> xr.Dataset:
    """A tiny stand-in trace whose attrs describe the cross-attention (hook, its layer count, key prefix), so
    the shared checklist and methods paragraph name the right module and layers."""
    n_prefix = int(np.sum(view.kinds != "patch"))
    attrs = {**trace.attrs, "hook_xattn": str(trace["xattn"].attrs.get("hook", XATTN_HOOK)),
             "num_layers": view.num_layers, "num_prefix_tokens": n_prefix}
    return xr.Dataset(coords={"token_kind": ("token", view.kinds)}, attrs=attrs)


def _report(trace: xr.Dataset, recipe: Recipe) -> tuple[Checklist, str]:
    """The checklist and methods of an xattn recipe: the module, the cross-attention layers and text rows."""
    view = _view(trace)
    layers = _layers(recipe.layer, view.num_layers)
    rows_text = text_rows(trace, recipe.text_tokens)[1]
    n_heads = int(trace["xattn"].shape[1])
    shim = _shim(trace, view)
    checklist = build_checklist(recipe, shim)
    fr, th, ag = (checklist[k] for k in ("feature representation", "token handling", "aggregation"))
    site, layer = fr["site"], fr["layer"]  # as describe() words them, to be replaced in its paragraph
    fr["site"] = ("xattn (cross-attention probabilities of text queries over image keys, after softmax and "
                  "dropout; heads are the channels k, image key tokens the positions t)")
    label = "layer" if len(layers) == 1 else "layers"
    fr["layer"] = (f"text-encoder cross-attention {label} {', '.join(map(str, layers))} of 0..{view.num_layers - 1}"
                   + (" (the last)" if layers == [view.num_layers - 1] else ""))
    th["text tokens"] = rows_text + ("; rows averaged before the weighting (as F2's attn_rows='mean')"
                                     if "mean" in rows_text else "")
    th["map over"] = "patch keys only (the image CLS key has no grid position and is dropped from the map)"
    ag["heads"] = f"{n_heads} cross-attention heads; {ag['heads']}"
    if "model and input" in checklist:
        checklist["model and input"]["attention backend"] = (
            "explicit softmax attention (BLIP's own implementation, eager attention forced for the trace)")
    methods = describe(recipe, shim).replace(f"{site} at {layer}", f"{fr['site']} at {fr['layer']}", 1)
    methods += (f" Cross-attention rows: {rows_text}; image keys are the vision tokens fed to the text encoder, "
                "the CLS key dropped.")
    return checklist, methods


def _check(trace: xr.Dataset, recipe: Recipe) -> None:
    if not isinstance(trace, xr.Dataset):
        raise ArgumentTypeError(f"trace: expected an xarray.Dataset from vitcam_nb.trace(), got {type(trace).__name__}")
    if not isinstance(recipe, Recipe):
        raise ArgumentTypeError(f"recipe: expected a vitcam_nb.Recipe, got {type(recipe).__name__}")
    if recipe.site != "xattn":
        raise RecipeError(f"site: the xattn kind computes site 'xattn' only, got {recipe.site!r}")
    if "xattn" not in trace.variables or "xattn_grad" not in trace.variables:
        family = trace.attrs.get("model_family", "?")
        raise RecipeError(f"site: 'xattn' needs cross-attention, but this trace has no cross-attention (model "
                          f"family {family!r}); trace a vision-language model with cross-attention, e.g. BLIP "
                          "image-text matching with targets=vc.targets.itm(...), and sites including 'xattn'")
    if recipe.layer_fusion in ROLLOUTS:
        raise RecipeError(f"layer_fusion: {recipe.layer_fusion!r} multiplies self-attention matrices; site "
                          "'xattn' fuses layers with 'mean', 'sum' or 'max'")
    if any(k not in trace.variables for k in ("key_kind", "text_token_str", "text_token_mask")):
        raise TraceError("trace: the xattn variables lack their key/text coordinates; it does not follow the "
                         "vitcam_nb schema")


def _values(trace: xr.Dataset, recipe: Recipe) -> MapValues:
    """The map of an xattn recipe: the selected text rows' attention over image keys, heads as channels."""
    _check(trace, recipe)
    view = _view(trace)
    weights = view.target_weights(recipe)[0]
    layers = _layers(recipe.layer, view.num_layers)
    rows, _ = text_rows(trace, recipe.text_tokens)

    xattn, xgrad = trace["xattn"], trace["xattn_grad"]
    A = xattn.values[layers][..., rows, :].astype(np.float32, copy=False).mean(axis=-2)  # (L, H, K)
    G = combine(xgrad.values, weights, (layers,))[..., rows, :].mean(axis=-2)
    A, G = np.swapaxes(A, -1, -2), np.swapaxes(G, -1, -2)  # (L, K, H): heads are the channels
    n_heads = A.shape[-1]
    wmask = compact(weight_mask(view, recipe))
    patch = compact(view.patch)
    maps, scale, zero_grad = grid_maps(view, recipe, A, G, wmask, patch, n_heads)
    per_layer, reasons = finish_layers(view, recipe, maps, scale, zero_grad)
    reasons = np.where(zero_grad, _ZERO_ROWS, reasons)
    per_layer = upsample(per_layer, (view.height, view.width), recipe.upsample, view.pad)
    return fuse_layers(per_layer, reasons, layers, recipe, label="cross-attention layer")


class CrossAttentionKind(TraceKind):
    """Recipes with ``site="xattn"`` on a single-image vision-language trace.

    Example:
        >>> import vitcam_nb as vc
        >>> XATTN.accepts(xr.Dataset(), vc.Recipe(site="xattn")), XATTN.accepts(xr.Dataset(), vc.Recipe())
        (True, False)
    """

    name = "xattn"

    def layer_count(self, trace: Any) -> int:
        """Site ``xattn`` indexes the cross-attention layers, not the vision blocks."""
        return int(trace.sizes["xattn_layer"])

    def traced_layers(self, trace: Any) -> list[int]:
        """``"all"`` names every cross-attention layer (the trace's ``layer`` coordinate is the vision blocks')."""
        return list(range(self.layer_count(trace)))

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        return isinstance(trace, xr.Dataset) and "image" not in trace.dims and recipe is not None \
            and recipe.site == "xattn"

    def compute(self, trace: xr.Dataset, recipe: Recipe) -> MapValues:
        return _values(trace, recipe)

    def cam(self, trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
        """Same output contract as the flat kind: a DataArray (y, x) at the input size, or (patch_row, patch_col)
        with ``upsample="none"``, whose attrs hold the recipe, ids, checklist, methods and degeneracy."""
        values, notes, partial = _values(trace, recipe)
        reason = warn_degenerate(recipe, notes) if notes else ""
        checklist, methods = _report(trace, recipe)
        return map_array(values, recipe, str(trace.attrs.get("trace_id", "")), checklist.to_json(), methods, reason,
                         partial)

    def gallery(self, trace: xr.Dataset, recipe: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
        vary = normalise_vary(vary)
        sites = (TraceView.of(trace).sites if "act" in trace or "attn" in trace else []) + ["xattn"]
        values = {f: vary_values(f, v, {"layer": [int(x) for x in trace["xattn_layer"].values], "site": sites})
                  for f, v in vary.items()}
        gh, gw = int(trace.attrs["grid_h"]), int(trace.attrs["grid_w"])
        common = (gh, gw) if recipe.upsample == "none" else (trace.sizes["y"], trace.sizes["x"])
        checklist, methods = _report(trace, recipe)
        has_cls = "cls" in [str(k) for k in trace["key_kind"].values]
        return loop_gallery(trace, recipe, values, has_cls=has_cls, common=common, checklist=checklist.to_json(),
                            methods=methods)

    def checklist(self, recipe: Recipe, trace: xr.Dataset) -> Checklist:
        return self._describable(recipe, trace)[0]

    def describe(self, recipe: Recipe, trace: xr.Dataset) -> str:
        return self._describable(recipe, trace)[1]

    @staticmethod
    def _describable(recipe: Recipe, trace: xr.Dataset) -> tuple[Checklist, str]:
        # A recipe this trace cannot compute (no cross-attention, an unknown word) is still described, generically.
        try:
            _check(trace, recipe)
            return _report(trace, recipe)
        except (RecipeError, TraceError):
            return build_checklist(recipe, trace), describe(recipe, trace)


XATTN = CrossAttentionKind()
# Lookup priority: after flat.
TRACE_KINDS.register(XATTN.name, XATTN, replace=True, priority=140)
