"""Reading a trace_many store: the store opened lazily with dask (only the images that are done), and one of its
images as a single trace or as a name for a picker.

Example:
    >>> import timm, numpy as np, tempfile
    >>> from vitcam_nb.capture.trace_many import trace_many
    >>> m = timm.create_model("vit_tiny_patch16_224")
    >>> p = trace_many(m, [np.zeros((224, 224, 3), np.uint8)], tempfile.mkdtemp() + "/t.zarr", targets="top1",
    ...                sites=["F1"], progress=False)
    >>> image_trace(open_traces(p), 0)["act"].dims
    ('layer', 'site', 'token', 'channel')
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import xarray as xr

from vitcam_nb.capture.store import dims_of
from vitcam_nb.capture.store_layout import single_trace
from vitcam_nb.capture.store_lock import lock_entry_ignored
from vitcam_nb.capture.trace_checksum import verified_arrays
from vitcam_nb.core.errors import ArgumentIndexError, ArgumentTypeError, TraceFileError
from vitcam_nb.core.schema import MAPS_STORE_KIND, SCHEMA_VERSION, STORE_KIND, SUPPORTED_STORE_VERSIONS, is_int

__all__ = ["image_choices", "image_trace", "is_store", "open_traces"]


def is_store(ds: object) -> bool:
    """Whether ``ds`` is a many-image Dataset (a store opened with :func:`open_traces`): it has an ``image``
    dimension.

    Example:
        >>> import xarray as xr
        >>> is_store(xr.Dataset(coords={"image": [0, 1]})), is_store(None)
        (True, False)
    """
    return isinstance(ds, xr.Dataset) and "image" in ds.dims


def open_traces(path: str | os.PathLike, *, incomplete: bool = False) -> xr.Dataset:
    """Open a :func:`trace_many` store lazily (dask-backed), with only the images that are done.

    Nothing is read but metadata until you compute; slicing one image and one layer reads one chunk. Each chunk
    is checked against the checksum trace_many wrote with it as it is read (``attrs["checksums"]`` says so; a
    store written before checksums opens with a warning), and a chunk changed on disk or that cannot be decoded
    raises a ``TraceFileError`` naming the store, the image and the array.
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
    store_version, schema_version = attrs.get("store_version"), attrs.get("schema_version")
    if not (is_int(store_version) and store_version in SUPPORTED_STORE_VERSIONS and is_int(schema_version)
            and schema_version == SCHEMA_VERSION):
        raise TraceFileError(f"path: {path} has store_version {store_version!r} and schema_version "
                             f"{schema_version!r}; this vitcam_nb reads store versions "
                             f"{list(SUPPORTED_STORE_VERSIONS)} with schema {SCHEMA_VERSION}")
    with lock_entry_ignored():
        lengths = {group[k].shape[0] for k in group.array_keys() if dims_of(group[k])[:1] == ("image",)}
    if len(lengths) > 1:
        raise TraceFileError(f"path: {path} is being grown by a running trace_many, or was interrupted while "
                             "growing; wait for it, or rerun trace_many with the same arguments to resume (it "
                             "repairs the store)")
    with lock_entry_ignored():
        ds = xr.open_zarr(str(path), chunks={}, consolidated=False)
        # every large array read chunk by chunk through its checksum (and a chunk zstd cannot decode refused by name)
        ds = verified_arrays(ds, group, str(path))
    if not incomplete:
        done = np.asarray(ds["done"].values, bool)
        ds = (ds if done.all() else ds.isel(image=np.flatnonzero(done))).drop_vars("done")
    return ds


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
    if isinstance(ds, xr.Dataset) and ds.attrs.get("store_kind") == MAPS_STORE_KIND:
        raise ArgumentTypeError("ds: this is a map store (vc.open_maps), which holds maps, not traces; use "
                                "vc.image_maps(ds, i) for one image's maps")
    if not is_store(ds):
        raise ArgumentTypeError("ds: expected a many-image Dataset from vc.open_traces (with an 'image' dimension)")
    n = ds.sizes["image"]
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not -n <= index < n:
        raise ArgumentIndexError(f"index: expected an int in [-{n}, {n - 1}], got {index!r}")
    one = ds.isel(image=int(index))
    load_image(one, ds.encoding.get("source", "the trace store"), int(index),
               "trace the image again with vc.trace_many(..., overwrite=True)")
    one.attrs = {**ds.attrs, "image_index": int(ds["image"].values[index])}
    return single_trace(one)


def load_image(one: xr.Dataset, where: str, index: int, again: str) -> None:
    """Load one image of a store in place, array by array: a chunk that cannot be read or decoded (truncated,
    corrupted: numcodecs, zarr and the filesystem raise many types) is refused naming the store ``where``, the
    array and the image, with ``again`` saying how to make it anew.

    Example:
        >>> import xarray as xr
        >>> load_image(xr.Dataset({"a": ("x", [1.0])}), "s.zarr", 0, "write it again")
    """
    for name, var in one.variables.items():
        try:
            var.load()  # in place, as Dataset.load loads each variable
        except TraceFileError:  # a chunk refused by its checksum, already naming the store, image and array
            raise
        except Exception as exc:
            raise TraceFileError(f"path: {where} is damaged: array {name!r} of image {index} cannot be read "
                                 f"({type(exc).__name__}: {exc}); {again}") from exc


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
    if not is_store(ds):
        raise ArgumentTypeError("ds: expected a many-image Dataset from vc.open_traces (with an 'image' dimension)")
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
