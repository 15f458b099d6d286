"""What a :func:`vitcam_nb.map_many` call computes: its recipes (a list, preset names, recipe lines or a space of
field values), what the pass must capture for them, and per batch the pass and each image's token-grid maps from
its trace.

Example:
    >>> [r.site for r in as_recipes(["F1@0", "gradcam"])]
    ['F1', 'F1']
    >>> len(as_recipes({"site": ["F1", "F4"], "layer": [0, 1]}))
    4
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xarray as xr

from vitcam_nb.adapters.hf_vlm import LM_SITES
from vitcam_nb.capture.assemble import assemble
from vitcam_nb.capture.crops import assemble_crops
from vitcam_nb.capture.passes import run_pass
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.store_targets import IMAGE_TARGET_ATTRS
from vitcam_nb.compute.fusion import rollout
from vitcam_nb.compute.map_store import replay
from vitcam_nb.compute.map_table import blocks as _blocks
from vitcam_nb.compute.map_vlm_maps import (
    ANSWER_TARGET_ATTRS,
    crop_facts,
    lm_facts,
    lm_grid,
    lm_reports,
    vlm_grid_parts,
)
from vitcam_nb.compute.map_writer import batch_arrays
from vitcam_nb.compute.pipeline import finish_layers, raw_maps
from vitcam_nb.compute.video import stacked_frames
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.errors import ArgumentTypeError, RecipeError, TraceError
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.presets import PRESETS
from vitcam_nb.core.presets import get as preset
from vitcam_nb.core.recipe import INTEGRATED_ROLLOUTS, ROLLOUTS, Recipe
from vitcam_nb.core.recipe_space import check_space
from vitcam_nb.core.schema import ATTENTION_SITE, EXTRA_SITES, PER_IMAGE_ATTRS
from vitcam_nb.core.weighting import WEIGHTINGS
from vitcam_nb.preprocess import PreparedInput
from vitcam_nb.targets.detection import Detection
from vitcam_nb.targets.vlm_answer import AnswerTarget

__all__ = ["Entry", "as_recipes", "compute_batch", "empty_image", "grid_parts", "image_maps_of", "plan_entries",
           "store_entry"]


def _one(item: Any, i: int) -> Recipe:
    if isinstance(item, Recipe):
        return item
    if isinstance(item, str):
        return preset(item) if item in PRESETS else Recipe.parse(item)
    raise ArgumentTypeError(f"recipes_or_space: item {i} is a {type(item).__name__}; expected a Recipe, a preset name "
                            f"or a recipe line (Recipe.to_string)")


def as_recipes(recipes_or_space: Any) -> list[Recipe]:
    """The distinct recipes of a list (Recipes, preset names, recipe lines) or of a space ``{field: values}``
    (every combination of the listed values, other fields at their defaults; combinations that are no recipe
    are skipped), in order.

    Example:
        >>> [r.layer for r in as_recipes({"layer": [0, 1], "heads": ["channels"]})]
        [0, 1]
    """
    if isinstance(recipes_or_space, Mapping):
        check_space(recipes_or_space, "recipes_or_space")  # a typo is refused, not skipped as a combination
        fields = {f: (list(v) if isinstance(v, (list, tuple)) else [v]) for f, v in recipes_or_space.items()}
        recipes = []
        for combo in itertools.product(*fields.values()):
            try:
                recipes.append(Recipe(**dict(zip(fields, combo))))
            except RecipeError:
                continue
            except TypeError as exc:
                raise RecipeError(f"recipes_or_space: {exc}") from exc
        if not recipes:
            raise RecipeError(f"recipes_or_space: no combination of {fields} is a valid recipe")
    elif isinstance(recipes_or_space, (Recipe, str)) or not isinstance(recipes_or_space, Sequence):
        raise ArgumentTypeError(f"recipes_or_space: expected a list of Recipes, preset names or recipe lines, or a "
                                f"space {{field: [values]}}, got {type(recipes_or_space).__name__}")
    else:
        recipes = [_one(r, i) for i, r in enumerate(recipes_or_space)]
        if not recipes:
            raise RecipeError("recipes_or_space: the list is empty; give at least one recipe")
    seen: dict[str, Recipe] = {}
    for r in recipes:
        seen.setdefault(r.id, r)
    return list(seen.values())


@dataclass(frozen=True)
class Entry:
    """One recipe of a store: its blocks (absolute), whether it is a rollout, where its parts and per-layer
    reasons are stored (``part``: None when the recipe's map itself is its one part), and which arrays hold them
    (``grid``: "" the store's token grid, ``maps``; "crop" the same arrays with a leading ``crop`` dim, one map per
    crop; "lm" an LM-site map on the LM's own grid, ``lm_maps``: :mod:`vitcam_nb.compute.map_vlm`).

    Example:
        >>> Entry(Recipe(layer=0), (0,), False, None, (0, 1)).layers
        (0,)
    """

    recipe: Recipe
    layers: tuple[int, ...]
    rollout: bool
    part: tuple[int, int] | None
    slot: tuple[int, int]
    grid: str = ""


def plan_entries(recipes: list[Recipe], n_layers: int, sites: Sequence[str], targets: Any
                 ) -> tuple[list[Entry], list[str], list[int], int]:
    """Check every recipe against what a flat trace of a class-target store can compute, before any model call,
    and lay out the store: the entries, the sites and blocks the pass captures, and the number of parts.

    Example:
        >>> entries, sites, layers, n_parts = plan_entries([Recipe(site="F4", layer=(0, 1), layer_fusion="mean")],
        ...                                                2, ["F1", "F2", "F4"], "top1")
        >>> sites, layers, n_parts, entries[0].part
        (['F4'], [0, 1], 2, (0, 2))
    """
    entries, need_sites, need_layers = [], set(), set()
    part = slot = 0
    # A recipe the flat kind computes on a plain ViT trace is one the token-grid pipeline stores; the attributes
    # make this empty Dataset a trace of that kind to the kinds' table.
    probe = xr.Dataset(attrs={"grid_h": 1})
    for r in recipes:
        text = r.to_string()
        kind = kind_for(probe, r).name
        if kind != "flat":
            raise RecipeError(f"recipe {text}: computed by the {kind!r} trace kind, not from one pass's maps on the "
                              "token grid; compute it with vc.trace and vc.cam")
        if r.site in EXTRA_SITES or r.site not in sites:
            raise RecipeError(f"recipe {text}: site {r.site!r} is not a site map_many can trace on this model "
                              f"({list(sites)})")
        if r.layer_fusion in INTEGRATED_ROLLOUTS:
            raise RecipeError(f"recipe {text}: the {r.layer_fusion!r} rollout integrates over interpolated inputs, "
                              "which one pass does not trace; compute it with vc.trace and vc.cam")
        if WEIGHTINGS.get(r.weighting).scores:
            raise RecipeError(f"recipe {text}: weighting {r.weighting!r} reads model outputs of perturbed inputs "
                              "(vc.score), which map_many does not compute")
        if isinstance(r.class_, str):
            rank = int(r.class_[3:])
            if not (isinstance(targets, str) and int(targets[3:]) >= rank):
                raise RecipeError(f"recipe {text}: class {r.class_} needs targets='top{rank}' or more, got "
                                  f"{targets!r}")
        elif isinstance(targets, str) or int(r.class_) not in (
                [int(targets)] if isinstance(targets, (int, np.integer)) else [int(c) for c in targets]):
            raise RecipeError(f"recipe {text}: class {r.class_} is not among targets {targets!r}")
        blocks = _blocks(r, n_layers)
        rolled = r.layer_fusion in ROLLOUTS
        need_sites.add(ATTENTION_SITE if rolled else r.site)
        need_layers.update(blocks)
        parts = 1 if rolled else len(blocks)
        entries.append(Entry(r, blocks, rolled, (part, parts) if parts > 1 else None, (slot, parts)))
        part += parts if parts > 1 else 0
        slot += parts
    return entries, [s for s in sites if s in need_sites], sorted(need_layers), part


def grid_parts(view: TraceView, entry: Entry) -> tuple[np.ndarray, np.ndarray, float]:
    """A recipe's per-layer maps on the token grid (after its ReLU, degeneracy check and per-layer normalisation:
    the same calls as :func:`vitcam_nb.cam`, before its upsampling), their reasons, and the largest scale.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> view = TraceView.of(vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)))
        >>> parts, why, scale = grid_parts(view, plan_entries([Recipe(layer=0)], 2, ["F1"], "top1")[0][0])
        >>> parts.shape, why.tolist()
        ((1, 4, 4), [''])
    """
    recipe = entry.recipe
    layer_pos = view.layer_positions(recipe.layer)
    view.site_check(recipe.site)
    if entry.rollout:
        if recipe.layer_fusion == "grad_rollout":
            view.target_weights(recipe)
        raw = rollout(view, recipe, layer_pos)
        maps, reasons = finish_layers(view, recipe, raw[None], np.abs(raw)[None], np.zeros(1, bool))
        return maps, reasons, float(np.abs(raw).max(initial=0))
    site_pos = None if recipe.site == ATTENTION_SITE else [view.sites.index(recipe.site)]
    raw, scale, zero = raw_maps(view, recipe, layer_pos, site_pos)
    if site_pos is not None:
        raw, scale, zero = raw[:, 0], scale[:, 0], zero[:, 0]
    maps, reasons = finish_layers(view, recipe, raw, scale, zero)
    return maps, reasons, float(np.max(scale, initial=0))


def image_maps_of(trace: xr.Dataset, entries: list[Entry], n_parts: int) -> dict[str, np.ndarray]:
    """One image's stored arrays from its trace: ``maps`` (recipe, gy, gx), ``parts`` (part, gy, gx),
    ``part_reason`` (slot), ``degenerate`` and ``scale`` (recipe); for a clip's trace ``maps`` and ``parts`` on
    its (gt, gy, gx) token grid; for a trace of several crops ``maps``, ``parts`` and ``part_reason`` with a leading
    ``crop`` dim (each crop's maps as its single-image trace gives them); for LM-site recipes on the LM's own grid
    ``lm_maps``, ``lm_parts`` and ``lm_part_reason`` (:func:`_lm_maps`).

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
        >>> out = image_maps_of(tr, plan_entries([Recipe(layer=0)], 2, ["F1"], "top1")[0], 0)
        >>> out["maps"].shape, out["degenerate"].tolist()
        ((1, 4, 4), [''])
    """
    if "crop" in trace.dims:
        return _crop_maps(trace, entries, n_parts)
    # A clip's maps are the video kind's: every per-token step on its frames stacked into one (t x h, w) grid;
    # they are stored on the (t, h, w) grid.
    gt = int(trace.attrs.get("grid_t", 0))
    view = TraceView.of(stacked_frames(trace) if gt else trace)
    out = empty_image(entries, n_parts, (view.gh, view.gw))
    for i, e in enumerate(entries):
        if e.grid:
            continue
        if e.recipe.site in LM_SITES:  # a generative VLM's LM site: the vlm kind's maps (compute.map_vlm)
            parts, reasons, scale = vlm_grid_parts(trace, e.recipe)
        else:
            parts, reasons, scale = grid_parts(view, e)
        store_entry(out, i, e, parts, [str(r) for r in reasons], scale, (view.height, view.width), view.pad)
    if gt:
        for name in ("maps", "parts"):
            out[name] = out[name].reshape(len(out[name]), gt, view.gh // gt, view.gw)
    return _lm_maps(trace, entries, n_parts, out)


def _crop_maps(trace: xr.Dataset, entries: list[Entry], n_parts: int) -> dict[str, np.ndarray]:
    """:func:`image_maps_of` of a trace of several crops: each crop's tower maps exactly as on ``trace.isel(crop=k)``
    (what ``vc.cam`` computes per crop), stacked along a leading ``crop`` dim; ``degenerate`` names each crop's
    reason and ``scale`` is the largest over the crops."""
    per = []
    for k in range(int(trace.sizes["crop"])):
        one = trace.isel(crop=k)
        view = TraceView.of(one)
        out = empty_image(entries, n_parts, (view.gh, view.gw), "crop")
        for i, e in enumerate(entries):
            if e.grid == "crop":
                parts, reasons, scale = grid_parts(view, e)
                store_entry(out, i, e, parts, [str(r) for r in reasons], scale, (view.height, view.width), view.pad)
        per.append(out)
    tiles = [str(v) for v in trace["crop_tile"].values] if "crop_tile" in trace.coords else None
    out = {k: np.stack([p[k] for p in per]) for k in ("maps", "parts", "part_reason")}
    out["degenerate"] = np.array(["; ".join(f"crop {k} ({tiles[k] if tiles else k}): {p['degenerate'][i]}"
                                            for k, p in enumerate(per) if p["degenerate"][i])
                                  for i in range(len(entries))], object)
    out["scale"] = np.max([p["scale"] for p in per], axis=0)
    return _lm_maps(trace, entries, n_parts, out)


def _lm_maps(trace: xr.Dataset, entries: list[Entry], n_parts: int, out: dict[str, np.ndarray]
             ) -> dict[str, np.ndarray]:
    """``out`` with the LM-site recipes on the LM's own grid (``grid="lm"``) in ``lm_maps`` (recipe, lgy, lgx),
    ``lm_parts`` (part, lgy, lgx) and ``lm_part_reason`` (slot): their per-layer maps as the ``vlm`` kind computes
    them on the layout's grid (:func:`~vitcam_nb.compute.map_vlm_maps.lm_grid`), before upsampling and placing."""
    lm = [i for i, e in enumerate(entries) if e.grid == "lm"]
    if not lm:
        return out
    grid = lm_grid(trace)
    mine = empty_image(entries, n_parts, grid, "lm")
    for i in lm:
        e = entries[i]
        parts, reasons, scale = vlm_grid_parts(trace, e.recipe)
        store_entry(mine, i, e, parts, [str(r) for r in reasons], scale, (1, 1), (0, 0))
        out["degenerate"][i], out["scale"][i] = mine["degenerate"][i], mine["scale"][i]
    out.update(lm_maps=mine["maps"], lm_parts=mine["parts"], lm_part_reason=mine["part_reason"])
    return out


def empty_image(entries: list[Entry], n_parts: int, grid: tuple[int, int], own: str = "") -> dict[str, np.ndarray]:
    """One image's stored arrays before its maps are written (:func:`image_maps_of` lists them), for the recipes
    whose ``Entry.grid`` is ``own``: the rows of the other recipes (held by another group of arrays) are NaN.

    Example:
        >>> empty_image([Entry(Recipe(layer=0), (0,), False, None, (0, 1))], 0, (2, 2))["maps"].shape
        (1, 2, 2)
    """
    gh, gw = grid
    n_slots = entries[-1].slot[0] + entries[-1].slot[1]
    out = {"maps": np.zeros((len(entries), gh, gw), np.float32), "parts": np.zeros((n_parts, gh, gw), np.float32),
           "part_reason": np.full(n_slots, "", object), "degenerate": np.full(len(entries), "", object),
           "scale": np.zeros(len(entries), np.float32)}
    for i, e in enumerate(entries):
        if e.grid != own:  # read raw, a row another array holds says "not here" (NaN), never a map of zeros
            out["maps"][i] = np.nan
            if e.part is not None:
                out["parts"][e.part[0]:e.part[0] + e.part[1]] = np.nan
    return out


@functools.lru_cache(maxsize=4096)
def _on_grid(recipe: Recipe) -> Recipe:
    """The recipe on the token grid, made once per recipe (a replace checks every field: 0.5 ms, per image)."""
    return recipe.replace(upsample="none")


def store_entry(out: dict[str, np.ndarray], i: int, e: Entry, parts: np.ndarray, reasons: list[str], scale: float,
                size: tuple[int, int], pad: tuple[int, int]) -> None:
    """Write entry ``i``'s per-layer token-grid maps ``parts`` (layer, gy, gx), their reasons and its scale into one
    image's arrays ``out``: its map (the parts replayed as ``vc.cam`` fuses them, on the token grid) and its
    degeneracy, by the same calls whichever backend computed the parts.

    Example:
        >>> e = Entry(Recipe(layer=0), (0,), False, None, (0, 1))
        >>> out = empty_image([e], 0, (1, 2))
        >>> store_entry(out, 0, e, np.array([[[0.0, 1.0]]], np.float32), [""], 2.0, (16, 32), (0, 0))
        >>> out["maps"].tolist(), out["scale"].tolist()
        ([[[0.0, 1.0]]], [2.0])
    """
    out["part_reason"][e.slot[0]:e.slot[0] + e.slot[1]] = reasons
    out["scale"][i] = scale
    grid, notes, _ = replay(parts, reasons, list(e.layers), _on_grid(e.recipe), size, pad, e.rollout)
    out["degenerate"][i] = "; ".join(notes)
    if e.part is None:
        out["maps"][i] = parts[0]
    else:
        out["parts"][e.part[0]:e.part[0] + e.part[1]] = parts
        out["maps"][i] = grid


def compute_batch(plan: TracePlan, entries: list[Entry], n_parts: int, prepared: list[PreparedInput]
                  ) -> tuple[dict[str, np.ndarray], dict, np.ndarray]:
    """One pass over a batch and every image's maps: the batch's arrays, the first image's trace attributes
    (without the per-image ones, with the ``pad`` the map is upsampled over) and its token kinds.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> from vitcam_nb.compute.map_many import store_plan
        >>> from vitcam_nb.preprocess import prepare_input
        >>> plan, entries, n_parts = store_plan(m, [Recipe(layer=0)], "top1", "float32", None, None)
        >>> arrays, attrs, kinds = compute_batch(plan, entries, n_parts, [prepare_input(m, np.zeros((32, 32, 3)))])
        >>> arrays["maps"].shape, kinds.tolist()[:2]
        ((1, 1, 4, 4), ['cls', 'patch'])
    """
    shapes = {tuple(p.tensor.shape) for p in prepared}
    if len(shapes) > 1:
        raise TraceError(f"images: a map store holds images of one input size; this batch has {sorted(shapes)}")
    run = run_pass(plan, torch.cat([p.tensor for p in prepared]))
    # A detection target's attributes describe the image's own detections: per image, in its provenance.
    own = (*PER_IMAGE_ATTRS, *IMAGE_TARGET_ATTRS) if isinstance(plan.target, Detection) else \
        (*PER_IMAGE_ATTRS, *ANSWER_TARGET_ATTRS) if isinstance(plan.target, AnswerTarget) else PER_IMAGE_ATTRS
    lm_sites = any(e.recipe.site in LM_SITES for e in entries)
    per, first = [], None
    for b, p in enumerate(prepared):
        # a tower on crops (a batch of one: each answer in its own pass): every crop kept, as vc.trace keeps them
        trace = assemble_crops(plan, p, run) if run.crops else assemble(plan, p, run.image(b), run)
        if first is None:
            first = trace
        out = image_maps_of(trace, entries, n_parts)
        facts = {k: trace.attrs[k] for k in own if k in trace.attrs}
        facts.update(lm_reports(trace, [e.recipe for e in entries]))  # an answer's LM-site checklists, per image
        facts.update(crop_facts(trace))  # where each crop lies in this image (any-resolution: per image size)
        if lm_sites:
            facts.update(lm_facts(trace))  # where this image's LM-site maps are placed, and what reports them
        out.update(trace_id=str(trace.attrs["trace_id"]), input_sha256=str(trace.attrs["input_sha256"]),
                   provenance=json.dumps(facts, sort_keys=True, default=str),
                   target_class=trace["target_class"].values, target_label=trace["target_label"].values.astype(object),
                   logits=trace["logits"].values.astype(np.float32))
        per.append(out)
    attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in first.attrs.items() if k not in own}
    view = TraceView.of(stacked_frames(first) if "grid_t" in first.attrs else
                        first.isel(crop=0) if "crop" in first.dims else first)
    attrs["pad"] = json.dumps([int(v) for v in view.pad])
    if "crop" in first.dims:
        attrs["crop_dim"] = 1  # the store's maps, parts and part_reason have a crop dim (map_writer.array_dims)
    return batch_arrays(per), attrs, first["token_kind"].values
