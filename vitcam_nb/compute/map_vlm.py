"""A :func:`vitcam_nb.map_many` store of a generative VLM's answers: one answer target for every image
(``vitcam_nb.targets.answer``) or a list of them, one per image (each image's own question and answer), each image
traced in a pass of its own (a batch of one) with its own target, exactly as :func:`vitcam_nb.trace` traces it;
recipes at the vision tower's sites (computed as on any trace) and at the LM sites ``projector``, ``lm_resid`` and
``lm_attn`` (computed as the ``vlm`` trace kind computes them, :mod:`vitcam_nb.compute.vlm`). A family whose input
is read with its target (Qwen2-VL / 2.5-VL: packed ``pixel_values`` with each target's ``image_grid_thw``) has each
image prepared with its own target, as :func:`vitcam_nb.trace` prepares it.

Where the maps are stored (each recipe row's ``grid`` in the store's table says which arrays hold it; a store
that needs none of this has exactly the arrays and table it had before):

* tower recipes of a family whose tower runs on crops (LLaVA-NeXT / OneVision, Idefics3 / SmolVLM:
  ``VlmFamily.crops``; ``grid="crop"``): ``maps``, ``parts`` and ``part_reason`` get a ``crop`` dim after
  ``image``, so an image's ``isel(crop=k)`` holds crop ``k``'s maps as a single-image store's image does; reading
  gives ``vc.cam``'s (crop, y, x) with the crops' coords (``crop_tile``, ``crop_group``, ``crop_box_*``, kept per
  image in its checksummed provenance);
* LM-site recipes whose grid is not the tower's (several tiles: any-resolution and split images; one tile on
  another grid: Qwen2-VL's 2x2-merged tokens, Gemma 3's pooled ones; every LM recipe of a crops family;
  ``grid="lm"``): ``lm_maps``, ``lm_parts`` and ``lm_part_reason`` on the ``vlm`` kind's grid (one row of all image
  tokens over several tiles, the tile's (rows, cols) for one), with each image's layout in its provenance, so
  reading places them as ``vc.cam`` does: (view, y, x) per tile group, or (y, x);
* every other recipe on the tower's token grid in ``maps``, as before. The arrays hold a row for every recipe (the
  rows of the other group's recipes are NaN: read raw, they say "not here"); ``degenerate`` and ``scale``
  (image, recipe) summarise each map.

What a store cannot hold is refused by name before any pass or write: answer targets with different numbers of
traced entries (the store's arrays have one length), images whose crops or LM grids differ in number or shape
(any-resolution picks a grid per image size: the arrays have one shape, so no padding is stored), images whose
tower grids differ (Qwen2-VL's ``image_grid_thw``), a ranked ``class_`` ("topK" ranks the traced entries, not the
answer tokens: name an answer token), the token activation map (site ``lm_logit``: its own kind reads the whole
trace), and what a map store refuses for every model.

Each image's checklist and methods of an LM-site recipe are written with its maps (they name that image's
answer tokens and layout), so ``vc.cam`` on the store gives the checklist ``vc.cam`` gives on the image's trace;
read at another upsampling, the report is written again from the image's stored layout
(:func:`~vitcam_nb.compute.map_vlm_maps.lm_report`; a store written before it kept one gives its stored report).

Example:
    >>> p = vc.map_many(llava, images, ["lm_resid@-1"], "m.zarr", targets=[t0, t1])  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.hf_vlm import LM_SITES, vlm_family_of
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.trace_many import store_settings
from vitcam_nb.compute.map_recipes import Entry, plan_entries
from vitcam_nb.compute.vlm import VLM_SITES, lm_layer_positions
from vitcam_nb.core.errors import RecipeError, TraceError
from vitcam_nb.core.provenance import settings_id
from vitcam_nb.core.recipe import ROLLOUTS, Recipe
from vitcam_nb.core.weighting import WEIGHTINGS
from vitcam_nb.targets.classes import ClassTargets
from vitcam_nb.targets.vlm_answer import AnswerTarget

__all__ = ["answer_entries", "answer_plan", "answer_settings", "answer_store_plan", "answer_targets", "check_class",
           "lm_entry"]



def answer_targets(targets: Any, n: int | None) -> list[AnswerTarget] | None:
    """The answer targets of a store (one for every image, or one per image), None for any other targets; a list
    that mixes kinds, or whose length is not the number of images, is refused naming both.

    Example:
        >>> from vitcam_nb.targets.vlm_answer import answer
        >>> len(answer_targets([answer(input_ids=[1, 9], answer_ids=[5])] * 2, 2)), answer_targets("top1", 2)
        (2, None)
    """
    if isinstance(targets, AnswerTarget):
        return [targets]
    if not isinstance(targets, Sequence) or isinstance(targets, str) or not targets:
        return None
    if not any(isinstance(t, AnswerTarget) for t in targets):
        return None
    if not all(isinstance(t, AnswerTarget) for t in targets):
        raise TraceError("targets: a list of answer targets holds one vitcam_nb.targets.answer per image; this one "
                         f"also holds {sorted({type(t).__name__ for t in targets} - {'AnswerTarget'})}")
    if n is None or len(targets) != n:
        raise TraceError(f"targets: {len(targets)} answer targets (one per image) for "
                         f"{'an iterator of images' if n is None else f'{n} images'}; give a list of images and one "
                         "target per image, or one target for every image")
    return list(targets)


def _tower_grid(plan: TracePlan, target: AnswerTarget) -> tuple[int, int]:
    """The tower's token grid on this target's image: the configured one, or (a tower whose grid is the image's
    own: Qwen2-VL) the patch grid the target's ``image_grid_thw`` states ((0, 0) when it states none)."""
    tower = plan.adapter.tower_grid(plan.model)
    thw = (target.model_kwargs or {}).get("image_grid_thw")
    if tower == (0, 0) and thw is not None:
        row = np.asarray(thw, dtype=np.int64).reshape(-1, 3)[0]
        tower = (int(row[1]), int(row[2]))
    return tower


def _same_grid(plan: TracePlan, targets: list[AnswerTarget]) -> None:
    """Refuse answer targets whose images the tower reads on different token grids (Qwen2-VL: each image's patch
    grid is its own, stated by its target): a store holds one grid (packed inputs of one length may still differ)."""
    grids = [_tower_grid(plan, t) for t in targets]
    bad = next((i for i, g in enumerate(grids) if g != grids[0]), None)
    if bad is not None:
        raise TraceError(f"targets: image {bad}'s answer target states a {grids[bad][0]}x{grids[bad][1]} patch grid "
                         f"(image_grid_thw), image 0's {grids[0][0]}x{grids[0][1]}; a map store holds maps on one "
                         "token grid: resize the images to one size, or trace each with vc.trace and read its maps "
                         "with vc.cam")


def _lm_grid(plan: TracePlan, target: AnswerTarget) -> tuple[tuple[int, int], bool, str]:
    """The grid this target's LM-site maps are computed on (the ``vlm`` kind's: (1, image tokens) over several
    tiles, else the one tile's (rows, cols)), whether it is the tower's (one tile of the tower's grid), and the
    layout's description."""
    lay = plan.adapter.layout(plan.model, target.sequence.numpy(), target.model_kwargs)
    grid = (int(lay.rows.max()) + 1, int(lay.cols.max()) + 1) if lay.positions.size else (0, 0)
    if len(lay.tiles) != 1:
        return (1, int(lay.positions.size)), False, lay.description
    return grid, grid == _tower_grid(plan, target), lay.description


def lm_own_grid(plan: TracePlan, targets: list[AnswerTarget], crops: bool) -> bool:
    """Whether the store's LM-site maps go on the LM's own grid (arrays ``lm_maps``, ``lm_parts``: several tiles,
    a grid not the tower's, or a family whose tower runs on crops) rather than the tower's (``maps``); images whose
    LM grids differ (another tile count or token count: any-resolution picks a grid per image size) are refused by
    name, as the store's arrays have one shape.

    Example:
        >>> lm_own_grid(qwen_plan, [target], False)  # the 2x2-merged grid  # doctest: +SKIP
        True
    """
    grids = [_lm_grid(plan, t) for t in targets]
    bad = next((i for i, g in enumerate(grids) if g[0] != grids[0][0]), None)
    if bad is not None:
        raise TraceError(f"targets: the answer target of image {bad} lays its image tokens out as "
                         f"{grids[bad][2]!r} (LM maps on a {grids[bad][0][0]}x{grids[bad][0][1]} grid), image 0's as "
                         f"{grids[0][2]!r} ({grids[0][0][0]}x{grids[0][0][1]}); a map store's LM-site maps have one "
                         "shape: give images of one size (one tile grid), or trace each with vc.trace and read its "
                         "maps with vc.cam")
    return crops or not all(g[1] for g in grids)


def same_crops(plan: TracePlan, targets: list[AnswerTarget]) -> int:
    """The number of crops the tower runs on for every image of the store (each target's, from the family's
    ``crop_tiles``); images with different numbers are refused by name (the store's ``crop`` dim has one length).

    Example:
        >>> same_crops(next_plan, [target, target])  # doctest: +SKIP
        5
    """
    counts = [len(plan.adapter.crop_tiles(plan.model, t)) for t in targets]
    bad = next((i for i, c in enumerate(counts) if c != counts[0]), None)
    if bad is not None:
        raise TraceError(f"targets: the tower runs on {counts[bad]} crops of image {bad} and {counts[0]} of image 0 "
                         "(any-resolution picks a crop grid per image size); a map store's crop dim has one length: "
                         "give images of one size, or trace each with vc.trace and read its maps with vc.cam")
    return counts[0]


def answer_plan(model: torch.nn.Module, targets: list[AnswerTarget], recipes: list[Recipe], **plan_args: Any
                ) -> tuple[TracePlan, dict[str, str]]:
    """The plan of an answer store and the grid of each recipe group (``{"tower": "crop" or "", "lm": "lm" or
    ""}``: a crops family's tower maps have a crop dim, LM maps off the tower's grid are stored on their own): every
    target checked against the model before any pass, all with the same number of traced entries, crops and LM
    grid.

    Example:
        >>> plan, grids = answer_plan(llava, [target], [Recipe(site="lm_resid")], sites=["lm_resid"])  # doctest: +SKIP
    """
    plan = TracePlan.for_trace(model, targets[0], **plan_args)
    crops = bool(vlm_family_of(plan.model).crops)
    counts = []
    for t in targets:
        t.check(plan.model)
        counts.append(len(t.labels))
    if len(set(counts)) > 1:
        first = next(i for i, c in enumerate(counts) if c != counts[0])
        raise TraceError(f"targets: image {first}'s answer target traces {counts[first]} entries, image 0's "
                         f"{counts[0]} (answer tokens, the sequence log-prob and one logsumexp per token); a map "
                         "store holds the same number per image: give answers of the same number of tokens")
    _same_grid(plan, targets)
    if crops:
        same_crops(plan, targets)
    lm = any(r.site in LM_SITES for r in recipes) and lm_own_grid(plan, targets, crops)
    return plan, {"tower": "crop" if crops else "", "lm": "lm" if lm else ""}


def lm_entry(r: Recipe, n_lm: int) -> tuple[int, ...]:
    """Check an LM-site recipe against what a store computes (before any model call) and return its layers: the
    LM layers it reads (``projector`` has one).

    Example:
        >>> lm_entry(Recipe(site="lm_resid", layer=-1), 2)
        (1,)
    """
    text = r.to_string()
    if r.site not in VLM_SITES:
        raise RecipeError(f"recipe {text}: site {r.site!r} (the token activation map) is computed by its own trace "
                          f"kind from the whole answer trace, which a map store does not keep; map sites "
                          f"{list(VLM_SITES)} here, or trace the image with vc.trace and read it with vc.cam")
    if r.layer_fusion in ROLLOUTS:
        raise RecipeError(f"recipe {text}: layer_fusion {r.layer_fusion!r} multiplies self-attention matrices; "
                          f"site {r.site!r} fuses layers with 'mean', 'sum' or 'max'")
    if WEIGHTINGS.get(r.weighting).scores:
        raise RecipeError(f"recipe {text}: weighting {r.weighting!r} reads model outputs of perturbed inputs "
                          "(vc.score), which map_many does not compute")
    n = 1 if r.site == "projector" else n_lm
    return tuple(lm_layer_positions(r.layer, n, r.site))


def check_class(r: Recipe, n_entries: int) -> None:
    """An answer store's recipe names one traced entry by its index (``class_=0`` the first answer token).

    Example:
        >>> check_class(Recipe(class_="top1"), 7)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        RecipeError: recipe ...: class 'top1' ranks ...
    """
    if isinstance(r.class_, str) or not 0 <= int(r.class_) < n_entries:
        raise RecipeError(f"recipe {r.to_string()}: class {r.class_!r} ranks or names no traced entry of the answer "
                          f"targets (0..{n_entries - 1}: the answer tokens, the sequence log-prob, the logsumexps); "
                          "name an entry by its index (class_=0: the first answer token)")


def answer_entries(recipes: list[Recipe], plan: TracePlan, n_entries: int, grids: dict[str, str] | None = None
                   ) -> tuple[list[Entry], list[str], list[int], int]:
    """Check every recipe (before any model call) and lay out an answer store, in the recipes' order: the entries,
    the sites and tower blocks the pass captures, and the number of parts. A tower recipe is checked as a class
    store checks it; an LM-site recipe by :func:`lm_entry`. ``grids`` (:func:`answer_plan`) marks each entry's
    grid: ``"crop"`` (a tower recipe of a crops family), ``"lm"`` (an LM-site recipe on the LM's own grid).

    Example:
        >>> entries, sites, layers, n_parts = answer_entries([Recipe(site="lm_resid")], plan, 7)  # doctest: +SKIP
    """
    adapter, model = plan.adapter, plan.model
    n_tower, tower_sites = len(adapter.blocks(model)), list(adapter.site_table(model))
    n_lm = len(adapter.lm_layers(model))
    entries: list[Entry] = []
    sites: set[str] = set()
    layers: set[int] = set()
    part = slot = 0
    for r in recipes:
        check_class(r, n_entries)
        if r.site in LM_SITES:
            blocks, rollout, sites_r, layers_r = lm_entry(r, n_lm), False, [r.site], []
            grid = (grids or {}).get("lm", "")
        else:
            grid = (grids or {}).get("tower", "")
            (one,), sites_r, layers_r, _ = plan_entries([r], n_tower, tower_sites, list(range(n_entries)))
            blocks, rollout = one.layers, one.rollout
        sites.update(sites_r)
        layers.update(layers_r)
        parts = 1 if rollout else len(blocks)
        entries.append(Entry(r, blocks, rollout, (part, parts) if parts > 1 else None, (slot, parts), grid))
        part += parts if parts > 1 else 0
        slot += parts
    if not layers:
        # LM-site recipes only: the pass still captures the tower's F1 at its last block, whose token axis gives the
        # store its grid and token kinds (a trace of the LM sites alone has none)
        sites.add("F1")
        layers.add(n_tower - 1)
    order = [*tower_sites, *LM_SITES]
    return entries, [x for x in order if x in sites], sorted(layers), part


def answer_store_plan(model: torch.nn.Module, recipes: list[Recipe], targets: list[AnswerTarget], dtype: str,
                      device: Any, labels: Sequence[str] | None) -> tuple[TracePlan, list[Entry], int]:
    """:func:`~vitcam_nb.compute.map_many.store_plan` of an answer store: the pass's plan (the sites and tower
    blocks the recipes read; the LM sites are captured at every LM layer), the entries and the part count.

    Example:
        >>> plan, entries, n_parts = answer_store_plan(llava, [Recipe(site="lm_resid")], [t], "float32", None, None)
        ... # doctest: +SKIP
    """
    full, grids = answer_plan(model, targets, recipes, dtype=dtype, device=device, labels=labels)
    entries, sites, layers, n_parts = answer_entries(recipes, full, len(targets[0].labels), grids)
    plan = TracePlan.for_trace(full.model, targets[0], sites=sites, layers=layers, dtype=dtype, device=device,
                               labels=labels)
    return plan, entries, n_parts


def answer_settings(plan: TracePlan, targets: list[AnswerTarget]) -> dict:
    """What an answer store holds maps of: the model's store settings (as a class store's, without class labels)
    and its targets' settings (the one target's, or a digest of every image's: other questions are another store).

    Example:
        >>> answer_settings(plan, [target])["targets"]["kind"]  # doctest: +SKIP
        'answer'
    """
    base = store_settings(TracePlan(**{**plan.__dict__, "target": ClassTargets("top1"), "class_labels": []}))
    base.pop("class_labels_sha256")
    one = targets[0].settings() if len(targets) == 1 else {
        "kind": "answer", "per_image": len(targets),
        "settings_id": settings_id({"targets": [t.settings() for t in targets]})}
    return {**base, "targets": one}
