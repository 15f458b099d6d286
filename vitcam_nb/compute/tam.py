"""The token activation map (TAM; Li, Wang, Ding, Wang & Li, ICCV 2025) of a generative VLM's answer token, from
a trace's ``lm_logit`` site (:mod:`vitcam_nb.adapters.vlm_logit`) with no model call: the trace form ``tam`` and the
method weighting ``tam`` (the recipe is :func:`vitcam_nb.core.presets_tam.tam`; the formula is
:mod:`vitcam_nb.compute.tam_formula`).

The map is on the trace's image-token layout, then upsampled and normalised as the recipe says; over a multi-tile
layout the filter runs per tile and the map is one per tile group, (view, y, x), as the other LM-side sites give
it (:mod:`vitcam_nb.compute.tam_tiles`). TAM is not Transition Attention Maps (Yuan et al. 2021, the
``layer_fusion="transition"`` of :func:`vitcam_nb.presets.transition_attention_maps`), which shares its acronym.

Example:
    >>> import vitcam_nb as vc
    >>> TAM_FORM.accepts(None, vc.presets.tam()), TAM_FORM.accepts(None, vc.Recipe())
    (True, False)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.maps import warn_degenerate
from vitcam_nb.compute.report import build_checklist
from vitcam_nb.compute.spatial import normalise, upsample
from vitcam_nb.compute.tam_formula import FILTER_SIZE, rank_gaussian_filter, tam_scores
from vitcam_nb.compute.tam_tiles import SEAM_WORDS, filter_tiles
from vitcam_nb.compute.vlm_tiles import is_tiled, place, placed_map, stacked, trace_layout
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import ArgumentTypeError, RecipeError, TraceError
from vitcam_nb.core.kinds import TRACE_FORMS, MapValues, TraceForm
from vitcam_nb.core.presets_tam import TAM_CITATION, TAM_TITLE
from vitcam_nb.core.recipe import Recipe, is_int
from vitcam_nb.core.weighting import Weighting, register_weighting

__all__ = ["FORMULA", "TAM_FORM", "TamForm", "tam_grid", "tam_tokens"]

SITE = "lm_logit"
FORMULA = ("M_s = relu(logit lens of slot s's token at the image tokens); for answer token k: w_s = t_k[s] / "
           "(sum t_k + 1e-8) over the earlier context slots s with another token (t_k = relu(logit of token k at "
           "the slots)), I = sum_s w_s M_s, lambda = <M_k, I> / <I, I>, map = relu(M_k - lambda I), min-maxed "
           "jointly with t_k over the context slots, then the 3x3 rank Gaussian filter (sigma = std / mean of "
           "each window) (TAM, Li et al. 2025)")
_DIFFERENCES = (
    "read from one teacher-forced forward (the authors read generate's hidden states: the same logits up to "
    "float rounding); the prompt context is every text token after the image but the prompt's last (the "
    "authors cut the user's text out with model-specific special ids, leaving the chat template's other "
    "tokens out); every context slot's map is of its own token (the authors' code takes the greedy prediction "
    "for the first prompt token, and for the first answer token's slot the prompt's last token, an off-by-one "
    "in its round 0); repeated tokens are left out of the interference by token id (the authors compare "
    "re-tokenised strings); the least-squares scale in closed form (the authors' scipy minimize_scalar finds it "
    "to its tolerance); a constant positive window of the filter gives its value (the authors' code gives NaN); "
    "no uint8 quantisation (the authors' evaluation maps are floor(255 x map))")


def _check(trace: xr.Dataset, recipe: Recipe) -> int:
    """The recipe's answer token after every refusal, before any work."""
    if not isinstance(trace, xr.Dataset):
        raise ArgumentTypeError(f"trace: expected an xarray.Dataset from vitcam_nb.trace(), got {type(trace).__name__}")
    if not isinstance(recipe, Recipe):
        raise ArgumentTypeError(f"recipe: expected a vitcam_nb.Recipe, got {type(recipe).__name__}")
    if recipe.weighting != "tam":
        raise RecipeError(f"weighting: site {SITE!r} holds logits, not activations and gradients; it is read by "
                          f"weighting 'tam' (vc.presets.tam), got {recipe.weighting!r}")
    if "lm_logit" not in trace.variables or "lm_logit_text" not in trace.variables:
        raise RecipeError(f"site: {SITE!r} is not in this trace (model family "
                          f"{trace.attrs.get('model_family', '?')!r}); trace a generative VLM with "
                          f"targets=vc.targets.answer(...) and sites=[..., {SITE!r}]")
    if recipe.target != "logit":
        raise RecipeError(f"target: TAM activates the answer token's logit through the LM head; prob and logprob "
                          f"are not read, use target='logit', got {recipe.target!r}")
    if recipe.layer_fusion != "none" or recipe.layer not in (0, -1):
        raise RecipeError(f"layer: site {SITE!r} has one layer (the LM's last hidden state): layer=-1 (or 0) with "
                          f"layer_fusion='none', got layer={recipe.layer!r}, layer_fusion={recipe.layer_fusion!r}")
    labels = [str(s) for s in trace["answer_token_str"].values]
    if not is_int(recipe.class_) or not 0 <= int(recipe.class_) < len(labels):
        raise RecipeError(f"class_: TAM explains one answer token: an index in 0..{len(labels) - 1} of {labels}, "
                          f"got {recipe.class_!r} (the sequence score and ranked classes have no token)")
    return int(recipe.class_)


def _grid_shape(trace: xr.Dataset) -> tuple[np.ndarray, np.ndarray, int, int]:
    rows, cols = trace["image_token_row"].values, trace["image_token_col"].values
    gh, gw = int(rows.max()) + 1, int(cols.max()) + 1
    if rows.size != gh * gw or np.unique(rows * gw + cols).size != rows.size:
        raise TraceError(f"trace: its {rows.size} image tokens do not fill their {gh}x{gw} layout grid once each; "
                         "TAM's filter needs a full grid")
    return rows, cols, gh, gw


def _scores(trace: xr.Dataset, token: int) -> tuple[np.ndarray, dict[str, object]]:
    """Steps 1-3 over every image token (all tiles as one set), in the trace's image-token order."""
    n_prompt = int((trace["lm_slot_kind"].values == "prompt").sum())
    return tam_scores(trace["lm_logit"].values, trace["lm_logit_text"].values, trace["lm_slot_class"].values,
                      n_prompt, token)


def tam_tokens(trace: xr.Dataset, recipe: Recipe) -> tuple[np.ndarray, dict[str, object]]:
    """The TAM of the recipe's answer token per image token (trace order), filtered per tile of a multi-tile
    layout (:func:`~vitcam_nb.compute.tam_tiles.filter_tiles`; a one-tile layout is one tile), float64, and what
    the estimated causal inference did, with ``"tiles"``: the notes of tiles left unfiltered.

    Example:
        >>> import vitcam_nb as vc
        >>> tam_tokens(xr.Dataset(), vc.presets.tam())  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        vitcam_nb.core.errors.RecipeError: site: 'lm_logit' is not in this trace ...
    """
    token = _check(trace, recipe)
    lay = trace_layout(trace, SITE)
    scores, info = _scores(trace, token)
    values, notes = filter_tiles(lay, scores)
    return values, {**info, "tiles": notes}


def tam_grid(trace: xr.Dataset, recipe: Recipe) -> tuple[np.ndarray, dict[str, object]]:
    """The TAM of the recipe's answer token on the layout's grid (before upsampling), float64, and what the
    estimated causal inference did (:func:`vitcam_nb.compute.tam_formula.tam_scores`).

    Example:
        >>> import vitcam_nb as vc
        >>> tam_grid(xr.Dataset(), vc.presets.tam())  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        vitcam_nb.core.errors.RecipeError: site: 'lm_logit' is not in this trace ...
    """
    token = _check(trace, recipe)
    if is_tiled(trace):
        raise TraceError(f"trace: its image tokens cover {np.unique(trace['image_token_tile'].values).size} tiles, "
                         "one grid each: read the per-token map with tam_tokens, or the placed maps with vc.cam")
    rows, cols, gh, gw = _grid_shape(trace)
    scores, info = _scores(trace, token)
    grid = np.zeros((gh, gw), np.float64)
    grid[rows, cols] = scores
    return rank_gaussian_filter(grid, FILTER_SIZE), info


def _placed(trace: xr.Dataset, recipe: Recipe) -> tuple[np.ndarray, tuple[str, ...], dict, list[str]]:
    """A multi-tile trace's TAM: (maps with a leading view/tile dim, that dim, its coords, degeneracy notes)."""
    values, info = tam_tokens(trace, recipe)
    notes = []
    if info["constant"] or np.ptp(values) <= 0:
        notes.append("the map is constant (the token's image and context activations, after the estimated causal "
                     "inference, have no range)")
        values = np.zeros_like(values)
    else:  # one set over every tile before placement, as the other multi-tile LM maps are normalised
        values = normalise(values[None].astype(np.float32), recipe.normalize)[0]
    lay = trace_layout(trace, SITE)
    size = (int(trace.sizes.get("y", 1)), int(trace.sizes.get("x", 1)))
    names, maps = place(lay, values, size, recipe.upsample)
    out, dim, coords = stacked(names, maps, lay, recipe.upsample)
    if recipe.relu == "after":
        out = np.where(np.isnan(out), out, np.maximum(out, 0))  # a no-op on the non-negative map, NaN kept
    return out, dim, coords, notes


def _values(trace: xr.Dataset, recipe: Recipe) -> MapValues:
    if is_tiled(trace):
        _check(trace, recipe)
        out, _, _, notes = _placed(trace, recipe)
        return out, notes, []
    grid, info = tam_grid(trace, recipe)
    notes = []
    if info["constant"] or np.ptp(grid) <= 0:
        notes.append("the map is constant (the token's image and context activations, after the estimated causal "
                     "inference, have no range)")
        grid = np.zeros_like(grid)
    out = upsample(grid.astype(np.float32), (int(trace.sizes.get("y", grid.shape[0])),
                                             int(trace.sizes.get("x", grid.shape[1]))), recipe.upsample)
    if recipe.relu == "after":
        out = np.maximum(out, 0)  # the filtered map is >= 0 already: a no-op, kept for the recipe's word
    return (normalise(out, recipe.normalize) if not notes else out), notes, []


def _report(recipe: Recipe, trace: Any) -> tuple[Checklist, str]:
    """The checklist and methods paragraph (trace facts where a trace is given)."""
    out = build_checklist(recipe, None)
    token = f"answer token {recipe.class_}" if is_int(recipe.class_) else f"class_ {recipe.class_!r}"
    layout, lam, unfiltered = "the trace's image-token layout", "", ""
    tiled = isinstance(trace, xr.Dataset) and "image_token_tile" in trace.variables and is_tiled(trace)
    if isinstance(trace, xr.Dataset) and "lm_logit" in trace.variables:
        attrs = trace["lm_logit"].attrs
        layout = str(attrs.get("layout", layout))
        labels = [str(s) for s in trace["answer_token_str"].values]
        if is_int(recipe.class_) and 0 <= int(recipe.class_) < len(labels):
            token += f" ({labels[int(recipe.class_)]!r})"
            try:
                info = tam_tokens(trace, recipe)[1]
                lam = (f"; on this trace: lambda = {info['lambda']:.6g}, {info['weighed']} of {info['context']} "
                       f"context slots weighed, {info['repeats']} left out as repeats of the token")
                unfiltered = "; ".join(info["tiles"])
            except (RecipeError, TraceError):
                lam = ""
        hook, head = str(attrs.get("hook", "")), str(attrs.get("head", ""))
        cap = str(attrs.get("softcap", ""))
    else:
        hook, head, cap = "the LM's final norm (output)", "the LM head", ""
    fr = out["feature representation"]
    fr["site"] = f"{SITE} (the LM head's logits of the last hidden state: a logit lens)"
    fr["module"] = f"{hook}, projected by {head}" + (f"; {cap}" if cap else "")
    fr["input or output"] = "output of the LM's final norm, every sequence position, before the head"
    fr["layer"] = "the LM's last hidden state (one layer)"
    fr["what the map shows"] = (f"where the LM's last hidden state at the image tokens already scores {token}'s "
                                "token, less the part explained by the earlier context tokens' own maps")
    gt = out["gradient target"]
    gt["scalar"] = f"none differentiated: the raw logit of {token}'s token read through the LM head at each position"
    gt["derivation"] = "no gradient (activations only)"
    gt["scores"] = "the logits stored by the lm_logit site (lm_logit, lm_logit_text)"
    th = out["token handling"]
    th["prefix tokens present"] = "none at this site (image tokens and text slots only)"
    th["map over"] = f"the image tokens at their layout cells ({layout})"
    th["weight tokens"] = ("context slots: the prompt's text tokens after the image but its last, and the answer "
                           "tokens before this one (each at the position predicting it); repeats of the token's id "
                           "left out of the interference" + lam)
    ag = out["aggregation"]
    ag["weighting"] = f"tam: {FORMULA}"
    ag["heads"] = "none (logits of the whole hidden state)"
    ag["relu"] = "inside the formula (activations and the corrected map)" + (
        "; the recipe's ReLU after it is a no-op on the non-negative map" if recipe.relu == "after" else "")
    ag["layer fusion"] = "none: one layer"
    sr = out["spatial reconstruction"]
    sr["reshape"] = "the image-token layout's cells (row, col per image token)"
    sr["raster order"] = ("the layout's cells; the rank Gaussian filter (3x3, reflected borders) runs on that grid "
                          "after the joint min-max with the context's text scores")
    if tiled:
        sr["raster order"] = f"the layout's cells per tile; {SEAM_WORDS}" + (f" ({unfiltered})" if unfiltered else "")
    sr["normalisation"] = (f"{recipe.normalize} over every image token as one set before placing"
                           if tiled and recipe.normalize != "none" else
                           f"{recipe.normalize} after upsampling (the joint min-max of step 3 already maps to "
                           "[0, 1])" if recipe.normalize != "none" else
                           "none after upsampling: the joint min-max of image and context scores, then the filter "
                           "(values in [0, 1], the authors' map / 255)")
    out["recipe"]["method"] = f"this is {TAM_TITLE} ({TAM_CITATION}). Deliberate differences: {_DIFFERENCES}"
    methods = (f"Token activation map (TAM; {TAM_CITATION}) of {token} from the LM head's logits of the last "
               f"hidden state ({hook}): {FORMULA}; map over {layout}; upsampling {recipe.upsample}, "
               f"normalisation {recipe.normalize}{lam}. Differences from the authors' code: {_DIFFERENCES}.")
    return out, methods


def _refuse(*_args: Any, **_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    raise RecipeError("weighting: tam reads the logit lens of a generative VLM's answer trace (site 'lm_logit'), "
                      "not a site's activations and gradients")


register_weighting(Weighting("tam", FORMULA, _refuse, uses_gradient=False, title=TAM_TITLE, method=True),
                   replace=True)


class TamForm(TraceForm):
    """Recipes at site ``lm_logit`` (weighting ``tam``) on a single-image generative-VLM answer trace.

    Example:
        >>> import vitcam_nb as vc
        >>> TAM_FORM.layer_count(None)
        1
    """

    name = "tam"

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        return recipe is not None and recipe.site == SITE and (
            trace is None or (isinstance(trace, xr.Dataset) and "image" not in trace.dims))

    def layer_count(self, trace: Any) -> int:
        return 1

    def traced_layers(self, trace: Any) -> list[int]:
        return [0]

    def compute(self, trace: xr.Dataset, recipe: Recipe) -> MapValues:
        return _values(trace, recipe)

    def cam(self, trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
        """A DataArray (y, x) at the input size, or (patch_row, patch_col) on the layout's grid with
        ``upsample="none"``, with the recipe, ids, checklist, methods and degeneracy in its attrs; over a
        multi-tile layout (view, y, x), one map per tile group, or (tile, patch_row, patch_col)."""
        _check(trace, recipe)
        dim: tuple[str, ...] = ()
        coords: dict = {}
        if is_tiled(trace):
            values, dim, coords, notes = _placed(trace, recipe)
            partial: list[str] = []
        else:
            values, notes, partial = _values(trace, recipe)
        reason = warn_degenerate(recipe, notes) if notes else ""
        checklist, methods = _report(recipe, trace)
        return placed_map(values, dim, coords, recipe, trace, checklist.to_json(), methods, reason, partial)

    def gallery(self, trace: Any, recipe: Any, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
        raise RecipeError("vary: tam is a fixed published method; compute each answer token's map with vc.cam")

    def checklist(self, recipe: Recipe, trace: Any) -> Checklist:
        return _report(recipe, trace)[0]

    def describe(self, recipe: Recipe, trace: Any) -> str:
        return _report(recipe, trace)[1]


TAM_FORM = TamForm()
# Lookup priority: before flat (100), which would take a report-only recipe (no trace) of any site.
TRACE_FORMS.register(TAM_FORM.name, TAM_FORM, replace=True, priority=95)
