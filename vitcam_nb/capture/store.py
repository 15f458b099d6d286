"""The trace_many store on disk: a zarr group written resumably and atomically, chunked one image and one layer
per chunk, that records the model and settings it holds and refuses anything else.

Writes are resumable: a ``done`` flag per image is written only after that image's data, every chunk and
metadata write of zarr's local store is atomic (temporary file, then rename), and growth lengthens ``done``
last. Only local (or shared-filesystem) paths are supported, and one writer at a time.

Example:
    >>> runs([0, 1, 2, 5, 6])
    [array([0, 1, 2]), array([3, 4])]
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.capture.store_layout import strings
from vitcam_nb.capture.store_lock import lock_entry_ignored
from vitcam_nb.capture.trace_checksum import CHECKSUM_VAR
from vitcam_nb.core.errors import TraceFileError
from vitcam_nb.core.outfiles import remove_unfinished_folder
from vitcam_nb.core.provenance import settings_id
from vitcam_nb.core.schema import (
    ENV_ATTRS,
    MODE_ATTR,
    SCORE_VARIABLES,
    STORE_KIND,
    STORE_PIXELS,
    SUPPORTED_STORE_VERSIONS,
    is_int,
)

__all__ = ["META_CHUNK", "Store", "TRACE_VARS", "check_contained", "dims_of", "runs"]

# Small per-image coordinates are chunked in blocks, so that opening a store of 100k images does not read
# 100k tiny files per coordinate; zarr's atomic chunk writes keep a block safe when a run is interrupted.
META_CHUNK = 1024
# A store of clips (trace_many on a video family) holds each clip's frames and TimeSformer's two attentions.
TRACE_VARS = ("act", "grad", "attn", "attn_grad", "logits", STORE_PIXELS, "mask", "clip", "attn_time",
              "attn_time_grad", "attn_space", "attn_space_grad")


def dims_of(array: Any) -> tuple[str, ...]:
    """The dimension names of a zarr array (zarr v3 metadata, or xarray's v2 attribute).

    Example:
        >>> import zarr
        >>> a = zarr.create_array(store={}, shape=(2, 3), dtype="f4", dimension_names=("image", "layer"))
        >>> dims_of(a)
        ('image', 'layer')
    """
    names = getattr(array.metadata, "dimension_names", None)
    if names is None:
        names = array.attrs.get("_ARRAY_DIMENSIONS", ())
    return tuple(names)


def _encoding(ds: xr.Dataset) -> dict[str, dict]:
    enc = {}
    for name, var in ds.variables.items():
        if "image" not in var.dims:
            continue
        if name in TRACE_VARS:
            # one image and one layer (also of TimeSformer's attn_time_layer, attn_space_layer) per chunk
            chunks = tuple(1 if d in ("image", "layer") or d.endswith("_layer") else n
                           for d, n in zip(var.dims, var.shape))
        else:
            chunks = tuple(META_CHUNK if d == "image" else n for d, n in zip(var.dims, var.shape))
        enc[name] = {"chunks": chunks}
    return enc


def _short(value: Any) -> str:
    return f"{value[:12]}…" if isinstance(value, str) and len(value) > 16 else json.dumps(value)[:80]


def _settings_diff(stored: dict, wanted: dict) -> list[str]:
    return [f"{key}: store {_short(stored.get(key))}, this call {_short(wanted.get(key))}"
            for key in sorted(set(stored) | set(wanted)) if stored.get(key) != wanted.get(key)]


def runs(indices: list[int]) -> list[np.ndarray]:
    """Positions of ``indices`` split into runs of consecutive image indices (one zarr write each).

    Example:
        >>> [r.tolist() for r in runs([4, 5, 9])]
        [[0, 1], [2]]
    """
    return np.split(np.arange(len(indices)), np.flatnonzero(np.diff(indices) != 1) + 1)


def check_contained(path: Path) -> None:
    """Refuse a store with a symlink (an array folder, or its chunk folder) leading out of it: writing to the
    store would write through it, to files the store does not own.

    Example:
        >>> import tempfile
        >>> check_contained(Path(tempfile.mkdtemp()))
    """
    root = path.resolve()
    entries = [e for top in path.iterdir() for e in ([top, *top.iterdir()] if top.is_dir() and not top.is_symlink()
                                                     else [top])]
    for entry in entries:
        if entry.is_symlink() and not entry.resolve().is_relative_to(root):
            raise TraceFileError(f"path: {path} holds {entry.relative_to(path)}, a symlink to {entry.resolve()} "
                                 "outside the store; the store is written only inside its own folder. Copy the "
                                 "data into the store, or use a new path")


class Store:
    """A trace_many zarr store opened for writing.

    Example:
        >>> store = Store(Path("traces.zarr"))  # doctest: +SKIP
        >>> int(store.done.sum()), store.attrs["store_kind"]  # doctest: +SKIP
        (8, 'vitcam_nb.traces')
    """

    def __init__(self, path: Path) -> None:
        import zarr

        check_contained(path)
        self.path = path
        self.group = zarr.open_group(str(path), mode="r+")
        # Handles of the arrays with a leading image dimension (resizing a handle updates it in place).
        with lock_entry_ignored():
            self.arrays = {k: a for k, a in self.group.arrays() if dims_of(a)[:1] == ("image",)}
        self.done = np.asarray(self.arrays["done"][:], bool)
        self.hashes = strings(self.arrays["input_sha256"][:])

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
        if not is_int(attrs.get("store_version")) or attrs["store_version"] not in SUPPORTED_STORE_VERSIONS:
            raise TraceFileError(f"path: {path} has store_version {attrs.get('store_version')}; this vitcam_nb "
                                 f"writes {list(SUPPORTED_STORE_VERSIONS)}")
        if attrs.get("settings_id") != settings_id(settings):
            try:
                stored = json.loads(attrs.get("settings", "{}"))
            except (TypeError, ValueError):  # an edited store: its settings are unknown, and differ
                stored = {}
            diff = _settings_diff(stored if isinstance(stored, dict) else {}, settings)
            raise TraceFileError(f"path: {path} holds traces of another model or settings, and traces are never "
                                 "mixed: " + "; ".join(diff) + ". Use a new path, or overwrite=True to replace it")

    @classmethod
    def create(cls, path: Path, batch: xr.Dataset) -> Store:
        """Write the first batch as a new store, atomically: a temporary folder renamed into place."""
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            batch.to_zarr(str(tmp), mode="w-", encoding=_encoding(batch), consolidated=False, zarr_format=3)
            if path.exists():  # another call created it meanwhile: rename would replace an empty folder
                raise FileExistsError(path)
            os.rename(tmp, path)
        except OSError as exc:
            if isinstance(exc, PermissionError):
                raise TraceFileError(f"path: cannot create {path}: {exc.strerror} ({exc.filename}); write the store "
                                     "in a folder this process can write to") from exc
            if not path.exists():
                raise
            raise TraceFileError(f"path: {path} was created by another call while this one traced its first "
                                 "batch; one store has one writer. Rerun this call to resume that store") from exc
        finally:
            if tmp.exists():
                remove_unfinished_folder(tmp)
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
            self.hashes = np.concatenate([self.hashes, strings([""] * (n - len(self.hashes)))])

    def check_batch(self, batch: xr.Dataset, written: Sequence[str] = ()) -> None:
        stored = self.attrs
        diff = [k for k, v in batch.attrs.items() if k not in (*ENV_ATTRS, MODE_ATTR) and stored.get(k) != v]
        # vc.score adds its arrays to a store later; a resumed trace_many leaves them alone (grow lengthens them)
        names = {k for k in self.arrays if k not in ("image", "done", *SCORE_VARIABLES)}
        wanted = {k for k in batch.variables if "image" in batch[k].dims and k not in ("image", "done")}
        wanted |= set(written)
        if diff or names != wanted:
            what = diff or sorted(names ^ wanted)
            raise TraceFileError(f"path: {self.path} was written with other {what}; a store holds images traced "
                                 "alike (same input size, masks for all images or none)")

    def write(self, batch: xr.Dataset, written: Sequence[str] = ()) -> None:
        """Write a batch's data at its image indices, then mark those images done; ``written``: the arrays a
        worker already wrote (``trace_many`` sharded), absent from ``batch``."""
        if CHECKSUM_VAR in batch.variables and CHECKSUM_VAR not in self.arrays:
            # a store written before checksums, resumed: it stays one without (a store half checked would read as
            # checked while its earlier images are not)
            batch = batch.drop_vars(CHECKSUM_VAR)
        self.check_batch(batch, written)
        self._record_mode(batch)
        indices = [int(i) for i in batch["image"].values]
        self.grow(max(indices) + 1)
        spans = runs(indices)
        for name, var in batch.variables.items():
            if "image" not in var.dims or name in ("image", "done"):
                continue
            values = var.values
            for run in spans:
                start = indices[run[0]]
                self.arrays[name][start:start + len(run)] = values[run]
        self.mark_done(batch)

    def _record_mode(self, batch: xr.Dataset) -> None:
        """Add the batch's memory mode to those the store lists (a store begun before modes were recorded lists
        none: its earlier batches' modes are unknown)."""
        modes = self.group.attrs.get(MODE_ATTR)
        mode = batch.attrs.get(MODE_ATTR)
        if isinstance(modes, str) and mode is not None and mode not in modes.split("; "):
            self.group.attrs[MODE_ATTR] = f"{modes}; {mode}"

    def mark_done(self, batch: xr.Dataset) -> None:
        indices = [int(i) for i in batch["image"].values]
        for run in runs(indices):
            self.arrays["done"][indices[run[0]]:indices[run[-1]] + 1] = True
        self.done[indices] = True
        self.hashes[indices] = strings(batch["input_sha256"].values)

    def finish(self, n_seen: int) -> None:
        n_done = int(self.done.sum())
        self.group.attrs.update({"n_images": n_done, "complete": int(n_done >= n_seen and self.done[:n_seen].all())})
