"""The trace_many store: writing it resumably (:func:`trace_many`), opening it lazily (:func:`open_traces`)
and turning one of its images back into a single trace (:func:`image_trace`)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from vitcam_nb.errors import TraceError, TraceFileError
from vitcam_nb.many.batch import ENV_ATTRS, PER_IMAGE_ATTRS, _Plan, _store_layout, _strings, _target_names, _trace_batch
from vitcam_nb.many.inputs import _Item, _items, _prepare_mask
from vitcam_nb.preprocess import PreparedInput, data_config, prepare_input
from vitcam_nb.provenance import array_sha256, settings_id
from vitcam_nb.tracer import (
    _DTYPES,
    EXPECTED_TARGET,
    SCHEMA_VERSION,
    _check_model,
    _check_size,
    _class_labels,
    _model_name,
    _on_device,
    _parse_targets,
    _resolve_layers,
    _resolve_sites,
    target_name,
)

STORE_KIND = "vitcam_nb.traces"
STORE_VERSION = 1
SUPPORTED_STORE_VERSIONS = (1,)
STORE_ATTRS = ("store_kind", "store_version", "settings", "settings_id", "n_expected", "n_images", "batch_size",
               "complete")
# Small per-image coordinates are chunked in blocks, so that opening a store of 100k images does not read
# 100k tiny files per coordinate; zarr's atomic chunk writes keep a block safe when a run is interrupted.
META_CHUNK = 1024
_TRACE_VARS = ("act", "grad", "attn", "attn_grad", "logits", "pixels", "mask")


def _dims_of(array: Any) -> tuple[str, ...]:
    names = getattr(array.metadata, "dimension_names", None)
    if names is None:
        names = array.attrs.get("_ARRAY_DIMENSIONS", ())
    return tuple(names)


def _encoding(ds: xr.Dataset) -> dict[str, dict]:
    enc = {}
    for name, var in ds.variables.items():
        if "image" not in var.dims:
            continue
        if name in _TRACE_VARS:
            chunks = tuple(1 if d in ("image", "layer") else n for d, n in zip(var.dims, var.shape))
        else:
            chunks = tuple(META_CHUNK if d == "image" else n for d, n in zip(var.dims, var.shape))
        enc[name] = {"chunks": chunks}
    return enc


def _short(value: Any) -> str:
    return f"{value[:12]}…" if isinstance(value, str) and len(value) > 16 else json.dumps(value)[:80]


def _settings_diff(stored: dict, wanted: dict) -> list[str]:
    return [f"{key}: store {_short(stored.get(key))}, this call {_short(wanted.get(key))}"
            for key in sorted(set(stored) | set(wanted)) if stored.get(key) != wanted.get(key)]


def _runs(indices: list[int]) -> list[np.ndarray]:
    """Positions of ``indices`` split into runs of consecutive image indices (one zarr write each)."""
    return np.split(np.arange(len(indices)), np.flatnonzero(np.diff(indices) != 1) + 1)


class _Store:
    """A trace_many zarr store opened for writing."""

    def __init__(self, path: Path) -> None:
        import zarr

        self.path = path
        self.group = zarr.open_group(str(path), mode="r+")
        # Handles of the arrays with a leading image dimension (resizing a handle updates it in place).
        self.arrays = {k: a for k, a in self.group.arrays() if _dims_of(a)[:1] == ("image",)}
        self.done = np.asarray(self.arrays["done"][:], bool)
        self.hashes = _strings(self.arrays["input_sha256"][:])

    @property
    def attrs(self) -> dict:
        return dict(self.group.attrs)

    @staticmethod
    def check(path: Path, settings: dict) -> None:
        """Refuse a path that is not a trace_many store, or one written with another model or settings."""
        import zarr

        try:
            attrs = dict(zarr.open_group(str(path), mode="r").attrs)
        except Exception as exc:  # zarr raises several types for a folder that is no group
            raise TraceFileError(f"path: {path} exists and is not a trace_many store; choose another path") from exc
        if attrs.get("store_kind") != STORE_KIND:
            raise TraceFileError(f"path: {path} is a zarr store but not a vitcam_nb trace_many store; choose another "
                                 "path")
        if int(attrs.get("store_version", -1)) not in SUPPORTED_STORE_VERSIONS:
            raise TraceFileError(f"path: {path} has store_version {attrs.get('store_version')}; this vitcam_nb "
                                 f"writes {list(SUPPORTED_STORE_VERSIONS)}")
        if attrs.get("settings_id") != settings_id(settings):
            diff = _settings_diff(json.loads(attrs.get("settings", "{}")), settings)
            raise TraceFileError(f"path: {path} holds traces of another model or settings, and traces are never "
                                 "mixed: " + "; ".join(diff) + ". Use a new path, or overwrite=True to replace it")

    @classmethod
    def create(cls, path: Path, batch: xr.Dataset) -> _Store:
        """Write the first batch as a new store, atomically: a temporary folder renamed into place."""
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            batch.to_zarr(str(tmp), mode="w-", encoding=_encoding(batch), consolidated=False, zarr_format=3)
            os.rename(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        store = cls(path)
        store.mark_done(batch)
        return store

    def repair(self) -> None:
        """An interrupted growth leaves ``done`` shorter than the data arrays (it is grown last): even them."""
        lengths = {a.shape[0] for a in self.arrays.values()}
        if len(lengths) > 1:
            self.grow(max(lengths))

    def grow(self, n: int) -> None:
        """Lengthen every image array to ``n``; the index next, and ``done`` last, so that an interrupted
        growth never shows an image as done that has no data."""
        order = [k for k in self.arrays if k not in ("image", "done")] + ["image", "done"]
        for key in order:
            arr = self.arrays[key]
            old = arr.shape[0]
            if old < n:
                arr.resize((n, *arr.shape[1:]))
                if key == "image":
                    arr[old:n] = np.arange(old, n, dtype=np.int64)
        if n > len(self.done):
            self.done = np.concatenate([self.done, np.zeros(n - len(self.done), bool)])
            self.hashes = np.concatenate([self.hashes, _strings([""] * (n - len(self.hashes)))])

    def check_batch(self, batch: xr.Dataset) -> None:
        stored = self.attrs
        diff = [k for k, v in batch.attrs.items() if k not in ENV_ATTRS and stored.get(k) != v]
        names = {k for k in self.arrays if k not in ("image", "done")}
        wanted = {k for k in batch.variables if "image" in batch[k].dims and k not in ("image", "done")}
        if diff or names != wanted:
            what = diff or sorted(names ^ wanted)
            raise TraceFileError(f"path: {self.path} was written with other {what}; a store holds images traced "
                                 "alike (same input size, masks for all images or none)")

    def write(self, batch: xr.Dataset) -> None:
        """Write a batch's data at its image indices, then mark those images done."""
        self.check_batch(batch)
        indices = [int(i) for i in batch["image"].values]
        self.grow(max(indices) + 1)
        runs = _runs(indices)
        for name, var in batch.variables.items():
            if "image" not in var.dims or name in ("image", "done"):
                continue
            values = var.values
            for run in runs:
                start = indices[run[0]]
                self.arrays[name][start:start + len(run)] = values[run]
        self.mark_done(batch)

    def mark_done(self, batch: xr.Dataset) -> None:
        indices = [int(i) for i in batch["image"].values]
        for run in _runs(indices):
            self.arrays["done"][indices[run[0]]:indices[run[-1]] + 1] = True
        self.done[indices] = True
        self.hashes[indices] = _strings(batch["input_sha256"].values)

    def finish(self, n_seen: int) -> None:
        n_done = int(self.done.sum())
        self.group.attrs.update({"n_images": n_done, "complete": int(n_done >= n_seen and self.done[:n_seen].all())})


def _settings(plan: _Plan, targets: Any, dtype: str) -> dict:
    name, tag = _model_name(plan.model)
    cfg = data_config(plan.model)
    from vitcam_nb.provenance import weights_sha256

    return {
        "schema_version": SCHEMA_VERSION,
        "store_version": STORE_VERSION,
        "model_name": name,
        "pretrained_tag": tag,
        "model_family": plan.adapter.family,
        "weights_sha256": weights_sha256(plan.model),
        "sites": plan.site_ids,
        "layers": plan.layer_ids,
        "targets": f"top{targets[1]}" if targets[0] == "top" else targets[1],
        "dtype": dtype,
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
) -> Path:
    """Trace every image into one zarr store: batched forward and backward passes, resumable.

    The store holds the trace schema with a leading ``image`` dimension (see the module docstring), one
    image and one layer per chunk. Rerunning with the same arguments after an interruption continues where
    it stopped; a batch is traced again only if it was not marked done, so no image is lost or duplicated.
    The store records the model, its weights hash and the settings, and a call with another model or
    other settings is refused (``TraceFileError``) unless ``overwrite=True``. With ``verify`` (default),
    images already in the store are checked against this call's images by input hash.

    Args:
        model: a timm VisionTransformer (or a family with a registered adapter).
        images: a list or array of images (PIL, HxWx3 uint8, (3,H,W) float tensors used as given), an
            iterator, a folder of image files, or a torch DataLoader. Items may be ``(image, label)``,
            ``(image, label, mask)`` or dicts with ``image``, ``label`` and ``mask`` keys.
        path: the store folder (``.zarr``).
        targets: "topK" (each image's own top K classes), an int class or a list of ints; the expected
            logit is always traced too.
        sites, layers, dtype, device, labels: as in :func:`vitcam_nb.trace` (``labels`` are class names).
        batch_size: images per forward/backward pass.
        image_labels: per-image ground-truth classes (-1 or None for unknown).
        masks: per-image ground-truth masks (H, W) at the image's own size; stored in the model input's
            geometry (the image's resize and crop applied).
        overwrite: replace an existing store instead of resuming it.
        verify: check that images already done are the same images (by input hash).
        progress: show a progress bar.

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
    adapter, num_classes = _check_model(model, dtype)
    if getattr(adapter, "hierarchical", False) or adapter.extra_sites(model):
        raise TraceError(f"model: trace_many stores flat token layouts; the {adapter.family} family has "
                         "per-stage grids or extra sites. Trace its images one by one with vitcam_nb.trace()")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise TraceError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    params = list(model.parameters())
    plan = _Plan(
        model=model, adapter=adapter,
        layer_ids=_resolve_layers(layers, len(adapter.blocks(model))),
        site_ids=_resolve_sites(sites, adapter, model),
        target_mode=_parse_targets(targets, num_classes),
        class_labels=_class_labels(model, num_classes, labels),
        run_device=torch.device(device) if device is not None else (params[0].device if params else
                                                                    torch.device("cpu")),
        compute_dtype=params[0].dtype if params else torch.float32,
        store_dtype=_DTYPES[dtype],
        prefix=adapter.prefix_kinds(model),
    )
    settings = _settings(plan, plan.target_mode, dtype)
    path = Path(path)
    if not path.parent.exists():
        raise TraceFileError(f"path: folder {path.parent} does not exist")
    items, n = _items(images, image_labels, masks)

    store: _Store | None = None
    if path.exists():
        if overwrite:
            try:
                _Store.check(path, settings)
            except TraceFileError as exc:
                if "another model or settings" not in str(exc):
                    raise
            shutil.rmtree(path)
        else:
            _Store.check(path, settings)
            store = _Store(path)
            expected = int(store.attrs.get("n_expected", -1))
            if n is not None and expected >= 0 and expected != n:
                raise TraceFileError(f"path: {path} was started for {expected} images, this call has {n}; these "
                                     "are other images. Use a new path, or overwrite=True")
            store.repair()
            store.group.attrs.update({"complete": 0})

    from tqdm.auto import tqdm

    n_done = int(store.done.sum()) if store is not None else 0
    bar = tqdm(total=n, initial=n_done, disable=not progress, unit="img", desc="trace_many")
    names = _target_names(plan.target_mode)
    pending: list[tuple[int, _Item, PreparedInput]] = []
    seen = 0

    def flush() -> None:
        nonlocal store
        if not pending:
            return
        per = _trace_batch(plan, [p for _, _, p in pending])
        batch_masks = [_prepare_mask(model, it, p, i) for i, it, p in pending]
        batch = _store_layout(per, [i for i, _, _ in pending], [it for _, it, _ in pending], batch_masks, names)
        if store is None:
            batch.attrs.update({"store_kind": STORE_KIND, "store_version": STORE_VERSION,
                                "settings": json.dumps(settings, sort_keys=True), "settings_id": settings_id(settings),
                                "n_expected": -1 if n is None else int(n), "n_images": 0,
                                "batch_size": int(batch_size), "complete": 0})
            store = _Store.create(path, batch)
        else:
            store.write(batch)
        bar.update(len(pending))
        pending.clear()

    try:
        with _on_device(model, plan.run_device):
            for i, item in enumerate(items):
                if i % batch_size == 0:
                    flush()
                seen = i + 1
                if store is not None and i < len(store.done) and store.done[i]:
                    if verify:
                        digest = array_sha256(prepare_input(model, item.image).tensor)
                        if digest != store.hashes[i]:
                            raise TraceFileError(f"path: {path} holds another image at index {i} (input hash "
                                                 f"{store.hashes[i][:12]}…, this call's {digest[:12]}…); resume "
                                                 "with the same images in the same order, or use a new path")
                    continue
                prepared = prepare_input(model, item.image)
                _check_size(model, prepared.tensor)
                pending.append((i, item, prepared))
            flush()
    finally:
        bar.close()
    if store is None:
        if seen == 0:
            raise TraceError("images: no images were given")
        raise TraceError("images: nothing was traced")  # unreachable: the first batch creates the store
    if store.done[seen:].any():
        warnings.warn(f"trace_many: {path} holds {int(store.done[seen:].sum())} image(s) beyond the {seen} given "
                      "now; they were kept", UserWarning, stacklevel=2)
    store.finish(seen)
    return path


def open_traces(path: str | os.PathLike, *, incomplete: bool = False) -> xr.Dataset:
    """Open a :func:`trace_many` store lazily (dask-backed), with only the images that are done.

    Nothing is read but metadata until you compute; slicing one image and one layer reads one chunk.
    ``incomplete=True`` also returns images whose trace was not finished (their values are undefined)
    with the ``done`` flag as a variable.

    Example:
        >>> import timm, numpy as np, tempfile, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> p = vc.trace_many(m, [np.zeros((224, 224, 3), np.uint8)] * 2, tempfile.mkdtemp() + "/t.zarr",
        ...                   targets="top1", sites=["F1"], progress=False)
        >>> ds = vc.open_traces(p)
        >>> ds.sizes["image"], ds["act"].chunks[:2]
        (2, ((1, 1), (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)))
    """
    import zarr

    path = Path(path)
    if not path.exists():
        raise TraceFileError(f"path: {path} does not exist")
    try:
        group = zarr.open_group(str(path), mode="r")
        attrs = dict(group.attrs)
    except Exception as exc:  # zarr raises several types for a folder that is no group
        raise TraceFileError(f"path: {path} is not a zarr store: {exc}") from exc
    if attrs.get("store_kind") != STORE_KIND:
        hint = " (a single trace: read it with vc.load)" if "schema_version" in attrs else ""
        raise TraceFileError(f"path: {path} is not a vitcam_nb trace_many store{hint}")
    if int(attrs.get("store_version", -1)) not in SUPPORTED_STORE_VERSIONS or \
            int(attrs.get("schema_version", -1)) != SCHEMA_VERSION:
        raise TraceFileError(f"path: {path} has store_version {attrs.get('store_version')} and schema_version "
                             f"{attrs.get('schema_version')}; this vitcam_nb reads store versions "
                             f"{list(SUPPORTED_STORE_VERSIONS)} with schema {SCHEMA_VERSION}")
    lengths = {group[k].shape[0] for k in group.array_keys() if _dims_of(group[k])[:1] == ("image",)}
    if len(lengths) > 1:
        raise TraceFileError(f"path: {path} is being grown by a running trace_many, or was interrupted while "
                             "growing; wait for it, or rerun trace_many with the same arguments to resume (it "
                             "repairs the store)")
    ds = xr.open_zarr(str(path), chunks={}, consolidated=False)
    if not incomplete:
        done = np.asarray(ds["done"].values, bool)
        ds = (ds if done.all() else ds.isel(image=np.flatnonzero(done))).drop_vars("done")
    return ds


def _plain(value: Any) -> Any:
    value = value.item() if isinstance(value, np.generic) else value
    return str(value) if isinstance(value, (np.str_, str)) else value


def _as_trace(one: xr.Dataset) -> xr.Dataset:
    """One image of a store (no ``image`` dimension, in memory) as the Dataset vitcam_nb.trace returns."""
    one = one.drop_vars(["image", "done"], errors="ignore")
    attrs = {k: v for k, v in one.attrs.items() if k not in STORE_ATTRS}
    for key in PER_IMAGE_ATTRS:
        if key in one.coords:
            attrs[key] = _plain(one[key].values[()])
    attrs["image_index"] = int(one.attrs.get("image_index", -1))
    for key, name in (("label", "image_label"), ("source", "image_source")):
        if key in one.coords:
            attrs[name] = _plain(one[key].values[()])
    one = one.drop_vars([k for k in (*PER_IMAGE_ATTRS, "label", "source") if k in one.coords])
    classes = [int(c) for c in one["target_class"].values]
    one = one.assign_coords(target=np.array([target_name(c) if c >= 0 else EXPECTED_TARGET for c in classes]))
    fixed = {name: (var.dims, np.array(var.values.tolist(), dtype=str).reshape(var.shape))
             for name, var in one.variables.items() if var.dtype.kind in "OT"}
    one = one.assign_coords({k: v for k, v in fixed.items() if k in one.coords})
    one = one.assign({k: v for k, v in fixed.items() if k not in one.coords})
    if "pixels" in one:
        one = one.rename_vars({"pixels": "image"})
    one.attrs = {k: _plain(v) for k, v in attrs.items()}
    return one


def image_trace(ds: xr.Dataset, index: int) -> xr.Dataset:
    """Image ``index`` (position along ``image``) of a many-image Dataset, as a single trace in memory.

    The result has exactly the schema and attributes of :func:`vitcam_nb.trace` (target names, ``image``
    variable, ``trace_id``), plus ``image_index``, ``image_label``, ``image_source`` attributes and the
    ``mask`` variable when the store has masks. Only that image's chunks are read.

    Example:
        >>> import timm, numpy as np, tempfile, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> p = vc.trace_many(m, [np.zeros((224, 224, 3), np.uint8)] * 2, tempfile.mkdtemp() + "/t.zarr",
        ...                   targets="top1", sites=["F1"], progress=False)
        >>> tr = vc.image_trace(vc.open_traces(p), 1)
        >>> tr["target"].values.tolist()[-1], tr["image"].dims
        ('expected_logit', ('y', 'x', 'rgb'))
    """
    if not isinstance(ds, xr.Dataset) or "image" not in ds.dims:
        raise TypeError("ds: expected a many-image Dataset from vc.open_traces (with an 'image' dimension)")
    n = ds.sizes["image"]
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not -n <= index < n:
        raise IndexError(f"index: expected an int in [-{n}, {n - 1}], got {index!r}")
    one = ds.isel(image=int(index)).load()
    one.attrs = {**ds.attrs, "image_index": int(ds["image"].values[index])}
    return _as_trace(one)


def image_choices(ds: xr.Dataset) -> list[tuple[str, int]]:
    """``(label, index)`` pairs naming each image of a many-image Dataset, for a widget's image picker.

    Example:
        >>> import timm, numpy as np, tempfile, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> p = vc.trace_many(m, [np.zeros((224, 224, 3), np.uint8)], tempfile.mkdtemp() + "/t.zarr",
        ...                   targets="top1", sites=["F1"], progress=False)
        >>> image_choices(vc.open_traces(p))
        [('image 0', 0)]
    """
    if not isinstance(ds, xr.Dataset) or "image" not in ds.dims:
        raise TypeError("ds: expected a many-image Dataset from vc.open_traces (with an 'image' dimension)")
    names = ds["class_label"].values if "class_label" in ds.coords else None
    index = ds["image"].values
    sources = ds["source"].values if "source" in ds.coords else [""] * len(index)
    labels = ds["label"].values if "label" in ds.coords else [-1] * len(index)
    out = []
    for pos, (i, src, lab) in enumerate(zip(index, sources, labels)):
        text = f"image {int(i)}" + (f": {src}" if str(src) else "")
        if int(lab) >= 0:
            text += f" ({names[int(lab)] if names is not None else int(lab)})"
        out.append((text, pos))
    return out
