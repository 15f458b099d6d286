"""Trace many images into one zarr store: batched passes (the same pass as :func:`vitcam_nb.trace`),
resumable, refusing a store of another model or settings.

The store holds the trace schema with a leading ``image`` dimension (:mod:`vitcam_nb.capture.store_layout`),
one image and one layer per chunk; :func:`vitcam_nb.open_traces` opens it lazily.

Example:
    >>> import timm, numpy as np, tempfile
    >>> m = timm.create_model("vit_tiny_patch16_224")
    >>> p = trace_many(m, [np.zeros((224, 224, 3), np.uint8)] * 2, tempfile.mkdtemp() + "/t.zarr",
    ...                targets="top1", sites=["F1"], progress=False)
    >>> p.suffix
    '.zarr'
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

from vitcam_nb.adapters.hf_processor import processor_facts
from vitcam_nb.adapters.qkv import single_head_layers
from vitcam_nb.capture.assemble import assemble
from vitcam_nb.capture.budget import check_max_bytes, fit_budget
from vitcam_nb.capture.inputs import Item, check_item, check_items, check_label, iter_items, prepare_item, prepare_mask
from vitcam_nb.capture.passes import run_pass
from vitcam_nb.capture.plan import TracePlan, model_name
from vitcam_nb.capture.prealloc import writes_arrays
from vitcam_nb.capture.runtime import exclusive, on_device
from vitcam_nb.capture.store import Store
from vitcam_nb.capture.store_files import check_no_foreign, check_writable, disk_full_error, store_target
from vitcam_nb.capture.store_layout import IMAGE_ATTRS_KEY, stack_images, store_target_names, strings
from vitcam_nb.capture.store_lock import StoreLock
from vitcam_nb.capture.store_replace import replace_store
from vitcam_nb.capture.store_targets import (
    detection_plan,
    detection_settings,
    detection_targets,
    image_target,
    split_target_attrs,
)
from vitcam_nb.capture.trace_checksum import CHECKSUMS_ATTR, VERIFIED, with_checksums
from vitcam_nb.capture.trace_shard import TraceSharder
from vitcam_nb.capture.worker_model import active_client
from vitcam_nb.core.arguments import as_flag, as_store_path
from vitcam_nb.core.errors import ArgumentTypeError, TraceError, TraceFileError
from vitcam_nb.core.provenance import array_sha256, settings_id, weights_sha256
from vitcam_nb.core.schema import SCHEMA_VERSION, STORE_KIND, STORE_VERSION
from vitcam_nb.preprocess import PreparedInput, data_config
from vitcam_nb.targets.classes import ClassTargets, head_size
from vitcam_nb.targets.detection import Detection

__all__ = ["check_worker_model", "clip_list", "image_count", "store_settings", "trace_many"]


def _trace_batch(plan: TracePlan, prepared: list[PreparedInput]) -> list[xr.Dataset]:
    """One pass over a batch; each image's single-trace Dataset."""
    shapes = {tuple(p.tensor.shape) for p in prepared}
    if len(shapes) > 1:
        raise TraceError(f"images: a store holds images of one input size; this batch has {sorted(shapes)}")
    run = run_pass(plan, torch.cat([p.tensor for p in prepared]), arrays=writes_arrays(plan))
    return [assemble(plan, p, run.image(b), run) for b, p in enumerate(prepared)]


def _trace_each(plan: TracePlan, targets: list[Detection], indices: list[int], prepared: list[PreparedInput]
                ) -> list[xr.Dataset]:
    """Detection targets: each image in a pass of its own with its own target, as vc.trace traces it."""
    per = []
    for i, p in zip(indices, prepared):
        one = image_target(plan, targets, i)
        run = run_pass(one, p.tensor)
        per.append(assemble(one, p, run.image(0), run))
    return per


def check_worker_model(worker_model: Any) -> None:
    """Refuse, before any work, a ``worker_model`` that is not None or a ``{"timm": name, **kwargs}`` dict (it is
    used only with a dask.distributed Client, but a wrong one is wrong with or without).

    Example:
        >>> check_worker_model({"timm": "vit_tiny_patch16_224"}), check_worker_model(None)
        (None, None)
    """
    if worker_model is None:
        return
    if not isinstance(worker_model, dict) or not isinstance(worker_model.get("timm"), str):
        raise ArgumentTypeError(f"worker_model: expected None or a dict {{'timm': a timm model name, **its "
                                f"create_model kwargs}}, got {worker_model!r:.80}")


def image_count(images: Any) -> int | None:
    """How many images a list, array or folder holds (None for an iterator): a per-image target list is checked
    against it before any pass.

    Example:
        >>> image_count([1, 2]), image_count(iter([1]))
        (2, None)
    """
    if isinstance(images, (str, os.PathLike)):
        return None if not Path(images).is_dir() else sum(1 for p in Path(images).iterdir() if p.is_file())
    return len(images) if isinstance(images, (Sequence, np.ndarray, torch.Tensor)) else None


def clip_list(images: Any, adapter: Any) -> Any:
    """A video family's clips as a list: a (N, T, C, H, W) array or tensor holds N clips (the image path reads
    a 4-D array as N images). Anything else is returned as given.

    Example:
        >>> len(clip_list(np.zeros((2, 4, 3, 8, 8), np.float32), type("A", (), {"video": True})()))
        2
    """
    if getattr(adapter, "video", False) and isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 5:
        return list(images)
    return images


def store_settings(plan: TracePlan, processor: object = None, detections: list[Detection] | None = None) -> dict:
    """What a store holds traces of: model, weights, layers, sites, targets, dtype, labels, preprocessing (and
    the Hugging Face image processor's facts when one is given). A store written with other settings is
    refused, and traces are never mixed. A detection store (``detections``: its targets) records its targets'
    settings instead of class targets and labels.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> s = store_settings(TracePlan.for_store(m, "top2", sites=["F1"], layers=[-1]))
        >>> s["targets"], s["sites"], s["layers"]
        ('top2', ['F1'], [11])
    """
    name, tag = model_name(plan.model)
    cfg = data_config(plan.model)
    target = plan.target
    if isinstance(target, Detection):  # a detection store: its targets' settings; no class labels
        base = store_settings(TracePlan(**{**plan.__dict__, "target": ClassTargets("top1"), "class_labels": []}),
                              processor)
        base.pop("class_labels_sha256")
        return {**base, "targets": detection_settings(detections or [target])}
    settings = {
        "schema_version": SCHEMA_VERSION,
        "store_version": STORE_VERSION,
        "model_name": name,
        "pretrained_tag": tag,
        "model_family": plan.adapter.family,
        "weights_sha256": weights_sha256(plan.model),
        "sites": plan.site_ids,
        "layers": plan.layer_ids,
        "targets": f"top{target.k}" if target.k is not None else target.classes,
        "dtype": plan.dtype,
        "class_labels_sha256": array_sha256(np.array(plan.class_labels)),
        "data_config": {
            "input_size": [int(v) for v in cfg["input_size"]],
            "mean": [float(v) for v in cfg["mean"]],
            "std": [float(v) for v in cfg["std"]],
            "interpolation": str(cfg.get("interpolation", "")),
            "crop_pct": float(cfg.get("crop_pct", 1.0)),
            "crop_mode": str(cfg.get("crop_mode", "center")),
        },
    }
    if processor is not None:  # only then: stores written without one keep their settings id
        settings["processor"] = processor_facts(processor)
    single = single_head_layers(plan.model, plan.adapter.attention_modules(plan.model))
    if single:  # inside vitcam_nb.adapters.single_head_attention: resuming outside it is another model
        settings["single_head"] = list(single)
    if plan.rule != "gradient":  # only then, as for the processor: gradient stores keep their settings id
        settings["backward_rule"] = plan.rule
    return settings


def trace_many(
    model: torch.nn.Module,
    images: Any,
    path: str | os.PathLike,
    *,
    targets: str | int | Sequence[int] = "top5",
    sites: Sequence[str] | str | None = None,
    layers: int | Sequence[int] | None = None,
    dtype: str = "float32",
    batch_size: int = 8,
    device: str | torch.device | None = None,
    labels: Sequence[str] | None = None,
    image_labels: Sequence[Any] | None = None,
    masks: Sequence[Any] | None = None,
    overwrite: bool = False,
    verify: bool = True,
    progress: bool = True,
    processor: Any = None,
    max_bytes: float | None = None,
    rule: str = "gradient",
    worker_model: dict | None = None,
) -> Path:
    """Trace every image into one zarr store: batched forward and backward passes, resumable.

    The store holds the trace schema with a leading ``image`` dimension (see the module docstring), one
    image and one layer per chunk. Rerunning with the same arguments after an interruption continues where
    it stopped; a batch is traced again only if it was not marked done, so no image is lost or duplicated.
    The store records the model, its weights hash and the settings, and a call with another model or
    other settings is refused (``TraceFileError``) unless ``overwrite=True``. With ``verify`` (default),
    images already in the store are checked against this call's images by input hash.

    Bad arguments are refused before any pass and before a store is read or replaced, and so is every image
    held in memory (a list, array or tensor), by its type, shape, dtype and values, naming it (``images[i]``);
    images read from a folder, an iterator or a DataLoader are checked as each is read, and named the same way.

    Args:
        model: a timm VisionTransformer (or a family with a registered adapter).
        images: a list or array of images (PIL, HxWx3 uint8, (3,H,W) float tensors used as given), an
            iterator, a folder of image files, or a torch DataLoader. Items may be ``(image, label)``,
            ``(image, label, mask)`` or dicts with ``image``, ``label`` and ``mask`` keys. For a video family
            (VideoMAE, ViViT, TimeSformer): clips, each a normalised float (T,C,H,W) tensor or array with the
            model's ``config.num_frames`` frames (a list, or one (N,T,C,H,W) array), stored with their
            ``clip (image, frame, y, x, rgb)`` and ``patch_frame``; a clip of another frame count is refused
            naming both, and clips take no masks.
        path: the store folder (``.zarr``).
        targets: "topK" (each image's own top K classes), an int class or a list of ints; the expected
            logit is always traced too.
        sites, layers, dtype, device, labels: as in :func:`vitcam_nb.trace` (``labels`` are class names).
        batch_size: images per forward/backward pass.
        image_labels: per-image ground-truth classes (-1 or None for unknown).
        masks: per-image ground-truth masks (H, W) at the image's own size; stored in the model input's
            geometry (the image's resize and crop applied).
        overwrite: replace an existing store instead of resuming it (``True`` or ``False``). The old store is
            kept, whole, until this call's first batch is ready to be written: a call refused before that leaves
            it as it was. A folder that is not a store is never replaced.
        verify: check that images already done are the same images (by input hash).
        progress: show a progress bar.
        processor: a Hugging Face image processor that preprocesses every image instead of the model's own
            data config, as in :func:`vitcam_nb.trace`; its facts are part of the store's settings.
        max_bytes: refuse (``TraceError``) a batch whose estimated peak memory (one pass plus the batch's
            stacked copy) is above this, before its pass runs; default half the memory available then.
        rule: the backward rule, as for :func:`vitcam_nb.trace` (a store holds one rule; it is in its settings).
        worker_model: with an active dask.distributed Client the batches are sharded over its workers
            (:mod:`vitcam_nb.capture.trace_shard`), each rebuilding the model with ``timm.create_model`` from
            ``{"timm": name, **create_model kwargs}`` (default: the model's timm name) and the caller's weights.

    Returns:
        the store path; open it with :func:`open_traces`.

    Example:
        >>> import timm, numpy as np, tempfile, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> imgs = [np.zeros((224, 224, 3), np.uint8)] * 3
        >>> p = vc.trace_many(m, imgs, tempfile.mkdtemp() + "/t.zarr", targets="top1", sites=["F1"],
        ...                   progress=False)
        >>> vc.open_traces(p)["act"].dims
        ('image', 'layer', 'site', 'token', 'channel')
    """
    path = as_store_path(path, "a trace_many store")
    overwrite, verify, progress = (as_flag(n, v) for n, v in (("overwrite", overwrite), ("verify", verify),
                                                              ("progress", progress)))
    check_worker_model(worker_model)
    dets = detection_targets(targets, image_count(images))
    plan_args = dict(sites=sites, layers=layers, dtype=dtype, device=device, labels=labels, rule=rule)
    plan = detection_plan(model, dets, **plan_args) if dets else TracePlan.for_store(model, targets, **plan_args)
    model = plan.model  # the model inside torch.compile, DataParallel, ... (the wrapper itself is not called)
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise TraceError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    check_max_bytes(max_bytes, plan)  # before a store is read or replaced
    settings = store_settings(plan, processor, dets)
    given = path
    path = store_target(path)  # the store is where a link leads: written, resumed and replaced there
    video = getattr(plan.adapter, "video", False)
    if masks is not None and video:
        raise TraceError(f"masks: the {plan.adapter.family} family takes clips; a store of clips holds no masks "
                         "(pass masks=None)")
    images = clip_list(images, plan.adapter)
    items, n = iter_items(images, image_labels, masks)

    def no_clip_mask(item: Item, i: int) -> None:
        if video and item.mask is not None:
            raise TraceError(f"masks: clip {i} carries a mask; a store of clips holds no masks")

    def check(item: Item, i: int) -> None:
        check_item(model, plan.adapter, item.image, processor, i)
        no_clip_mask(item, i)

    # Everything that needs no pass is checked now: a refused call has run no pass and touched no store.
    check_items(images, image_labels, masks, check, None if dets else head_size(model))

    store: Store | None = None
    replace = False  # overwrite=True over a store: it is replaced once the first batch is ready to be written
    begun = False  # a resumed store is written to (repaired, marked incomplete) only once a batch is ready for it
    if overwrite or not path.exists():  # the new store is made in a temporary folder beside it, then renamed
        check_writable(path.parent, path)
    lock = StoreLock(path)
    try:
        if path.exists():
            lock.acquire()  # before anything is read, replaced or resumed: one writer per store
            if overwrite:
                try:
                    Store.check(path, settings)
                except TraceFileError as exc:
                    if "another model or settings" not in str(exc):
                        raise
                check_no_foreign(path)  # a user's files kept in the store would be deleted with it
                replace = True
            else:
                Store.check(path, settings)
                store = Store(path)
                expected = int(store.attrs.get("n_expected", -1))
                if n is not None and expected >= 0 and expected != n:
                    raise TraceFileError(f"path: {path} was started for {expected} images, this call has {n}; these "
                                         "are other images. Use a new path, or overwrite=True")
    except BaseException:
        lock.release()
        raise

    from vitcam_nb.core.progress import progress_bar as tqdm

    n_done = int(store.done.sum()) if store is not None else 0
    bar = tqdm(total=n, initial=n_done, disable=not progress, unit="img", desc="trace_many")
    shard = None
    names = store_target_names(plan.target) if dets is None else None
    pending: list[tuple[int, Item, PreparedInput]] = []
    seen = 0

    def flush() -> None:
        nonlocal store, names, begun
        if not pending:
            return
        fit_budget(plan, tuple(pending[0][2].tensor.shape[-2:]), max_bytes, batch=len(pending), stacked=True)
        if store is not None and not begun:
            store.repair()
            store.group.attrs.update({"complete": 0})
        begun = True
        batch_masks = [prepare_mask(model, it, i) for i, it, _ in pending]
        if shard is not None and store is not None:  # the first batch shapes the store here; the others go out
            shard.submit(store, [i for i, _, _ in pending], [it for _, it, _ in pending], batch_masks,
                         [p for _, _, p in pending], names)
            pending.clear()
            return
        indices = [i for i, _, _ in pending]
        if dets is None:
            per = _trace_batch(plan, [p for _, _, p in pending])
            extra: dict = {}
        else:
            per, extra = split_target_attrs(_trace_each(plan, dets, indices, [p for _, _, p in pending]))
            names = names or [str(t) for t in per[0]["target"].values]  # score positions: logit_<i>, expected
            for i, ds in zip(indices, per):
                if ds.sizes["target"] != len(names):
                    raise TraceError(f"targets: image {i} has {ds.sizes['target'] - 1} detection scores, the store "
                                     f"{len(names) - 1}; a store holds the same number of detections per image")
        batch = stack_images(per, indices, [it for _, it, _ in pending], batch_masks, names)
        batch = with_checksums(batch)  # hashed as written: every read of a chunk checks it
        if dets is not None:  # per image: its target attributes, and its scores' labels (the detections' classes)
            batch = batch.assign_coords({k: ("image", v) for k, v in extra.items()})
            batch = batch.assign_coords(class_label=(("image", "class"),
                                                     strings(np.stack([ds["class_label"].values for ds in per]))))
        if store is None:
            if extra:
                batch.attrs[IMAGE_ATTRS_KEY] = json.dumps(list(extra))
            batch.attrs.update({"store_kind": STORE_KIND, "store_version": STORE_VERSION,
                                "settings": json.dumps(settings, sort_keys=True), "settings_id": settings_id(settings),
                                "n_expected": -1 if n is None else int(n), "n_images": 0,
                                "batch_size": int(batch_size), "complete": 0, CHECKSUMS_ATTR: VERIFIED})
            if replace:
                store = replace_store(path, lambda: Store.create(path, batch), lock)
            else:
                store = Store.create(path, batch)
            lock.acquire()
        else:
            store.write(batch)
        bar.update(len(pending))
        pending.clear()

    try:
        client = active_client()
        if client is None and worker_model is not None:
            warnings.warn("worker_model: no dask.distributed Client is active, so no worker builds a model and "
                          "worker_model is not used; the batches run in this process on the model given",
                          UserWarning, stacklevel=2)
        if client is not None and dets is not None:
            raise TraceError("targets: detection targets are traced in this process (each image in its own pass); "
                             "close the dask.distributed Client, or trace class targets")
        if client is not None:
            shard = TraceSharder(client, model, plan, targets, labels, worker_model, bar,
                                 (_trace_batch, store_settings), lock.token)
        with exclusive(model), on_device(model, plan.run_device):
            for i, item in enumerate(items):
                if i % batch_size == 0:
                    flush()
                seen = i + 1
                if store is not None and i < len(store.done) and store.done[i]:
                    if verify:
                        digest = array_sha256(prepare_item(model, plan.adapter, item.image, processor, i).tensor)
                        if digest != store.hashes[i]:
                            raise TraceFileError(f"path: {path} holds another image at index {i} (input hash "
                                                 f"{store.hashes[i][:12]}…, this call's {digest[:12]}…); resume "
                                                 "with the same images in the same order, or use a new path")
                    continue
                if dets is None:  # the label an item of a folder, iterator or DataLoader carries
                    check_label(item.label, i, head_size(model))
                no_clip_mask(item, i)
                prepared = prepare_item(model, plan.adapter, item.image, processor, i)
                pending.append((i, item, prepared))
            flush()
            if shard is not None:
                shard.wait()
        if store is None:  # the first image given creates the store
            raise TraceError("images: no images were given")
        if store.done[seen:].any():
            warnings.warn(f"trace_many: {path} holds {int(store.done[seen:].sum())} image(s) beyond the {seen} "
                          "given now; they were kept", UserWarning, stacklevel=2)
        store.finish(seen)
    except OSError as exc:
        full = disk_full_error(path, exc, "the batches finished before are kept (rerun the call to resume)"
                               if store is not None else "nothing was written and a store this call replaces is kept")
        if full is None:
            raise
        raise full from exc
    finally:
        if shard is not None:
            shard.close()
        bar.close()
        lock.release()
    return given
