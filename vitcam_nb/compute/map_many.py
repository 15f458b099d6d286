"""Maps of many images, computed where the trace is made and stored small: per batch one forward and one batched
backward pass (the pass of :func:`vitcam_nb.trace`) capturing only the sites and blocks the recipes read, each
image's maps computed from its trace with the NumPy kernels, and only the maps kept, on the token grid
(:mod:`vitcam_nb.compute.map_store`). With an active dask.distributed Client the batches are sharded over its
workers (:mod:`vitcam_nb.compute.map_shard`).

Example:
    >>> import timm, numpy as np, tempfile, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> imgs = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    >>> p = map_many(m, imgs, ["F1@1", "F4@0"], tempfile.mkdtemp() + "/m.zarr", batch_size=2, progress=False)
    >>> vc.open_maps(p)["maps"].shape
    (3, 2, 4, 4)
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from vitcam_nb.capture.budget import check_max_bytes, fit_budget
from vitcam_nb.capture.inputs import check_item, check_items, check_label, iter_items, prepare_item
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.runtime import exclusive, on_device
from vitcam_nb.capture.store_files import check_no_foreign, check_writable, disk_full_error, store_target
from vitcam_nb.capture.store_lock import StoreLock
from vitcam_nb.capture.store_replace import replace_store, tree_bytes
from vitcam_nb.capture.store_targets import detection_plan, detection_targets, image_target
from vitcam_nb.capture.trace_many import check_worker_model, clip_list, image_count, store_settings
from vitcam_nb.compute.map_recipes import Entry, as_recipes, compute_batch, plan_entries
from vitcam_nb.compute.map_sizes import check_sizes, check_table, recipe_row
from vitcam_nb.compute.map_store import MAPS_STORE_KIND, MAPS_STORE_VERSION, report_of
from vitcam_nb.compute.map_torch import BACKENDS, compute_batch_torch, torch_refusals
from vitcam_nb.compute.map_vlm import answer_settings, answer_store_plan, answer_targets
from vitcam_nb.compute.map_vlm_maps import stored_report
from vitcam_nb.compute.map_writer import MapWriter, check_store, write_region
from vitcam_nb.compute.report_cache import cached_report
from vitcam_nb.core.arguments import as_flag, as_store_path
from vitcam_nb.core.errors import RecipeError, TraceError, TraceFileError
from vitcam_nb.core.provenance import array_sha256, settings_id
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.rules import DEFAULT_RULE, check_rule
from vitcam_nb.targets.classes import head_size
from vitcam_nb.targets.detection import Detection

__all__ = ["map_many", "store_plan"]


def _targets(recipes: list[Recipe], targets: Any) -> Any:
    """The targets the pass traces: those given, else top-K for the largest top-K class the recipes name, or
    the int classes they name."""
    if targets is not None:
        return targets
    ranks = [int(r.class_[3:]) for r in recipes if isinstance(r.class_, str)]
    ints = sorted({int(r.class_) for r in recipes if not isinstance(r.class_, str)})
    if ranks and ints:
        raise RecipeError(f"targets: the recipes name ranked classes (top{max(ranks)}) and class ids {ints}; pass "
                          "targets= (a list of class ids) to say which classes to trace")
    return f"top{max(ranks)}" if ranks else ints


def _n_scores(dets: list[Detection]) -> int:
    """The detection scores every image's target gives (one per box or query); a list that differs is refused."""
    counts = [len(t.boxes or t.queries or ()) for t in dets]
    if len(set(counts)) > 1:
        first = next(i for i, c in enumerate(counts) if c != counts[0])
        raise TraceError(f"targets: image {first}'s detection target names {counts[first]} detections, image 0's "
                         f"{counts[0]}; a map store holds the same number of detection scores per image")
    return counts[0]


def store_plan(model: torch.nn.Module, recipes: list[Recipe], targets: Any, dtype: str, device: Any,
               labels: Sequence[str] | None, dets: list[Detection] | None = None
               ) -> tuple[TracePlan, list[Entry], int]:
    """The pass's plan (only the sites and blocks the recipes read), the store's entries and its part count;
    every recipe is checked here, before any model call. With detection targets (``dets``) a recipe's
    ``class_="topK"`` ranks the detection scores.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3)
        >>> plan, entries, n_parts = store_plan(m, [Recipe(site="F4", layer=-1)], "top1", "float32", None, None)
        >>> plan.site_ids, plan.layer_ids, n_parts
        (['F4'], [2], 0)
    """
    def make(**kw: Any) -> TracePlan:
        if dets:
            return detection_plan(model, dets, dtype=dtype, device=device, labels=labels, **kw)
        return TracePlan.for_store(model, targets, dtype=dtype, device=device, labels=labels, **kw)

    full = make()
    n_layers = len(full.adapter.blocks(full.model))
    entries, sites, layers, n_parts = plan_entries(recipes, n_layers, list(full.adapter.site_table(full.model)),
                                                   f"top{_n_scores(dets)}" if dets else targets)
    return make(sites=sites, layers=layers), entries, n_parts


def _open(path: Path, settings: dict, overwrite: bool, n: int | None, lock: StoreLock
          ) -> tuple[MapWriter | None, bool]:
    """The existing store to resume (lock taken), or None for a new one, and whether a new one replaces the store
    there (``overwrite``: locked and kept until the first batch is ready); another model's store is refused."""
    if not path.exists():
        return None, False
    lock.acquire()
    if overwrite:
        try:
            check_store(path, settings)
        except TraceFileError as exc:
            if "another model or settings" not in str(exc):
                raise  # never replace a folder that is not a map store
        check_no_foreign(path)  # a user's files kept in the store would be deleted with it
        return None, True
    check_store(path, settings)
    writer = MapWriter(path)
    expected = int(writer.attrs.get("n_expected", -1))
    if n is not None and expected >= 0 and expected != n:
        raise TraceFileError(f"path: {path} was started for {expected} images, this call has {n}; these are other "
                             "images. Use a new path, or overwrite=True")
    return writer, False


def _begin(writer: MapWriter, n: int | None) -> None:
    """Mark a resumed store as being written, just before its first write: a call refused before (another image
    at an index done, a check of a later batch) leaves the store as it found it. A store begun from an iterator
    learns its length from the first call that knows it."""
    expected = int(writer.attrs.get("n_expected", -1))
    writer.group.attrs.update({"complete": 0, "n_expected": expected if n is None or expected >= 0 else int(n)})


def map_many(model: torch.nn.Module, images: Any, recipes_or_space: Any, path: str | os.PathLike, *,
             batch_size: int = 8, device: str | torch.device | None = None, dtype: str = "float32",
             targets: str | int | Sequence[int] | None = None, labels: Sequence[str] | None = None,
             image_labels: Sequence[Any] | None = None, overwrite: bool = False, verify: bool = True,
             progress: bool = True, max_bytes: float | None = None, worker_model: dict | None = None,
             backend: str = "numpy", rule: str = DEFAULT_RULE) -> Path:
    """Compute every recipe's map of every image into one zarr store, keeping only the maps on the token grid.

    Per batch, one forward and one batched backward pass capture only the sites and blocks the recipes read;
    each image's maps are computed from its trace exactly as :func:`vitcam_nb.cam` computes them, and stored on
    the token grid with each map's degeneracy, scale, the recipes (id, canonical text and JSON), each image's
    provenance and targets. Open the store with :func:`vitcam_nb.open_maps`: ``vc.cam`` on it upsamples and
    normalises as the recipe names, so a map read back is bitwise ``vc.cam`` on the trace of that image made by
    the same pass. Resumable (a batch is computed again only if it was not marked done), locked, and refusing a
    store of another model or other settings. With an active ``dask.distributed`` Client the batches are
    sharded over its workers (see :mod:`vitcam_nb.compute.map_shard`). Bad arguments, recipes and images held
    in memory are refused before any pass and before a store is read or replaced, as by
    :func:`vitcam_nb.trace_many`.

    Args:
        model: a timm ViT-like model (a flat token layout; a class head), or a video family's (VideoMAE, ViViT,
            TimeSformer): its maps are the video kind's, stored on the (gt, gy, gx) token grid and read back as
            ``vc.cam`` gives them on the clip's trace, (frame, y, x).
        images: as :func:`vitcam_nb.trace_many` takes them (list, array, folder, DataLoader, ...; clips for a
            video family).
        recipes_or_space: a list of Recipes, preset names or recipe lines, or a space ``{field: [values]}``.
        path: the store folder (``.zarr``).
        batch_size: images per pass, and per chunk of the store.
        device, labels, image_labels: as in :func:`vitcam_nb.trace_many`.
        dtype: the storage dtype of the traces the maps are computed from, as in :func:`vitcam_nb.trace` (the
            maps themselves are float32, as ``vc.cam`` returns them).
        targets: the classes traced; default: ``"topK"`` for the recipes' largest ``class_="topK"``. A generative
            VLM's answers: one :func:`vitcam_nb.targets.answer` for every image, or a list of them, one per image
            (each image in a pass of its own; recipes at the tower's and the LM's sites, ``class_`` an answer token;
            what such a store cannot hold is refused by name: :mod:`vitcam_nb.compute.map_vlm`).
        overwrite, verify, progress, max_bytes: as in :func:`vitcam_nb.trace_many` (an old store is kept, whole,
            until this call's first batch is ready to be written).
        backend: ``"numpy"`` (default): each image's maps by the NumPy pipeline of ``vc.cam`` on its trace, bitwise
            ``vc.cam``; ``"torch"``: each batch's maps by the torch kernels on the pass's device, straight from the
            pass's tensors (within 1e-5 of each map's scale, the same degenerate flags; a recipe without a torch
            kernel is refused before any model call, naming it).
        worker_model: for a distributed run, ``{"timm": name, **create_model kwargs}`` that builds the model's
            architecture on each worker (its weights travel as safetensors bytes); default: the model's timm name.
            Given without an active Client it is not used, and a warning says so.
        rule: the backward rule; map stores are computed under ``"gradient"`` (autograd's own) only: another rule
            is refused by name (trace under it with :func:`vitcam_nb.trace_many` and read maps with ``vc.cam``).

    Returns:
        the store path. Its attributes (``vc.open_maps(path).attrs``) state how the maps were made: ``backend``,
        ``dtype`` (the traces' storage dtype), ``batch_size``, and in ``trace_attrs`` the first pass's trace
        attributes (weights origin and hash, ``compute_dtype``, device settings, versions), the same for a store
        written by the workers of a Client.

    Example:
        >>> import timm, numpy as np, tempfile, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> p = vc.map_many(m, [np.zeros((32, 32, 3), np.uint8)] * 2, ["gradcam"], tempfile.mkdtemp() + "/m.zarr",
        ...                 progress=False)
        >>> vc.cam(vc.image_maps(vc.open_maps(p), 0), vc.presets.gradcam()).dims
        ('y', 'x')
    """
    from vitcam_nb.compute import map_shard

    given = as_store_path(path, "a map_many store")
    path = store_target(given)  # a symlinked store is written, resumed and replaced where the link leads
    if check_rule(rule) != DEFAULT_RULE:
        raise TraceError(f"rule: map_many computes maps under the {DEFAULT_RULE!r} rule only, got {rule!r}; trace "
                         f"the images with vc.trace_many(..., rule={rule!r}) and read each map with vc.cam")
    overwrite, verify, progress = (as_flag(n, v) for n, v in (("overwrite", overwrite), ("verify", verify),
                                                              ("progress", progress)))
    if backend not in BACKENDS:
        raise TraceError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    check_worker_model(worker_model)
    recipes = as_recipes(recipes_or_space)
    if backend == "torch":
        torch_refusals(recipes)
    targets = _targets(recipes, targets)
    dets = detection_targets(targets, image_count(images))
    # A generative VLM's answers (compute.map_vlm): like detections, each image in a pass of its own, its own target.
    answers = answer_targets(targets, image_count(images)) if dets is None else None
    if answers:
        plan, entries, n_parts = answer_store_plan(model, recipes, answers, dtype, device, labels)
    else:
        plan, entries, n_parts = store_plan(model, recipes, targets, dtype, device, labels, dets)
    own = dets or answers  # targets of each image's own pass
    what = "detection targets are matched" if dets else "an answer target's sequence is scored"
    model = plan.model
    video = getattr(plan.adapter, "video", False)
    if video and backend == "torch":
        raise TraceError(f"backend: the torch kernels compute maps on one image's grid; the {plan.adapter.family} "
                         "family's clips are mapped with backend='numpy' (the video kind's (t, y, x) grid)")
    if own and backend == "torch":
        raise TraceError(f"backend: {what} per image, each image in a pass of its own; map them with "
                         "backend='numpy'")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise TraceError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    batch_size = int(batch_size)
    check_max_bytes(max_bytes, plan)
    base = answer_settings(plan, answers) if answers else store_settings(plan, None, dets)
    settings = {**base, "recipes": [e.recipe.to_json() for e in entries], "batch_size": batch_size}
    if backend != "numpy":  # a NumPy store keeps the settings (and id) it had before backends existed
        settings["backend"] = backend
    client = map_shard.active_client()
    if client is None and worker_model is not None:
        warnings.warn("worker_model: no dask.distributed Client is active, so no worker builds a model and "
                      "worker_model is not used; the batches run in this process on the model given",
                      UserWarning, stacklevel=2)
    if client is not None and own:
        raise TraceError(f"targets: {'detection' if dets else 'answer'} targets are mapped in this process (each "
                         "image in its own pass); close the dask.distributed Client, or map class targets")
    images = clip_list(images, plan.adapter)
    items, n = iter_items(images, image_labels, None)
    if client is not None and n is None:
        raise TraceError("images: a map_many sharded over a dask.distributed Client needs a list or array of images "
                         "(its length known), not an iterator")
    # Everything that needs no pass is checked now: a refused call has run no pass and touched no store.
    def answer(i: int) -> Any:  # an answer store's image i's target: its input may be read with it (Qwen2-VL)
        return (answers[i] if len(answers) > 1 else answers[0]) if answers else None

    crops = plan.adapter.runs_crops(model)  # a tower on several crops: its input is prepared as vc.trace does

    shapes: list[tuple[int, ...]] = []

    def check(item: Any, i: int) -> None:
        if crops:  # another number of crops is another crop dim: refused here, before any pass or write
            shapes.append(tuple(prepare_item(model, plan.adapter, item.image, None, i, answer(i)).tensor.shape))
            if shapes[-1] != shapes[0]:
                raise TraceError(f"images: image {i} holds crops of shape {shapes[-1]}, image 0 {shapes[0]}; a "
                                 "map store's crop dim has one length: give every image the same crops (one "
                                 "size), or trace each with vc.trace and read its maps with vc.cam")
        else:
            check_item(model, plan.adapter, item.image, None, i, answer(i))

    check_items(images, image_labels, None, check, None if own else head_size(model))
    if overwrite or not path.exists():  # the new store is made in a temporary folder beside it, then renamed
        check_writable(path.parent, path)
    lock = StoreLock(path, writer="map_many")
    try:
        writer, replace = _open(path, settings, overwrite, n, lock)
    except BaseException:
        lock.release()
        raise
    from vitcam_nb.core.progress import progress_bar as tqdm

    bar = tqdm(total=n, initial=int(writer.done.sum()) if writer else 0, disable=not progress, unit="img",
               desc="map_many")
    state = {"writer": writer, "seen": 0, "shape": None, "begun": False}
    shard = None

    def create(arrays: dict, attrs: dict, kinds: np.ndarray) -> MapWriter:
        pad = attrs.pop("pad")
        crop_dim = attrs.pop("crop_dim", 0)  # a store of crops: maps, parts and part_reason have a crop dim
        store_attrs = {
            "store_kind": MAPS_STORE_KIND, "store_version": MAPS_STORE_VERSION,
            "settings": json.dumps(settings, sort_keys=True), "settings_id": settings_id(settings),
            "n_expected": -1 if n is None else int(n), "n_images": 0, "batch_size": batch_size, "complete": 0,
            # How the maps were computed, for either backend (settings name the backend only for torch, so that
            # NumPy stores keep their settings id): the maps' backend and the storage dtype of the traces
            "backend": backend, "dtype": plan.dtype,
            "trace_attrs": json.dumps(attrs, sort_keys=True, default=str), "num_layers": int(attrs["num_layers"]),
            "img_height": int(attrs["img_height"]), "img_width": int(attrs["img_width"]),
            "grid_h": int(attrs["grid_h"]), "grid_w": int(attrs["grid_w"]),
            "pad": pad, **({"crop_dim": int(crop_dim)} if crop_dim else {}),
            # a store of clips: the (t, y, x) grid's length in time and the clip's frames the maps upsample to
            **({"grid_t": int(attrs["grid_t"]), "clip_frames": int(attrs["clip_frames"])} if video else {}),
            "recipes": json.dumps([_info(e, report_of(attrs, str(arrays["provenance"][0]), kinds)) for e in entries]),
        }

        def make() -> MapWriter:
            return MapWriter.create(path, arrays, n if n is not None else batch_size, batch_size, store_attrs, kinds)

        check_table(path, store_attrs, replace)

        new = replace_store(path, make, lock) if replace else make()
        lock.acquire()
        state["writer"] = new
        return new

    def flush(start: int, batch: list) -> None:
        shape = tuple(batch[0][1].tensor.shape)
        if state["shape"] is None:
            state["shape"] = shape
            check_sizes(plan, entries, n_parts, n, shape[-2:], len(batch), max_bytes, path.parent,
                        tree_bytes(path) if replace else 0, shape[1] if crops else 1)
        for i, p, _ in batch:
            if tuple(p.tensor.shape) != state["shape"]:
                raise TraceError(f"images: image {i} has input size {tuple(p.tensor.shape)[-2:]}, the store "
                                 f"{state['shape'][-2:]}; a map store holds images of one input size")
        labels_ = np.array([lab for lab, _ in (x[2] for x in batch)], np.int64)
        sources = np.array([src for _, src in (x[2] for x in batch)], object)
        # a tower on crops runs on every crop the input holds, at most (as vc.trace budgets it)
        fit_budget(plan, shape[-2:], max_bytes, batch=len(batch) * (shape[1] if crops else 1), recompute=False)
        if state["writer"] is not None and not state["begun"]:
            _begin(state["writer"], n)
        state["begun"] = True
        if shard is not None:
            shard.submit(start, [p for _, p, _ in batch], labels_, sources)
            return
        if own:  # each image in its own pass, with its own target (a box matched on that image, its question)
            outs = [compute_batch(image_target(plan, own, i), entries, n_parts, [p]) for i, p, _ in batch]
            arrays = {k: np.concatenate([o[0][k] for o in outs]) for k in outs[0][0]}
            attrs, kinds = outs[0][1], outs[0][2]
        else:
            compute = compute_batch if backend == "numpy" else compute_batch_torch
            arrays, attrs, kinds = compute(plan, entries, n_parts, [p for _, p, _ in batch])
        arrays.update(label=labels_, source=sources)
        w = state["writer"] or create(arrays, attrs, kinds)
        w.grow(start + len(batch))
        write_region(str(path), start, arrays)
        w.write_meta(start, arrays)
        bar.update(len(batch))

    try:
        with exclusive(model), on_device(model, plan.run_device):
            if client is not None:
                shard = map_shard.Sharder(client, model, plan, entries, n_parts, targets, dtype, labels, path,
                                          worker_model, lambda: state["writer"], create, bar, lock.token,
                                          backend=backend)
            pending: list = []
            start = 0
            for i, item in enumerate(items):
                if i % batch_size == 0:
                    if pending:
                        flush(start, pending)
                    pending, start = [], i
                state["seen"] = i + 1
                w = state["writer"]
                chunk_done = w is not None and i < len(w.done) and bool(w.done[i])
                if chunk_done:
                    if verify:
                        digest = array_sha256(prepare_item(model, plan.adapter, item.image, None, i, answer(i)).tensor)
                        if digest != w.hashes[i]:
                            raise TraceFileError(f"path: {path} holds another image at index {i} (input hash "
                                                 f"{str(w.hashes[i])[:12]}…, this call's {digest[:12]}…); resume "
                                                 "with the same images in the same order, or use a new path")
                    continue
                if not own:  # the label an item of a folder, iterator or DataLoader carries
                    check_label(item.label, i, head_size(model))
                pending.append((i, prepare_item(model, plan.adapter, item.image, None, i, answer(i)),
                                (item.label, item.source)))
            if pending:
                flush(start, pending)
            if shard is not None:
                shard.wait()
        if state["writer"] is None:
            if state["seen"] == 0:
                raise TraceError("images: no images were given")
        else:
            state["writer"].finish(state["seen"])
    except OSError as exc:
        full = disk_full_error(path, exc, "the batches finished before are kept (rerun the call to resume)"
                               if state["writer"] is not None else
                               "nothing was written and a store this call replaces is kept")
        if full is None:
            raise
        raise full from exc
    finally:
        if shard is not None:
            shard.close()
        bar.close()
        lock.release()
    return given


def _info(e: Entry, report: xr.Dataset) -> dict:
    """A recipe's row of the store's table; its checklist is the one on the store's first image (each image's
    own, with its trace id, is what ``vc.cam`` gives on read)."""
    row = recipe_row(e)
    stored = stored_report(report, row["id"])  # an answer store's LM-site recipe: the image's own (map_vlm)
    checklist = stored[0] if stored else cached_report(e.recipe, report.assign_coords(layer=("layer",
                                                                                               list(e.layers))))[0]
    return {**{k: row[k] for k in ("key", "id", "json", "text")}, "checklist": checklist, **row}
