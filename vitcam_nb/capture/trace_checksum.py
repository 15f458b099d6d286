"""Per-image checksums of a trace store: what :func:`vitcam_nb.trace_many` wrote of each image's large arrays
(activations, gradients, attentions, logits, pixels, masks, clips), hashed chunk by chunk as each batch is written,
and checked whenever a chunk is read back (eagerly by :func:`vitcam_nb.image_trace`, lazily as a dask task of
:func:`vitcam_nb.open_traces` is materialised), so that a chunk changed on disk (a flipped byte zstd happens not to
detect, an edited chunk) is refused naming the store, the image and the array, never read back as other values.

A store chunk holds one image and one layer (:mod:`vitcam_nb.capture.store`), so an image's digest of an array is a
list, one digest per chunk of it: its layer-like dimensions (``layer``, ``*_layer``) in C order, everything else
whole. A digest is the SHA-256 (first 16 hex digits: 64 bits, against accidental damage, not an adversary) of the
chunk's shape, dtype and little-endian bytes, hashed from the batch as it is written (the stored dtype: the batch's
own, as zarr writes it) and from the values decoded on read, so the two agree bitwise whenever the chunk is intact.
The digests are the store's ``checksum`` (image,) array of JSON texts; :func:`vitcam_nb.open_traces` reads it and
leaves it out of the Dataset it returns, so that a schema v1 reader sees the variables it always saw.
A store written before checksums existed (vitcam_nb 0.3.0 or earlier) opens as before, its values the same, with
a warning and ``attrs["checksums"]`` saying they are unverified; a chunk that cannot be decoded is refused in
both (a ``TraceFileError`` naming the store, the array and the image, never numcodecs' bare ``RuntimeError``).

Example:
    >>> batch = xr.Dataset({"act": (("image", "layer", "token"), np.zeros((2, 3, 4), np.float32))})
    >>> sums = json.loads(str(with_checksums(batch)[CHECKSUM_VAR].values[1]))
    >>> len(sums["act"]), sums["act"][0] == chunk_digest(np.zeros(4, np.float32))
    (3, True)
"""

from __future__ import annotations

import hashlib
import json
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import TraceFileError

__all__ = ["CHECKSUMS_ATTR", "CHECKSUM_VAR", "UNVERIFIED", "VERIFIED", "chunk_digest", "image_digests",
           "verified_arrays", "with_checksums"]

#: The per-image array of a trace store holding each image's digests (a JSON object: array -> one digest a chunk).
CHECKSUM_VAR = "checksum"
#: The attribute of an opened store saying whether its values are verified as they are read.
CHECKSUMS_ATTR = "checksums"
VERIFIED = "sha256 per image, array and chunk, verified as each chunk is read"
UNVERIFIED = ("none: this store was written before trace stores had checksums (vitcam_nb 0.3.0 or earlier), so a "
              "chunk changed on disk cannot be detected; trace the images again with vc.trace_many to have them")
AGAIN = "trace the image again with vc.trace_many(..., overwrite=True)"
# The arrays hashed: the store's one-image (and one-layer) chunked arrays (store.TRACE_VARS; repeated here,
# as store.py imports this module).
HASHED = ("act", "grad", "attn", "attn_grad", "logits", "pixels", "mask", "clip", "attn_time", "attn_time_grad",
          "attn_space", "attn_space_grad")


def _layered(dims: Sequence[str]) -> list[int]:
    """Positions of the dimensions a store chunks one by one besides ``image`` (as store._encoding chunks them)."""
    return [k for k, d in enumerate(dims) if d == "layer" or d.endswith("_layer")]


def chunk_digest(values: np.ndarray) -> str:
    """The digest of one chunk's values: shape, dtype and little-endian bytes.

    Example:
        >>> chunk_digest(np.ones(2, np.float32)) == chunk_digest(np.ones(2, np.float32).astype(">f4"))
        True
    """
    values = np.asarray(values)
    little = values.dtype.newbyteorder("<")
    h = hashlib.sha256(f"{values.shape}|{little.str}|".encode())
    h.update(np.ascontiguousarray(values, dtype=little).data)
    return h.hexdigest()[:16]


def image_digests(values: np.ndarray, dims: Sequence[str]) -> list[str]:
    """One image's digests of an array (``values``: its dims without ``image``), one per store chunk in C order.

    Example:
        >>> len(image_digests(np.zeros((3, 2, 4)), ("layer", "site", "token")))
        3
    """
    layered = _layered(dims)
    sizes = [values.shape[k] for k in layered]
    out = []
    for pos in np.ndindex(*sizes):
        key = [slice(None)] * values.ndim
        for k, p in zip(layered, pos):
            key[k] = p
        out.append(chunk_digest(values[tuple(key)]))
    return out


def with_checksums(batch: xr.Dataset) -> xr.Dataset:
    """The batch with its ``checksum`` (image,) array: per image, the digests of each large array it holds.

    Example:
        >>> b = with_checksums(xr.Dataset({"logits": (("image", "class"), np.zeros((1, 3), np.float32))}))
        >>> sorted(json.loads(str(b[CHECKSUM_VAR].values[0])))
        ['logits']
    """
    names = [k for k in HASHED if k in batch.variables and batch[k].dims[:1] == ("image",)]
    values = {k: batch[k].values for k in names}
    texts = [json.dumps({k: image_digests(values[k][b], batch[k].dims[1:]) for k in names}, sort_keys=True)
             for b in range(batch.sizes["image"])]
    return batch.assign({CHECKSUM_VAR: ("image", np.array(texts, dtype=object))})


def _damaged(where: str, name: str, image: int, why: str) -> TraceFileError:
    return TraceFileError(f"path: {where} is damaged: array {name!r} of image {image} {why}; {AGAIN}")


def _read_chunk(*, array: Any, var_name: str, where: str, dims: tuple[str, ...], sums: np.ndarray | None,
                done: np.ndarray, block_info: dict | None = None) -> np.ndarray:
    """One chunk of a store array read from zarr, refused by name if it cannot be decoded or (``sums``: the
    store's checksum texts, ``done``: its images done) its values are not those written."""
    name = var_name
    loc = block_info[None]["array-location"]
    image = int(loc[0][0])
    try:
        values = np.asarray(array[tuple(slice(a, b) for a, b in loc)])
    except Exception as exc:  # numcodecs, zarr and the filesystem raise many types for a damaged chunk
        raise _damaged(where, name, image, f"cannot be read ({type(exc).__name__}: {exc})") from exc
    text = "" if sums is None else str(sums[image])
    if sums is None or (not text and not done[image]):  # an old store; an image not done (incomplete=True)
        return values
    try:
        stored = json.loads(text)[name]
    except (ValueError, KeyError, TypeError):
        raise _damaged(where, name, image, "has no checksum of its own (the store's checksum array was edited or "
                                           "damaged), so it is not read") from None
    layered = _layered(dims[1:])
    sizes = [array.shape[k + 1] for k in layered]
    at = [int(loc[k + 1][0]) for k in layered]
    flat = int(np.ravel_multi_index(at, sizes)) if sizes else 0
    expected = stored[flat] if isinstance(stored, list) and flat < len(stored) else None
    # the chunk as the writer hashed it: one image, one index of each layer-like dimension, the rest whole
    chunk = values[(0, *(0 if k in layered else slice(None) for k in range(values.ndim - 1)))]
    if chunk_digest(chunk) != expected:
        where_in = ", ".join(f"{dims[k + 1]} {p}" for k, p in zip(layered, at))
        raise _damaged(where, name, image, f"{'(' + where_in + ') ' if where_in else ''}no longer matches the "
                                           "checksum written with it (a chunk was changed on disk, deleted or "
                                           "truncated), so it is not read")
    return values


def verified_arrays(ds: xr.Dataset, group: Any, where: str) -> xr.Dataset:
    """A store opened by xarray (``ds``, every variable, ``checksum`` included) with each large array read
    through :func:`_read_chunk` (one dask task a chunk: one image, one layer), the ``checksum`` array left out and
    ``attrs["checksums"]`` saying whether the values are verified (a store without checksums warns).

    Example:
        >>> ds = verified_arrays(xr.open_zarr("t.zarr"), zarr.open_group("t.zarr"), "t.zarr")  # doctest: +SKIP
    """
    import dask.array as da

    if CHECKSUM_VAR not in ds.variables and ds.attrs.get(CHECKSUMS_ATTR) == VERIFIED:
        raise TraceFileError(f"path: {where} is a damaged trace store: its attributes say it has checksums but it "
                             f"lacks the array {CHECKSUM_VAR!r}, so its values cannot be verified; trace the images "
                             "again with vc.trace_many(..., overwrite=True)")
    sums = np.asarray(ds[CHECKSUM_VAR].values, dtype=object) if CHECKSUM_VAR in ds.variables else None
    done = np.asarray(ds["done"].values, bool)
    if sums is None:
        warnings.warn(f"path: {where} has no checksums ({UNVERIFIED})", UserWarning, stacklevel=3)
    out = ds.drop_vars(CHECKSUM_VAR, errors="ignore")
    for name in HASHED:
        var = out.variables.get(name)
        if var is None or var.dims[:1] != ("image",) or name not in group or group[name].dtype != var.dtype:
            continue  # xarray decoded it into another dtype (not a store trace_many writes): read as xarray reads it
        layered = {k + 1 for k in _layered(var.dims[1:])}
        chunks = tuple((1,) * n if k == 0 or k in layered else (n,) for k, n in enumerate(var.shape))
        data = da.map_blocks(_read_chunk, array=group[name], var_name=name, where=where, dims=var.dims, sums=sums,
                             done=done, chunks=chunks, dtype=var.dtype, meta=np.empty((0,) * var.ndim, var.dtype),
                             name=f"vitcam-read-{name}-{uuid.uuid4().hex}")
        out[name] = out[name].copy(data=data)
    out.attrs[CHECKSUMS_ATTR] = VERIFIED if sums is not None else UNVERIFIED
    return out
