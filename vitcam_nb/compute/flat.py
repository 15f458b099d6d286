"""The flat trace kind: a single-image trace Dataset of a plain ViT-like model (one token grid). Recipes are
computed from its view through the per-layer pipeline and layer fusion; a gallery that varies layers and
token sites computes them together in one array expression.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> img = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), img, targets="top1")
    >>> values, notes, partial = FLAT.compute(tr, vc.Recipe(site="F1", layer=0, upsample="none"))
    >>> values.shape, notes
    ((14, 14), [])
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.fusion import fuse_layers, rollout
from vitcam_nb.compute.galleries import gallery_array, loop_gallery, normalise_vary, vary_values, with_site
from vitcam_nb.compute.maps import cause_counts, map_array, warn_degenerate
from vitcam_nb.compute.pipeline import finish_layers, layer_maps, raw_maps
from vitcam_nb.compute.report import build_checklist, describe
from vitcam_nb.compute.report_cache import cached_report
from vitcam_nb.compute.spatial import normalise, upsample, upsample_into
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import DegenerateMapWarning, RecipeError, user_stacklevel
from vitcam_nb.core.kinds import TRACE_KINDS, MapValues, TraceKind
from vitcam_nb.core.recipe import ROLLOUTS, Recipe
from vitcam_nb.core.schema import ATTENTION_SITE, EXTRA_SITES

__all__ = ["FLAT", "FlatKind"]


def _values(view: TraceView, recipe: Recipe) -> MapValues:
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
        raw = rollout(view, recipe, layer_pos)
        maps, reasons = finish_layers(view, recipe, raw[None], np.abs(raw)[None], np.zeros(1, bool))
        out = upsample(maps[0], size, recipe.upsample, view.pad)
        return normalise(out, recipe.normalize), [r for r in reasons if r], []
    maps, reasons = layer_maps(view, recipe, layer_pos)
    return fuse_layers(maps, reasons, [int(view.layers[p]) for p in layer_pos], recipe)


@functools.lru_cache(maxsize=256)
def _recipe_grid(rec: Recipe, layers: tuple, sites: tuple, has_cls: bool, vary_site: bool
                 ) -> tuple[tuple[tuple[Recipe, ...], ...], np.ndarray]:
    """The (layer, site) recipes of a gallery and their ids. Recipes are immutable, so a widget or a notebook
    asking for the same gallery again skips validating and hashing them."""
    recipes = tuple(tuple(with_site(rec, s, has_cls, layer=v) if vary_site else rec.replace(layer=v) for s in sites)
                    for v in layers)
    ids = np.array([[r.id for r in row] for row in recipes], object)
    ids.flags.writeable = False
    return recipes, ids


def _layer_site_block(view: TraceView, rec: Recipe, layers: list, sites: list, size: tuple[int, int],
                      recipes: tuple[tuple[Recipe, ...], ...], block: np.ndarray) -> np.ndarray:
    """Maps for every (layer, site) pair of one recipe, token sites in one batched expression, written into
    ``block`` (layer, site, h, w); returns why each map is degenerate ("" if it is not)."""
    if rec.layer_fusion != "none" and len(layers) > 1:
        raise RecipeError("vary: varying layer needs layer_fusion='none' (each map is one layer)")
    for s in sites:
        view.site_check(s)
    reasons = np.full((len(layers), len(sites)), "", object)
    if rec.layer_fusion != "none":  # one fused recipe per site
        for si in range(len(sites)):
            maps, notes, _ = _values(view, recipes[0][si])
            block[0, si], reasons[0, si] = maps, "; ".join(notes)
        return reasons
    layer_pos = [view.layer_positions(v)[0] for v in layers]
    token_idx = [i for i, s in enumerate(sites) if s != ATTENTION_SITE]
    if token_idx:
        if rec.heads != "channels" and any(sites[i] != "F3" for i in token_idx):
            raise RecipeError("vary: heads applies to F2/F3 only; vary sites with heads='channels'")
        by_site: dict[bool, list[tuple[int, int]]] = {}
        for i in token_idx:
            # A head rule groups F3's channels into heads, other token sites never: F3 then goes on its own.
            by_site.setdefault(sites[i] == "F3" and rec.heads != "channels", []).append((i, view.sites.index(sites[i])))
        for members in by_site.values():
            cols = [i for i, _ in members]
            raw, scale, zero = raw_maps(view, rec, layer_pos, [sp for _, sp in members])
            maps, why = finish_layers(view, rec, raw, scale, zero)
            # One site's maps (a few MB at 224 px) per call: the normalisation's passes then stay in cache.
            for k, col in enumerate(cols):
                upsample_into(block[:, col], maps[:, k], rec.upsample, rec.normalize, view.pad)
            reasons[:, cols] = why
    if ATTENTION_SITE in sites:
        si = sites.index(ATTENTION_SITE)
        raw, scale, zero = raw_maps(view, recipes[0][si], layer_pos, None)
        maps, why = finish_layers(view, rec, raw, scale, zero)
        upsample_into(block[:, si], maps, rec.upsample, rec.normalize, view.pad)
        reasons[:, si] = why
    block[reasons != ""] = 0
    return reasons


class FlatKind(TraceKind):
    """Single-image traces with one token grid (and reports without a trace).

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
        >>> FLAT.accepts(tr, vc.Recipe()), FLAT.accepts(tr, vc.Recipe(site="xattn")), FLAT.accepts(None, None)
        (True, False, True)
    """

    name = "flat"

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        if trace is None:
            return True
        return isinstance(trace, xr.Dataset) and "image" not in trace.dims and \
            (recipe is None or recipe.site not in EXTRA_SITES)

    def compute(self, trace: xr.Dataset, recipe: Recipe) -> MapValues:
        return _values(TraceView.of(trace), recipe)

    def cam(self, trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
        view = TraceView.of(trace)
        values, notes, partial = _values(view, recipe)
        reason = warn_degenerate(recipe, notes) if notes else ""
        checklist, methods = cached_report(recipe, trace)
        # The recipe id hashes the recipe as written (layer=-1 and layer=5 differ); the blocks say what was used.
        blocks = ",".join(str(int(view.layers[p])) for p in view.layer_positions(recipe.layer))
        return map_array(values, recipe, str(view.attrs.get("trace_id", "")), checklist, methods, reason, partial,
                         blocks=blocks, blocks_of=str(view.num_layers))

    def gallery(self, trace: xr.Dataset, recipe: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
        vary = normalise_vary(vary)
        view = TraceView.of(trace)
        has_cls = bool(np.any(view.kinds == "cls"))
        varied_sites = vary.get("site", ())
        if not isinstance(varied_sites, str) and any(s in EXTRA_SITES for s in varied_sites):
            every_site = view.sites + [s for s in EXTRA_SITES if s in trace.variables]
            values = {f: vary_values(f, v, {"layer": [int(x) for x in view.layers], "site": every_site})
                      for f, v in vary.items()}
            checklist, methods = cached_report(recipe, trace)
            return loop_gallery(trace, recipe, values, has_cls=has_cls, checklist=checklist, methods=methods,
                                common=(view.gh, view.gw) if recipe.upsample == "none" else (view.height, view.width))
        return self._batched(trace, view, recipe, vary, has_cls)

    def _batched(self, trace: xr.Dataset, view: TraceView, base: Recipe, vary: dict, has_cls: bool) -> xr.DataArray:
        fields = list(vary)
        values = {f: vary_values(f, vary[f], {"layer": [int(v) for v in view.layers], "site": list(view.sites)})
                  for f in fields}
        if ("layer" in values or "site" in values) and base.layer_fusion in ROLLOUTS:
            raise RecipeError("vary: a rollout fuses all its layers at site F2; vary other fields instead")
        others = [f for f in fields if f not in ("layer", "site")]
        layers = values.get("layer", [base.layer])
        sites = values.get("site", [base.site])
        shape = [len(values[f]) for f in fields]
        size = (view.height, view.width)
        # Every cell is written below (degenerate ones as zeros), so the output need not be cleared first.
        out = np.empty((*shape, *((view.gh, view.gw) if base.upsample == "none" else size)), np.float32)
        ids = np.empty(shape, object)
        reasons_out = np.full(shape, "", object)
        pos = {f: i for i, f in enumerate(fields)}
        notes_all = []
        for combo in itertools.product(*(range(len(values[f])) for f in others)):
            changes = {f: values[f][i] for f, i in zip(others, combo)}
            try:
                rec = base.replace(**changes) if changes else base
                recipes, rec_ids = _recipe_grid(rec, tuple(layers), tuple(sites), has_cls, "site" in values)
            except RecipeError as exc:
                raise RecipeError(f"vary: the combination {changes} is not a valid recipe: {exc}") from exc
            index = [slice(None)] * len(fields)
            for f, i in zip(others, combo):
                index[pos[f]] = i
            # This combination's maps are written straight into the output, as a (layer, site, h, w) view.
            block = out[tuple(index)]
            if "layer" not in pos:
                block = block[None]
            if "site" not in pos:
                block = block[:, None]
            elif "layer" in pos and pos["site"] < pos["layer"]:
                block = block.swapaxes(0, 1)
            if "layer" not in values and "site" not in values:
                maps, notes, _ = _values(view, rec)
                block[0, 0] = maps
                reasons = np.array([["; ".join(notes)]], object)
            else:
                reasons = _layer_site_block(view, rec, layers, sites, size, recipes, block)
            swap = "layer" in pos and "site" in pos and pos["site"] < pos["layer"]
            where = np.shape(ids[tuple(index)])
            ids[tuple(index)] = (rec_ids.T if swap else rec_ids).reshape(where)
            reasons_out[tuple(index)] = (reasons.T if swap else reasons).reshape(where)
            for li, si in zip(*np.nonzero(reasons != "")):
                notes_all.append(f"{rec_ids[li, si]} ({sites[si]}, layer {layers[li]})")
        if notes_all:
            warnings.warn(f"{cause_counts(reasons_out.ravel())}: {len(notes_all)} of {ids.size} gallery maps are "
                          "degenerate and were returned as zeros: "
                          + ", ".join(notes_all[:8]) + (" ..." if len(notes_all) > 8 else ""),
                          DegenerateMapWarning, stacklevel=user_stacklevel())
        checklist, methods = cached_report(base, trace)
        return gallery_array(out, values, ids, reasons_out, base, str(view.attrs.get("trace_id", "")), checklist,
                             methods, object_fields=("class_", "heads"))

    def checklist(self, recipe: Recipe, trace: Any) -> Checklist:
        return build_checklist(recipe, trace)

    def describe(self, recipe: Recipe, trace: Any) -> str:
        return describe(recipe, trace)


FLAT = FlatKind()
# Lookup priority: after the method forms: it accepts every single-image Dataset.
TRACE_KINDS.register(FLAT.name, FLAT, replace=True, priority=100)
