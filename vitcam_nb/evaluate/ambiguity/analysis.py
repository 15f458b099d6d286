"""How ambiguous is a reported Grad-CAM: every recipe consistent with a description, computed from one trace,
their spread, and how much of the map variance each unreported choice explains (first-order shares over the
factorial of the open fields, docs of :mod:`vitcam_nb.evaluate.ambiguity.space` and
:mod:`vitcam_nb.evaluate.ambiguity.sensitivity`).

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
    >>> amb = ambiguity(tr, reported=dict(site="F1", layer=0, weighting="gradcam"))
    >>> amb.maps.dims, amb.open
    (('recipe', 'y', 'x'), ['target', 'weight_tokens', 'upsample', 'relu', 'normalize'])
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.capture.budget import BUDGET_FRACTION, available_bytes
from vitcam_nb.compute.map_store import is_map_store
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, DegenerateMapWarning, RecipeError
from vitcam_nb.core.escape import escape_markdown
from vitcam_nb.core.recipe import NORMALIZES, RESHAPES, UPSAMPLES, Recipe
from vitcam_nb.core.recipe_space import check_space
from vitcam_nb.evaluate._common import as_mask
from vitcam_nb.evaluate.ambiguity.grid import distance_coords, image_maps, image_sample
from vitcam_nb.evaluate.ambiguity.many import ambiguity_many
from vitcam_nb.evaluate.ambiguity.plot import DEFAULT_CMAP, plot_ambiguity
from vitcam_nb.evaluate.ambiguity.sensitivity import bootstrap_effects, group_codes, main_effects
from vitcam_nb.evaluate.ambiguity.space import (
    CATEGORY_FIELDS,
    canonical,
    default_space,
    design_bytes,
    enumerate_cells,
    open_fields,
    parse_reported,
)
from vitcam_nb.evaluate.ambiguity.spread import Spread, localising_share, spread_of
from vitcam_nb.evaluate.ambiguity.stored import geometry, store_maps, store_space, trace_id
from vitcam_nb.evaluate.ambiguity.vlm_maps import absent_sites, is_special, special_maps
from vitcam_nb.evaluate.ambiguity.vlm_pointing import drawn_mask, special_mask
from vitcam_nb.evaluate.ambiguity.vlm_space import special_space, vlm_axes
from vitcam_nb.evaluate.recipe_maps import recipe_maps

__all__ = ["Ambiguity", "Sensitivity", "ambiguity"]

_FIELDS = [f.name for f in dataclasses.fields(Recipe)]
#: The spatial reconstruction fields with a closed set of values.
_CHOICES = {"reshape": RESHAPES, "upsample": UPSAMPLES, "normalize": NORMALIZES}


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    """Main-effect share of the map variance per open field and per checklist category, and the interaction
    remainders (``1 - sum`` of each). ``ci`` holds 95 % bootstrap intervals when the design was sampled.

    Example:
        >>> s = Sensitivity({"target": 0.7}, {"gradient target": 0.7}, 0.3, 0.3, "exact", None, 3)
        >>> round(sum(s.fields.values()) + s.interaction, 6)
        1.0
    """

    fields: dict[str, float]
    categories: dict[str, float]
    interaction: float
    category_interaction: float
    design: str
    ci: dict[str, tuple[float, float]] | None
    cells: int


@functools.lru_cache(maxsize=65536)
def _recipe(key: tuple) -> Recipe:
    return Recipe(**dict(zip(_FIELDS, key)))


class Ambiguity:
    """The answer of :func:`ambiguity` for one trace: ``recipes``, ``maps`` (recipe, y, x: on the image grid while
    upsample is open, else the token grid; ``maps.attrs["grid"]`` says which),
    ``spread``, ``sensitivity``, ``skipped`` (combinations no recipe expresses, or that the trace cannot compute),
    ``degenerate`` (maps returned as zeros), ``localises`` (share of recipes whose map points at ``mask``, or
    None; per tile group in ``localises_views`` on a per-group comparison, where ``localises`` counts a recipe
    pointing at it in every view), ``image`` and ``mask`` (shown beside the maps), and :meth:`plot`,
    :meth:`report`, :meth:`to_dict`.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
        >>> amb = ambiguity(tr, reported=dict(site="F1", layer=0, weighting="gradcam", weight_tokens="patch"))
        >>> len(amb.recipes), sorted(amb.sensitivity.fields)
        (24, ['normalize', 'relu', 'target', 'upsample'])
    """

    def __init__(self, *, reported: dict, space: dict, recipes: list[Recipe], maps: xr.DataArray, spread: Spread,
                 rho: np.ndarray, sensitivity: Sensitivity, skipped: int, degenerate: int,
                 localises: float | None, trace_id: str, image: np.ndarray | None = None,
                 mask: np.ndarray | None = None, localises_views: dict[str, float] | None = None) -> None:
        self.reported, self.space, self.recipes, self.maps = reported, space, recipes, maps
        self.spread, self.rho, self.sensitivity = spread, rho, sensitivity
        self.skipped, self.degenerate, self.localises, self.trace_id = skipped, degenerate, localises, trace_id
        self.image, self.mask = image, mask  # shown beside the maps by plot()
        self.localises_views = localises_views  # per tile group on a per-group comparison (vlm_pointing)

    @property
    def open(self) -> list[str]:
        """The fields the description leaves open over more than one value.

        Example:
            >>> import timm, numpy as np, vitcam_nb as vc
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
            >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
            >>> amb = vc.ambiguity(tr, reported=dict(site="F1", layer=0, weighting="gradcam"))
            >>> amb.open
            ['target', 'weight_tokens', 'upsample', 'relu', 'normalize']
        """
        return [f for f, v in self.space.items() if len(v) > 1]

    def most_different(self) -> tuple[int, int]:
        """Positions in ``recipes`` of the two consistent maps that agree least (lowest Spearman).

        Example:
            >>> import timm, numpy as np, vitcam_nb as vc
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
            >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
            >>> amb = vc.ambiguity(tr, reported=dict(site="F1", layer=0, weighting="gradcam"))
            >>> i, j = amb.most_different()
            >>> bool(amb.rho[i, j] == np.nanmin(amb.rho))
            True
        """
        rho = np.where(np.isfinite(self.rho), self.rho, np.inf)
        if not np.isfinite(rho).any() or len(self.recipes) < 2:
            return 0, min(1, len(self.recipes) - 1)
        i, j = np.unravel_index(np.argmin(rho), rho.shape)
        return int(i), int(j)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (what ``vitcam-nb ambiguity`` writes).

        Example:
            >>> import timm, numpy as np, vitcam_nb as vc
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
            >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
            >>> amb = vc.ambiguity(tr, reported=dict(site="F1", layer=0, weighting="gradcam"))
            >>> amb.to_dict()["recipes"]
            72
        """
        s = self.sensitivity
        return {"trace_id": self.trace_id, "reported": {k: _jsonable(v) for k, v in self.reported.items()},
                "open": {f: [_jsonable(v) for v in self.space[f]] for f in self.open},
                "recipes": len(self.recipes), "recipe_ids": [r.id for r in self.recipes], "skipped": self.skipped,
                "degenerate": self.degenerate, "median_spearman": self.spread.median_spearman,
                "share_pairs_below_0_5": self.spread.share_below_half, "pairs": self.spread.pairs,
                "sensitivity": {"fields": s.fields, "categories": s.categories, "interaction": s.interaction,
                                "category_interaction": s.category_interaction, "design": s.design,
                                "ci": s.ci, "cells": s.cells},
                "localises": self.localises, "localises_views": self.localises_views,
                "grid": self.maps.attrs.get("grid"),
                "stride": self.maps.attrs.get("stride")}

    def report(self) -> str:
        """A paragraph a reviewer can paste.

        Example:
            >>> import timm, numpy as np, vitcam_nb as vc
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
            >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
            >>> amb = vc.ambiguity(tr, reported=dict(site="F1", layer=0, weighting="gradcam"))
            >>> amb.report()[:60]
            'The description (site=F1, layer=0, weighting=gradcam) leaves'
        """
        s = self.sensitivity
        said = ", ".join(f"{k}={_jsonable(v)}" for k, v in self.reported.items()) or "nothing"
        sampled = "" if s.design.startswith("exact") else " sampled"
        text = (f"The description ({said}) leaves {len(self.open)} choice(s) open ({', '.join(self.open) or 'none'}), "
                f"allowing {len(self.recipes)} distinct recipes: {s.cells}{sampled} combinations of the open values "
                "name them, several combinations naming one recipe when a choice does not apply (such as heads at F1)")
        text += f" ({self.skipped} combinations no recipe expresses were skipped). " if self.skipped else ". "
        if np.isfinite(self.spread.median_spearman):
            text += (f"Consistent maps agree at median Spearman rho = {self.spread.median_spearman:.2f}; "
                     f"{self.spread.share_below_half:.0%} of the {self.spread.pairs} pairs of non-constant maps fall "
                     "below 0.5. ")
        if s.fields:
            top = max(s.fields, key=s.fields.get)
            cat = max(s.categories, key=s.categories.get)
            text += (f"The {top} choice explains {s.fields[top]:.0%} of the map variance and the {cat} category "
                     f"{s.categories[cat]:.0%} (first-order shares; interactions {s.interaction:.0%}; {s.design}). ")
        if self.localises is not None:
            text += f"{self.localises:.0%} of the consistent recipes give a map that points at the object" + (
                " in every view (" + ", ".join(f"{g} {v:.0%}" for g, v in self.localises_views.items()) + ")"
                if self.localises_views else "") + ". "
        if self.degenerate:
            text += (f"{self.degenerate} map(s) were degenerate (returned as zeros): they count as zeros in the mean "
                     "and spread maps and the variance shares, are left out of the Spearman pairs (a constant map has "
                     "no ranking)" + (", and count as misses in the share that points at the object. "
                                      if self.localises is not None else ". "))
        if self.maps.attrs.get("grid") == "image grid":
            stride = self.maps.attrs.get("stride", 1)
            sampled = f" (one pixel in {stride} along each axis)" if stride > 1 else ""
            text += (f"Maps were compared on the image grid{sampled}, where the upsampling shows (upsample 'none' "
                     "is the token grid drawn as blocks).")
        if self.maps.attrs.get("comparison"):  # a VLM answer trace: per tile group (vlm_maps)
            absent = json.loads(self.maps.attrs.get("absent_sites") or "{}")
            text += f" The {self.maps.attrs['comparison']}." + "".join(
                f" Site {s} skipped: {why}." for s, why in absent.items())
        return text.strip()

    def plot(self, cmap: str = DEFAULT_CMAP) -> Any:
        """The input image (object outlined), mean and spread maps, the two most different consistent maps, and
        the sensitivity bars (:func:`~vitcam_nb.evaluate.ambiguity.plot.plot_ambiguity`); returns the Figure.

        Example:
            >>> import timm, numpy as np, vitcam_nb as vc
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
            >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
            >>> amb = vc.ambiguity(tr, reported=dict(site="F1", layer=0, weighting="gradcam"))
            >>> len(amb.plot().axes)  # six panels and four colour bars
            10
        """
        return plot_ambiguity(self, cmap)

    def _repr_markdown_(self) -> str:
        return escape_markdown(self.report())


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _space(trace: xr.Dataset, fixed: dict, opened: list[str], space: Mapping[str, Sequence] | None) -> dict:
    space = dict(space or {})
    for field in space:
        if field not in _FIELDS:
            raise ArgumentError(f"space: unknown recipe field {field!r}; fields are {_FIELDS}")
        if field in fixed:
            raise ArgumentError(f"space: {field!r} is reported ({fixed[field]!r}), so it has no space; leave it out of "
                                "reported to open it")
        values = space[field]
        if isinstance(values, str) or not isinstance(values, Sequence) or not values:
            raise ArgumentError(f"space: {field} needs a non-empty list of values, got {values!r}")
        unknown = [v for v in values if field in _CHOICES and v not in _CHOICES[field]]
        if unknown:  # a value no recipe can take would only be skipped: refuse it instead
            raise ArgumentError(f"space: {field} takes {list(_CHOICES[field])}, got {unknown}")
    check_space(space, "space")  # a typo ("f4") is refused, not skipped as a combination no recipe expresses
    if is_map_store(trace):  # the store's recipes are the space
        return {**store_space(trace, fixed, open_fields(fixed)), **{f: tuple(v) for f, v in space.items()}}
    if is_special(trace):  # a VLM answer trace compared per tile group (vlm_maps): absent layers only skipped
        return special_space(trace, open_fields(fixed), space)
    view = TraceView.of(trace)
    traced, n = [int(v) for v in view.layers], int(view.num_layers)
    absent = [v for v in space.get("layer", ()) if isinstance(v, (int, np.integer)) and not isinstance(v, bool)
              and not (-n <= v < n and int(v) % n in traced)]
    if absent:  # a block the trace lacks would only be skipped: refused by name before any map
        raise ArgumentError(f"space: layer {absent[0]!r} is not a block of this trace (it holds blocks {traced} of "
                            f"a {n}-block model; negative values count from the end)")
    out = {}
    # The cross-attention site is no vision site (its layers are the text layers): it only opens text_tokens.
    xattn = [*view.sites, "xattn"] if "xattn" in trace.variables else view.sites
    # An answer trace of a generative VLM opens its LM sites and layers and its answer tokens (vlm_space).
    vlm = vlm_axes(trace, view.sites, traced, (view.gh, view.gw))
    for field in open_fields(fixed):
        sites = xattn if field == "text_tokens" else view.sites
        values = space.get(field, vlm[field] if field in vlm else default_space(field, sites, traced))
        out[field] = tuple(values)
    return out


def _mask(trace: xr.Dataset, mask: Any) -> np.ndarray | None:
    """The object mask (given, else the store's), refused unless it is a non-empty mask of the traced image."""
    if mask is None:
        return np.asarray(trace["mask"].values, bool) if "mask" in trace.variables else None
    shape, got = geometry(trace)[:2], np.shape(mask)
    if len(got) == 2 and got != shape:
        raise ArgumentError(f"mask: shape {got} is not the traced image's {shape}; give the object's pixels at the "
                            "image size the trace holds (the maps are upsampled to it)")
    return as_mask(mask, shape)


def _check_memory(trace: xr.Dataset, values: dict, mask: np.ndarray | None, max_cells: int, max_recipes: int,
                  n_samples: int, n_boot: int) -> None:
    """Refuse, before anything is allocated, a design whose peak exceeds the memory budget."""
    sizes = {f: len(v) for f, v in values.items() if len(v) > 1}
    attrs = trace.attrs
    pixels = int(attrs.get("grid_h", 0)) * int(attrs.get("grid_w", 0)) or trace.sizes["y"] * trace.sizes["x"]
    need = design_bytes(sizes, max_cells, max_recipes, n_samples, n_boot, pixels, 0 if mask is None else mask.size)
    free = available_bytes()
    if free is not None and need > BUDGET_FRACTION * free:
        raise ArgumentError(f"n_samples, max_cells: the analysis of {len(sizes)} open field(s) would hold about "
                            f"{need / 1e9:.2f} GB, over the budget ({BUDGET_FRACTION:.0%} of the {free / 1e9:.1f} GB "
                            f"available); lower n_samples ({n_samples}), max_cells ({max_cells}), n_boot ({n_boot}) "
                            "or narrow space=")


def _one(trace: xr.Dataset, reported: Mapping[str, Any] | None, space: Mapping[str, Sequence] | None,
         mask: Any, max_cells: int, max_recipes: int, n_samples: int, seed: int, n_boot: int) -> Ambiguity:
    special = is_special(trace)
    if (not isinstance(trace, xr.Dataset) or "image" in trace.dims
            or (not is_map_store(trace) and not special and TraceView.of(trace).sites == [])):
        raise ArgumentTypeError("trace: expected a single-image trace Dataset of a plain ViT (vitcam_nb.trace)")
    fixed, opened = parse_reported(reported)
    values = _space(trace, fixed, opened, space)
    mask = (None if mask is None else special_mask(trace, mask)) if special else _mask(trace, mask)
    _check_memory(trace, values, mask, max_cells, max_recipes, n_samples, n_boot)
    factors = all_factors = [f for f, v in values.items() if len(v) > 1]
    single = {f: v[0] for f, v in values.items() if len(v) == 1}
    # Open upsample: maps compared on the image grid; else on the token grid, where upsampling adds nothing.
    image_grid = "upsample" in factors or special
    grid = {**fixed, **single} if image_grid else {**fixed, **single, "upsample": "none"}
    cells, design = enumerate_cells({f: values[f] for f in factors}, max_cells, n_samples, seed)
    keys: dict[tuple, int] = {}
    cell_recipe = np.empty(len(cells), np.int64)
    memo: dict[tuple, int] = {}
    for c, codes in enumerate(map(tuple, cells)):
        if codes not in memo:
            key = canonical({**grid, **{f: values[f][k] for f, k in zip(factors, codes)}}, keep=list(fixed))
            memo[codes] = -1 if key is None else keys.setdefault(key, len(keys))
        cell_recipe[c] = memo[codes]
    if len(keys) > max_recipes and design.startswith("exact"):
        return _one(trace, reported, space, mask, 0, max_recipes, n_samples, seed, n_boot)
    # A field that no consistent recipe lets vary (heads when the site is F1) is not a choice the reader has.
    factors = [f for f in factors if len({key[_FIELDS.index(f)] for key in keys}) > 1]
    maps, recipes, ok, degenerate = [], [], np.zeros(len(keys), bool), 0
    candidates = [_recipe(key) for key in keys]
    height, width = geometry(trace)[:2]
    stride, cut = image_sample(height, width) if image_grid else (1, (slice(None), slice(None)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateMapWarning)
        if is_map_store(trace):  # read, not computed: a requested recipe the store lacks is refused
            computed = store_maps(trace, candidates, cut if image_grid else None, requested=bool(space))
        elif special:  # each map on the image per tile group, the groups all maps have stacked (vlm_maps)
            computed, compared, pointing = special_maps(trace, candidates, cut, mask)
        elif image_grid:  # full-resolution maps cut to the compared pixels a batch at a time: bounded memory
            computed = [m for i in range(0, len(candidates), 1024)
                        for m in image_maps(trace, candidates[i:i + 1024], cut)]
        else:
            computed = recipe_maps(trace, candidates)
    for k, (rec, result) in enumerate(zip(candidates, computed)):
        if result is None:
            continue
        ok[k] = True
        degenerate += bool(result[1])
        maps.append(np.asarray(result[0], np.float32))
        recipes.append(rec)
    if len(recipes) < 1:
        raise RecipeError(f"reported: no recipe on this trace is consistent with {dict(reported or {})!r}")
    position = np.cumsum(ok) - 1
    valid = (cell_recipe >= 0) & ok[np.maximum(cell_recipe, 0)]
    stack = np.stack(maps)
    y = (distance_coords(stack) if image_grid else stack)[position[cell_recipe[valid]]]
    codes = {f: cells[valid, all_factors.index(f)] for f in factors}
    shares = main_effects(y, codes)
    groups = {cat: [f for f in fields if f in factors] for cat, fields in CATEGORY_FIELDS.items()}
    cat_codes = {cat: group_codes(codes, fs) for cat, fs in groups.items() if fs}
    cat_shares = {cat: (main_effects(y, {cat: cat_codes[cat]})[cat] if cat in cat_codes else 0.0) for cat in groups}
    ci = None
    if not design.startswith("exact"):
        ci = bootstrap_effects(y, {**codes, **cat_codes}, n_boot, seed)
    sens = Sensitivity(shares, cat_shares, 1.0 - sum(shares.values()), 1.0 - sum(cat_shares.values()), design,
                       ci, int(valid.sum()))
    dims = ("y", "x")
    spread, rho = spread_of(stack, dims)
    coords = {"recipe": [r.id for r in recipes]}
    for f in factors:
        coords[f] = ("recipe", np.array([getattr(r, f) for r in recipes], dtype=object))
    arr = xr.DataArray(stack, dims=("recipe", *dims), coords=coords, name="ambiguity_maps",
                       attrs={"trace_id": trace_id(trace),
                              "grid": "image grid" if image_grid else "token grid", "stride": stride,
                              "reported": json.dumps({k: _jsonable(v) for k, v in fixed.items()})})
    if special:
        arr.attrs.update(comparison=compared, absent_sites=json.dumps(absent_sites(trace, values.get("site", ()))))
    if mask is not None and not special:  # on a sampled image grid the pointing game reads the mask there too
        sampled = mask[cut] if image_grid and mask.shape == (height, width) else mask
    localises = None if mask is None else pointing[0] if special else localising_share(stack, sampled)
    skipped = int((~valid).sum())
    kept = {f: v for f, v in values.items() if f in factors or len(v) == 1}
    return Ambiguity(reported=fixed, space=kept, recipes=recipes, maps=arr, spread=spread, rho=rho,
                     sensitivity=sens, skipped=skipped, degenerate=degenerate, localises=localises,
                     trace_id=trace_id(trace),
                     localises_views=pointing[1] if special and mask is not None else None,
                     image=None if is_map_store(trace) or "image" not in trace.variables or "crop" in trace.dims
                     else trace["image"].values,
                     mask=None if mask is None else drawn_mask(mask, (height, width), cut, len(pointing[1]))
                     if special else np.asarray(mask, bool))


def ambiguity(trace: Any, reported: Mapping[str, Any] | None = None, *, space: Mapping[str, Sequence] | None = None,
              mask: Any = None, max_cells: int = 50_000, max_recipes: int = 2_000, n_samples: int = 1_024,
              seed: int = 0, n_boot: int = 200) -> Any:
    """Every recipe consistent with a description, their maps and spread, and the first-order share of the map
    variance each open field and checklist category explains.

    ``reported``: recipe field -> the value the description states; a field or a checklist category given the
    value ``"open"`` is open, as is every field not named. Open fields range over the documented default space
    (:mod:`vitcam_nb.evaluate.ambiguity.space`), overridden per field by ``space`` (every value given is used).
    While ``upsample`` is open the maps are compared at the image resolution (``"none"`` as blocks, the same
    picture as ``"nearest"`` on an integer patch grid; an image over 64 x 64 px on its pixels at a stride,
    ``maps.attrs["stride"]``: :func:`~vitcam_nb.evaluate.ambiguity.grid.image_sample`), else on the token grid.
    The factorial of the open values is
    exact when it has at most ``max_cells`` combinations and ``max_recipes`` distinct recipes, else ``n_samples``
    combinations are drawn (``seed``) and each share gets a 95 % bootstrap interval (``n_boot`` resamples).
    Sampled shares are biased upward by about ``(L - 1) / (n_samples - 1)`` of the unexplained variance for a
    factor of ``L`` levels (more for categories, whose levels are joint), the remainder downward; the bootstrap
    intervals do not correct this (:mod:`vitcam_nb.evaluate.ambiguity.sensitivity`).
    ``mask``: the object's pixels, to count the recipes whose map points at it (a store's masks are used).
    A generative VLM's answer trace opens the sites, layers and answer tokens it holds (TAM where it holds
    ``lm_logit``); one with crops, several tiles, another grid or no tower site is compared on the image per tile
    group (:mod:`~vitcam_nb.evaluate.ambiguity.vlm_maps`; a ``mask`` there is the object on the original image,
    scored per view: :mod:`~vitcam_nb.evaluate.ambiguity.vlm_pointing`).

    ``trace`` may also be one image of a map store (``vc.image_maps``; the analysis over the recipes the store
    holds, :mod:`~vitcam_nb.evaluate.ambiguity.stored`), or a list of traces, an ``open_traces`` store or an
    ``open_maps`` store: then the answer is an
    :class:`~vitcam_nb.evaluate.ambiguity.many.AmbiguityMany` (one analysis per image; over a store, one dask task
    per image, run on the active dask.distributed Client if there is one).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
        >>> amb = vc.ambiguity(tr, reported=dict(site="F1", layer=-1))
        >>> s = amb.sensitivity
        >>> round(sum(s.fields.values()) + s.interaction, 6)
        1.0
    """
    for name, value in (("max_cells", max_cells), ("max_recipes", max_recipes), ("n_samples", n_samples),
                        ("n_boot", n_boot)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArgumentError(f"{name}: expected a positive int, got {value!r}")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ArgumentError(f"seed: expected an int >= 0 (numpy's default_rng seed), got {seed!r:.80}")
    if reported is not None and not isinstance(reported, Mapping):
        raise ArgumentTypeError(f"reported: expected a dict of recipe fields (or checklist categories), got "
                                f"{type(reported).__name__}")
    if space is not None and not isinstance(space, Mapping):
        raise ArgumentTypeError(f"space: expected a dict of recipe field -> list of values, got {type(space).__name__}")
    args = (reported, space, mask, max_cells, max_recipes, n_samples, seed, n_boot)
    if isinstance(trace, xr.Dataset) and "image" not in trace.dims:
        return _one(trace, *args)
    return ambiguity_many(trace, _one, *args)
