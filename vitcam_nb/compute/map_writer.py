"""The map store on disk, written: a zarr group whose large arrays (``maps``, ``parts``) are chunked one batch of
images per chunk, so that each batch (on any worker) writes its own chunks and no two writers share one, and
whose small per-image arrays and ``done`` flags are written by the one process that holds the store's lock.

A batch's maps are written first, its per-image facts next and its ``done`` flags last: an interrupted or failed
batch is never marked done, and is computed and written again, whole, when the call is resumed.

Example:
    >>> batch_arrays([{"a": np.zeros(2)}, {"a": np.ones(2)}])["a"].shape
    (2, 2)
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from vitcam_nb.compute.map_checksum import BIG_DIGESTS, CHECKSUM_VAR, CHECKSUMS_ATTR, VERIFIED, batch_digests
from vitcam_nb.compute.map_store import MAPS_STORE_KIND, MAPS_STORE_VERSION
from vitcam_nb.core.errors import TraceFileError
from vitcam_nb.core.outfiles import remove_unfinished_folder
from vitcam_nb.core.provenance import settings_id

__all__ = ["BIG", "MapWriter", "array_dims", "batch_arrays", "check_store", "meta_rows", "write_region"]

#: Arrays a batch writes into its own chunks (on a worker when sharded); the rest are the lock holder's.
BIG = ("maps", "parts", "lm_maps", "lm_parts")
#: Images per chunk of a per-image array: at most META_CHUNK, and fewer for wide rows (a (image, recipe) array)
#: so that a chunk holds about META_CHUNK_VALUES values. Every batch rewrites the chunk its images fall in (zarr
#: writes a chunk whole, and pads the last one to its full size), so a chunk of 1024 images of 500 recipes' strings
#: cost about 0.2 s per batch to decode and encode again; 64 images cost 0.02 s.
META_CHUNK = 1024
META_CHUNK_VALUES = 32768
_DIMS = {"maps": ("image", "recipe", "gy", "gx"), "parts": ("image", "part", "gy", "gx"), CHECKSUM_VAR: ("image",),
         "part_reason": ("image", "slot"), "degenerate": ("image", "recipe"), "scale": ("image", "recipe"),
         "trace_id": ("image",), "input_sha256": ("image",), "provenance": ("image",), "label": ("image",),
         "source": ("image",), "target_class": ("image", "target"), "target_label": ("image", "target"),
         "logits": ("image", "class"), "done": ("image",),
         # an answer store's LM-site maps on the LM's own grid (compute.map_vlm): only in stores that have them
         "lm_maps": ("image", "recipe", "lgy", "lgx"), "lm_parts": ("image", "part", "lgy", "lgx"),
         "lm_part_reason": ("image", "slot")}
#: The arrays that get a ``crop`` dim (after ``image``) in a store of a family whose tower runs on crops.
CROP_ARRAYS = ("maps", "parts", "part_reason")


def array_dims(name: str, ndim: int, crops: bool = False) -> tuple[str, ...]:
    """The dimensions of a stored array: ``maps`` and ``parts`` of a store of clips (one more axis) have the
    time axis ``gt`` of the (t, y, x) token grid before ``gy`` and ``gx``; in a store of crops (``crops``)
    ``maps``, ``parts`` and ``part_reason`` have ``crop`` after ``image`` (an image's ``isel(crop=k)`` holds crop
    ``k``'s maps as an image of a single-image store holds them).

    Example:
        >>> array_dims("maps", 4), array_dims("maps", 5)
        (('image', 'recipe', 'gy', 'gx'), ('image', 'recipe', 'gt', 'gy', 'gx'))
        >>> array_dims("maps", 5, crops=True)
        ('image', 'crop', 'recipe', 'gy', 'gx')
    """
    dims = _DIMS[name]
    if crops and name in CROP_ARRAYS:
        return (dims[0], "crop", *dims[1:])
    if name in BIG and ndim == len(dims) + 1:
        return (*dims[:2], "gt", *dims[2:])
    return dims


def meta_rows(row_shape: tuple[int, ...]) -> int:
    """Images per chunk of a per-image array whose rows have ``row_shape``: a power of two, at most
    :data:`META_CHUNK`, with about :data:`META_CHUNK_VALUES` values per chunk.

    Example:
        >>> meta_rows(()), meta_rows((500,)), meta_rows((1000,)), meta_rows((10**6,))
        (1024, 64, 32, 1)
    """
    per_row = max(1, int(np.prod(row_shape, dtype=np.int64)))
    rows = max(1, min(META_CHUNK, META_CHUNK_VALUES // per_row))
    return 1 << (rows.bit_length() - 1)


def batch_arrays(per_image: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Per-image dicts of arrays stacked along a leading image axis.

    Example:
        >>> batch_arrays([{"a": np.zeros(3)}, {"a": np.ones(3)}])["a"].shape
        (2, 3)
    """
    return {k: np.stack([np.asarray(p[k]) for p in per_image]) for k in per_image[0]}


def check_store(path: Path, settings: dict) -> None:
    """Refuse a path that is not a map store, or one written with another model or settings (naming them).

    Example:
        >>> import tempfile
        >>> check_store(Path(tempfile.mkdtemp()), {})  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceFileError: path: ... is not a vitcam_nb map store ...
    """
    import zarr

    try:
        attrs = dict(zarr.open_group(str(path), mode="r").attrs)
    except Exception as exc:  # zarr raises several types for a folder that is no group
        raise TraceFileError(f"path: {path} exists and is not a map_many store; choose another path") from exc
    if attrs.get("store_kind") != MAPS_STORE_KIND:
        raise TraceFileError(f"path: {path} is a zarr store but not a vitcam_nb map store (store_kind "
                             f"{attrs.get('store_kind')!r}); choose another path")
    if attrs.get("store_version") != MAPS_STORE_VERSION:
        raise TraceFileError(f"path: {path} has map store version {attrs.get('store_version')}; this vitcam_nb "
                             f"writes {MAPS_STORE_VERSION}")
    if attrs.get("settings_id") != settings_id(settings):
        try:
            stored = json.loads(attrs.get("settings", "{}"))
        except (TypeError, ValueError):
            stored = {}
        stored = stored if isinstance(stored, dict) else {}
        diff = [k for k in sorted(set(stored) | set(settings)) if stored.get(k) != settings.get(k)]
        raise TraceFileError(f"path: {path} holds maps of another model or settings (differing: {diff}), and maps "
                             "are never mixed. Use a new path, or overwrite=True to replace it")


def write_region(path: str, start: int, arrays: dict[str, np.ndarray]) -> None:
    """Write a batch's ``maps`` and ``parts`` at images ``start``.. (the batch's own chunks), and add to ``arrays``
    each image's digests of what was written (``BIG_DIGESTS``), which the lock holder stores with the image's
    facts (a worker returns them with the arrays it did not write).

    Example:
        >>> write_region("maps.zarr", 8, {"maps": np.zeros((8, 2, 4, 4), np.float32)})  # doctest: +SKIP
    """
    import zarr

    group = zarr.open_group(path, mode="r+")
    written = {}
    for name in BIG:
        if name in arrays and name in group:
            group[name][start:start + len(arrays[name])] = arrays[name]
            written[name] = group[name].dtype
    arrays[BIG_DIGESTS] = batch_digests(arrays, written)


def _coordinates(group: Any, attrs: dict, n: int) -> None:
    """The ``recipe`` coordinate (each stored recipe's id, in the order of ``attrs["recipes"]``) and the ``image``
    coordinate (each image's position in the call's input), which ``xr.open_zarr`` reads as index coordinates:
    ``ds.sel(recipe=r.id)``. Added arrays only: stores written before open as they did, without them."""
    ids = [str(row["id"]) for row in json.loads(attrs["recipes"])]
    recipe = group.create_array("recipe", shape=(len(ids),), dtype=str, fill_value="", dimension_names=("recipe",))
    recipe[:] = np.asarray(ids, dtype=object)
    image = group.create_array("image", shape=(n,), chunks=(META_CHUNK,), dtype=np.int64, fill_value=0,
                               dimension_names=("image",))
    image[:] = np.arange(n, dtype=np.int64)


class MapWriter:
    """A map store opened (or created) for writing by the lock holder.

    Example:
        >>> w = MapWriter(Path("maps.zarr"))  # doctest: +SKIP
        >>> int(w.done.sum())  # doctest: +SKIP
        8
    """

    def __init__(self, path: Path) -> None:
        import zarr

        self.path = path
        self.group = zarr.open_group(str(path), mode="r+")
        self.arrays = {k: self.group[k] for k in _DIMS if k in self.group}
        self.done = np.asarray(self.arrays["done"][:], bool)
        self.index = self.group["image"] if "image" in self.group else None  # stores written before have none
        self.hashes = np.asarray(self.arrays["input_sha256"][:], dtype=object)

    @property
    def attrs(self) -> dict:
        return dict(self.group.attrs)

    @classmethod
    def create(cls, path: Path, first: dict[str, np.ndarray], n: int, chunk: int, attrs: dict,
               token_kind: np.ndarray) -> MapWriter:
        """An empty store shaped by a first computed batch (``first``, not written here), for ``n`` images,
        created in a temporary folder and renamed into place (``attrs["crop_dim"]``: a store of crops)."""
        import zarr

        crops = bool(attrs.get("crop_dim"))

        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            group = zarr.open_group(str(tmp), mode="w-", zarr_format=3)
            group.attrs.update({**attrs, CHECKSUMS_ATTR: VERIFIED})
            for name in _DIMS:
                if name == "done":
                    value = np.zeros((1,), bool)
                elif name == CHECKSUM_VAR:
                    value = np.array([""], object)
                elif name not in first or (name in ("parts", "lm_parts") and 0 in first[name].shape[1:]):
                    continue  # no fused part; no LM maps off the store's grid (arrays only stores that hold them)
                else:
                    value = first[name]
                shape = (n, *value.shape[1:])
                rows = chunk if name in BIG else meta_rows(value.shape[1:])
                kind = value.dtype.kind
                dtype = str if kind in "OUS" else value.dtype
                # NaN where no batch wrote: a chunk deleted later reads as missing, not as a map of zeros
                fill = "" if kind in "OUS" else (False if kind == "b" else (np.nan if kind == "f" else 0))
                group.create_array(name, shape=shape, chunks=(rows, *value.shape[1:]), dtype=dtype,
                                   fill_value=fill, dimension_names=array_dims(name, value.ndim, crops))
            kinds = group.create_array("token_kind", shape=(len(token_kind),), dtype=str, fill_value="",
                                       dimension_names=("token",))
            kinds[:] = np.asarray(token_kind, dtype=object)
            _coordinates(group, attrs, n)
            if path.exists():
                raise FileExistsError(path)
            os.rename(tmp, path)
        except OSError as exc:
            if isinstance(exc, PermissionError):
                raise TraceFileError(f"path: cannot create {path}: {exc.strerror}; write the store in a folder "
                                     "this process can write to") from exc
            if not path.exists():
                raise
            raise TraceFileError(f"path: {path} was created by another call meanwhile; one store has one writer. "
                                 "Rerun this call to resume that store") from exc
        finally:
            if tmp.exists():
                remove_unfinished_folder(tmp)
        return cls(path)

    def grow(self, n: int) -> None:
        """Lengthen every image array to ``n`` images, ``done`` last."""
        for key in [k for k in self.arrays if k != "done"] + ["done"]:
            arr = self.arrays[key]
            if arr.shape[0] < n:
                arr.resize((n, *arr.shape[1:]))
        if self.index is not None and self.index.shape[0] < n:
            old = self.index.shape[0]
            self.index.resize((n,))
            self.index[old:n] = np.arange(old, n, dtype=np.int64)
        if n > len(self.done):
            self.done = np.concatenate([self.done, np.zeros(n - len(self.done), bool)])
            self.hashes = np.concatenate([self.hashes, np.full(n - len(self.hashes), "", object)])

    def write_meta(self, start: int, arrays: dict[str, np.ndarray]) -> None:
        """Write a batch's per-image facts and each image's checksum (a store written before checksums has none),
        then mark its images done."""
        stop = start + len(arrays["trace_id"])
        for name, value in arrays.items():
            if name not in BIG and name != CHECKSUM_VAR and name in self.arrays:
                self.arrays[name][start:stop] = value
        if CHECKSUM_VAR in self.arrays:
            big = arrays.get(BIG_DIGESTS) or batch_digests(arrays, {k: self.arrays[k].dtype for k in BIG
                                                                   if k in self.arrays})
            if not big or "maps" not in big[0]:  # never mark maps verified that no digest covers
                raise TraceFileError(f"path: {self.path}: a batch's maps reached the writer without their digests")
            meta = batch_digests(arrays, {k: a.dtype for k, a in self.arrays.items() if k not in BIG})
            sums = [json.dumps({**b, **m}, sort_keys=True, separators=(",", ":")) for b, m in zip(big, meta)]
            self.arrays[CHECKSUM_VAR][start:stop] = np.asarray(sums, dtype=object)
        self.arrays["done"][start:stop] = True
        self.done[start:stop] = True
        self.hashes[start:stop] = arrays["input_sha256"]

    def finish(self, n_seen: int) -> None:
        n_done = int(self.done.sum())
        complete = int(n_done >= n_seen and bool(self.done[:n_seen].all()) and len(self.done) == n_seen)
        self.group.attrs.update({"n_images": n_done, "complete": complete})
