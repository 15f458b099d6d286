"""Save and load traces as netCDF (``.nc``) or zarr (``.zarr``): atomic writes, content checksums,
schema checks. No pickle anywhere: attributes are plain strings and numbers.

Example:
    >>> import tempfile, numpy as np, xarray as xr
    >>> p = save(xr.Dataset({"a": ("x", np.arange(2.0))}, attrs={"schema_version": 1}), tempfile.mkdtemp() + "/t.nc")
    >>> load(p).attrs["schema_version"]
    1
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path

import numpy as np
import xarray as xr

from vitcam_nb.capture.store_files import foreign_files as _foreign_files
from vitcam_nb.core.arguments import as_flag, as_path
from vitcam_nb.core.errors import ArgumentTypeError, OutputExistsError, TraceFileError
from vitcam_nb.core.outfiles import remove_unfinished_folder
from vitcam_nb.core.schema import (
    COORDINATES,
    MAPS_STORE_KIND,
    ROOT_COORDS,
    SUPPORTED_SCHEMAS,
    VARIABLES,
    is_int,
    problems,
)

__all__ = ["CHECKSUM_ATTR", "content_sha256", "load", "save", "tree_sha256"]

CHECKSUM_ATTR = "content_sha256"


def content_sha256(ds: xr.Dataset) -> str:
    """SHA-256 over every variable and coordinate (name, dims, dtype, values) and the attributes.

    Example:
        >>> ds = xr.Dataset({"a": ("x", np.arange(3.0))})
        >>> content_sha256(ds) == content_sha256(ds.copy(deep=True))
        True
    """
    h = hashlib.sha256()
    for name in sorted(map(str, ds.variables)):
        var = ds.variables[name]
        values = np.asarray(var.values)
        h.update(f"{name}|{var.dims}|{values.shape}|".encode())
        if values.dtype.kind in "UOS":
            h.update("\x00".join(map(str, values.ravel())).encode())
        else:
            h.update(values.dtype.str.encode())
            h.update(np.ascontiguousarray(values).tobytes())
    attrs = {k: _plain(v) for k, v in ds.attrs.items() if k != CHECKSUM_ATTR}
    h.update(json.dumps(attrs, sort_keys=True).encode())
    return h.hexdigest()


def tree_sha256(tree: xr.DataTree) -> str:
    """:func:`content_sha256` of a hierarchical trace: every node's own variables and attributes, in path order.

    Example:
        >>> t = xr.DataTree.from_dict({"/": xr.Dataset(), "a": xr.Dataset({"v": ("x", [1.0])})})
        >>> tree_sha256(t) == tree_sha256(t.copy(deep=True))
        True
    """
    h = hashlib.sha256()
    for node in sorted(tree.subtree, key=lambda n: n.path):
        h.update(f"{node.path}|{content_sha256(node.to_dataset(inherit=False))}".encode())
    return h.hexdigest()


def _checksum(trace: xr.Dataset | xr.DataTree) -> str:
    return tree_sha256(trace) if isinstance(trace, xr.DataTree) else content_sha256(trace)


def _clean(ds: xr.Dataset) -> xr.Dataset:
    ds.attrs = {k: _plain(v) for k, v in ds.attrs.items()}
    for name in ds.variables:
        if ds.variables[name].dtype == object:
            ds[name] = ds[name].astype(str)
    return ds


def _plain(value: object) -> object:
    return value.item() if isinstance(value, np.generic) else value


def _format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".nc":
        return "netcdf"
    if suffix == ".zarr":
        return "zarr"
    raise TraceFileError(f"path: {path} must end in .nc (netCDF) or .zarr (zarr)")


def _top_attrs(path: Path) -> dict | None:
    """The root attributes of what is at ``path`` when it is a netCDF or zarr file/store, else None."""
    try:
        if path.is_dir():
            for name, key in ((".zattrs", None), ("zarr.json", "attributes")):
                meta = path / name
                if meta.is_file():
                    data = json.loads(meta.read_text())
                    return dict(data.get(key, {}) if key else data)
            return None
        import h5py

        with h5py.File(path, "r") as f:
            return {k: f.attrs[k] for k in f.attrs}
    except Exception:  # h5py raises OSError, ValueError, RuntimeError... for a damaged file: not readable attrs
        return None


def _check_overwrite(path: Path, kind: str) -> None:
    """Refuse to replace anything but a single trace vitcam_nb.save wrote (files it did not write are kept)."""
    if kind == "netcdf" and path.is_dir():
        raise OutputExistsError(f"path: {path} is a folder; a .nc trace is one file. Use another path")
    if kind == "zarr" and path.is_file():
        raise OutputExistsError(f"path: {path} is a file; a .zarr trace is a folder. Use another path")
    attrs = _top_attrs(path)
    if attrs is not None and "store_kind" in attrs:
        raise OutputExistsError(f"path: {path} is a trace_many store; save will not replace it. Use another path, "
                                "or overwrite=True to replace it")
    if attrs is None or CHECKSUM_ATTR not in attrs or "schema_version" not in attrs:
        raise OutputExistsError(f"path: {path} exists and is not a trace vitcam_nb.save wrote; it is left alone. Use "
                                "another path, or overwrite=True to replace it")
    foreign = _foreign_files(path) if path.is_dir() else []
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise OutputExistsError(f"path: {path} holds files vitcam_nb did not write ({', '.join(foreign[:5])}{more}); "
                                "it is left alone. Use another path, or overwrite=True to replace it")


class _SpillOnFailure:
    """A binary file for HDF5 to write through that never reports a failed write to it.

    HDF5 does not survive a write that fails (a full disk, a file-size limit): its metadata cache is left
    inconsistent, and the next close or the interpreter's exit flushes it through freed handles, which crashes
    the process (a dead kernel). So the first failed write moves the file into memory, where HDF5 finishes and
    closes it normally; the failure is raised afterwards, and the partial file deleted.
    """

    def __init__(self, fh: io.BufferedRandom) -> None:
        self.fh: io.BufferedRandom | io.BytesIO = fh
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        return self._guarded("write", data)

    def truncate(self, size: int) -> int:  # HDF5 sets the file's length when it closes it: this may grow it
        return self._guarded("truncate", size)

    def _guarded(self, name: str, arg: object) -> int:
        if self.error is None:
            at = self.fh.tell()
            try:
                return getattr(self.fh, name)(arg)
            except OSError as exc:
                self.error = exc
                self.fh = self._in_memory(at)
        return getattr(self.fh, name)(arg)

    def _in_memory(self, at: int) -> io.BytesIO:
        copy = io.BytesIO()
        with contextlib.suppress(OSError):  # what reached the disk so far, for HDF5 to read back
            self.fh.seek(0)
            copy.write(self.fh.read())
        with contextlib.suppress(OSError):  # its buffer cannot be written either
            self.fh.close()
        copy.seek(at)
        return copy

    def __getattr__(self, name: str) -> object:  # read, readinto, seek, tell, flush
        return getattr(self.fh, name)


def _write_netcdf(out: xr.Dataset | xr.DataTree, tmp: Path, path: Path) -> None:
    """Write a netCDF file; a failed write (a full disk) raises OSError and leaves HDF5 healthy."""
    with open(tmp, "w+b") as fh:
        target = _SpillOnFailure(fh)
        out.to_netcdf(target, engine="h5netcdf")
        target.flush()
    if target.error is not None:
        raise OSError(target.error.errno, f"path: could not write {path} ({target.error.strerror}); any file "
                                          "there was left as it was")


def _check_writable(trace: xr.Dataset | xr.DataTree, path: Path) -> None:
    """Refuse, before the disk is touched, what is no trace of any schema version (attrs stripped: ``load`` could
    never read it back), then a folder no file can be created in (``/proc``, a read-only mount): one empty probe.
    A trace of another version or with edited values is written as it is (``load`` names what is wrong with it)."""
    if _plain(trace.attrs.get("schema_version")) is None:
        raise TraceFileError("trace: the trace is not a vitcam_nb trace (no schema_version attribute: were its attrs "
                             "stripped?); vitcam_nb.load could not read it back. Save the trace vc.trace gave")
    probe = path.with_name(f".{path.name}.probe-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        raise TraceFileError(f"path: cannot write {path}: {exc.strerror or exc} ({probe.parent}); save to a folder "
                             "this process can write to") from exc
    os.close(fd)
    probe.unlink()


def save(trace: xr.Dataset | xr.DataTree, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write a trace atomically (temporary name, then rename) with a content checksum in its attrs.

    An existing path is replaced only when it holds a single trace written by :func:`save`, and for a zarr
    folder only when every file in it, at any depth, is one a zarr writer makes; anything else (another
    program's file or folder, a file kept inside a saved trace, a ``trace_many`` store) is refused
    (:class:`~vitcam_nb.OutputExistsError`, a ``TraceFileError``) unless ``overwrite=True``.

    Example:
        >>> import tempfile, numpy as np, xarray as xr
        >>> ds = xr.Dataset({"a": ("x", np.arange(3.0))}, attrs={"schema_version": 1})
        >>> p = save(ds, tempfile.mkdtemp() + "/t.nc")
        >>> p.name
        't.nc'
    """
    path, overwrite = as_path("path", path), as_flag("overwrite", overwrite)
    if not isinstance(trace, (xr.Dataset, xr.DataTree)):
        raise ArgumentTypeError(f"trace: expected an xarray.Dataset (or DataTree) from vitcam_nb.trace(), "
                                f"got {type(trace).__name__}")
    if trace.attrs.get("store_kind") == MAPS_STORE_KIND:  # zarr would fail half-way on its string arrays
        where = trace.encoding.get("source", "") if isinstance(trace, xr.Dataset) else ""
        raise ArgumentTypeError("trace: this is a map store from vc.open_maps (or one of its images), not a trace; "
                                "vc.map_many already wrote it" + (f" to {where}" if where else "")
                                + ": copy that folder to keep it elsewhere")
    kind = _format(path)
    if not path.parent.exists():
        raise TraceFileError(f"path: folder {path.parent} does not exist")
    if not path.parent.is_dir():
        raise TraceFileError(f"path: {path.parent} is a file, not a folder; {path.name} cannot be written inside it")
    _check_writable(trace, path)
    if path.exists() and not overwrite:
        _check_overwrite(path, kind)
    if overwrite and kind == "netcdf" and path.is_dir():
        raise OutputExistsError(f"path: {path} is a folder; a .nc trace is one file. Use another path")
    out = trace.copy(deep=False)
    out.attrs = {**trace.attrs, CHECKSUM_ATTR: _checksum(trace)}
    nodes = [n.to_dataset(inherit=False) for n in out.subtree] if isinstance(out, xr.DataTree) else [out]
    for attrs in (node.attrs for node in nodes):
        for bad in [k for k, v in attrs.items() if isinstance(v, (bool, np.bool_))
                    or not isinstance(v, (str, int, float, np.integer, np.floating))]:
            raise TraceFileError(f"trace: attribute {bad!r} is {type(attrs[bad]).__name__}; only str, int and "
                                 "float attributes can be stored (store a flag as int(...))")
        # HDF5 stores a netCDF string attribute NUL-terminated: h5py refuses one holding a NUL character.
        for bad in [k for k, v in attrs.items() if kind == "netcdf" and isinstance(v, str) and "\x00" in v]:
            raise TraceFileError(f"trace: attribute {bad!r} holds a NUL character, which netCDF cannot store; remove "
                                 "it, or save to a .zarr path")
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        if kind == "netcdf":
            _write_netcdf(out, tmp, path)
            os.replace(tmp, path)
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out.to_zarr(tmp, mode="w", zarr_format=2, consolidated=True)
            except OSError as exc:
                if isinstance(exc, PermissionError) or exc.errno is None:
                    raise
                # the same words as a netCDF write that fails; the temporary folder is removed below
                raise OSError(exc.errno, f"path: could not write {path} ({exc.strerror or os.strerror(exc.errno)}); "
                                         "any file there was left as it was") from exc
            old = None
            if path.is_file():
                path.unlink()  # overwrite=True over a file: the folder takes its place
            elif path.exists():
                old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
                os.replace(path, old)
            os.replace(tmp, path)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    except PermissionError as exc:
        raise TraceFileError(f"path: cannot write {path}: {exc.strerror} ({exc.filename}); save to a folder this "
                             "process can write to") from exc
    finally:
        if tmp.exists():
            remove_unfinished_folder(tmp) if tmp.is_dir() else tmp.unlink()
    return path


#: A variable the trace schema does not define is read only up to this size, or the size of the largest one it does
#: define in the file (a user's small extra array is kept; a foreign file's huge one is not allocated).
FOREIGN_BYTES = 64 * 2**20
_SCHEMA_NAMES = frozenset({*VARIABLES, *COORDINATES, *ROOT_COORDS, *(f"{p}{c}" for p in ("query_", "key_")
                                                                     for c in COORDINATES), "channel"})


def _declared(path: Path, kind: str) -> list[tuple[str, tuple[str, ...], tuple[int, ...], int]]:
    """(name, dims, shape, bytes) of every array the file declares, read from its metadata alone (a child node's
    arrays named by their path)."""
    out: list[tuple[str, tuple[str, ...], tuple[int, ...], int]] = []
    if kind == "netcdf":
        import h5py

        def visit(name: str, obj: object) -> None:
            if not isinstance(obj, h5py.Dataset) or str(obj.attrs.get("NAME", b"")).find("not a netCDF variable") >= 0:
                return  # a netCDF dimension without a variable: xarray reads no array for it
            if "DIMENSION_LIST" in obj.attrs:
                dims = tuple(f[refs[0]].name.rpartition("/")[2] for refs in obj.attrs["DIMENSION_LIST"])
            elif obj.is_scale:  # a coordinate: its own dimension
                dims = (name.rpartition("/")[2],)
            else:  # no dimension scales: dimensions of its own, compared with no other array's
                dims = tuple(f"{name}:{i}" for i in range(obj.ndim))
            out.append((name, dims, tuple(obj.shape), int(obj.size) * obj.dtype.itemsize))

        with h5py.File(path, "r") as f:
            f.visititems(visit)
    else:
        import zarr

        for name, member in zarr.open_group(str(path), mode="r").members(max_depth=None):
            if isinstance(member, zarr.Array):
                dims = getattr(member.metadata, "dimension_names", None) or member.attrs.get("_ARRAY_DIMENSIONS", ())
                out.append((name, tuple(dims), tuple(member.shape), int(member.nbytes)))
    return out


def _check_shapes(path: Path, arrays: list, max_bytes: float | None) -> None:
    """Refuse, before anything is read, arrays of one node that disagree on a dimension's size, and (unless
    ``max_bytes`` says the size is meant) a variable the trace schema does not define that is larger than any it
    does and than :data:`FOREIGN_BYTES`."""
    sizes: dict[tuple[str, str], tuple[int, str]] = {}
    for name, dims, shape, _ in arrays:
        for dim, n in zip(dims, shape):
            seen = sizes.setdefault((name.rpartition("/")[0], dim), (n, name))
            if seen[0] != n:
                raise TraceFileError(f"path: {path} declares {name!r} with dimension {dim!r} of size {n}, and "
                                     f"{seen[1]!r} with {seen[0]}; a trace's arrays agree on their dimensions. It "
                                     "is damaged or not a trace; nothing was read")
    known = [b for name, _, _, b in arrays if name.rpartition("/")[2] in _SCHEMA_NAMES]
    cap = max([FOREIGN_BYTES, *known])
    for name, _, shape, nbytes in arrays:
        if max_bytes is None and name.rpartition("/")[2] not in _SCHEMA_NAMES and nbytes > cap:
            raise TraceFileError(f"path: {path} declares {name!r} of shape {shape} ({nbytes / 1e9:.2f} GB), an array "
                                 f"the trace schema does not define, larger than any it does ({cap / 1e6:.0f} MB); "
                                 "nothing was read. If this trace really holds it, pass max_bytes to load it")


def _check_declared(path: Path, kind: str, max_bytes: float | None) -> None:
    """Refuse a file declaring more than the memory budget, arrays that disagree on their dimensions, or a large
    array the schema does not define, before anything is allocated: a small damaged or hostile file can declare
    arrays of any size, and reading it would allocate them."""
    from vitcam_nb.capture.budget import BUDGET_FRACTION, available_bytes, check_max_bytes

    check_max_bytes(max_bytes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            arrays = _declared(path, kind)
    except Exception as exc:  # h5py/zarr raise many types for a damaged file; the user needs one answer
        raise TraceFileError(f"path: {path} could not be read as a {kind} trace "
                             f"(truncated, corrupted or not a trace): {exc}") from exc
    available = available_bytes()
    limit = max_bytes if max_bytes is not None else None if available is None else BUDGET_FRACTION * available
    total = sum(a[3] for a in arrays)
    if limit is not None and total > limit:
        name, _, shape, _ = max(arrays, key=lambda a: a[3])
        what = "max_bytes" if max_bytes is not None else f"{BUDGET_FRACTION:.0%} of the available memory"
        raise TraceFileError(f"path: {path} declares {total / 1e9:.2f} GB of arrays (the largest, {name!r}, of "
                             f"shape {shape}), over the budget of {limit / 1e9:.2f} GB ({what}); nothing was read. A "
                             "damaged file can declare any size: if this trace is really that large, pass a larger "
                             "max_bytes")
    _check_shapes(path, arrays, max_bytes)


def load(path: str | os.PathLike, *, verify: bool = True, max_bytes: float | None = None) -> xr.Dataset | xr.DataTree:
    """Read a trace written by :func:`save` fully into memory and verify its checksum and schema (a
    hierarchical trace comes back as a DataTree).

    The sizes the file declares are checked against ``max_bytes`` (None: half the available memory, as a
    trace's budget) before anything is read, and the content against the schema after.

    Example:
        >>> import tempfile, numpy as np, xarray as xr
        >>> ds = xr.Dataset({"a": ("x", np.arange(3.0))}, attrs={"schema_version": 1})
        >>> p = save(ds, tempfile.mkdtemp() + "/t.zarr")
        >>> bool((load(p)["a"] == ds["a"]).all())
        True
    """
    path = as_path("path", path)
    kind = _format(path)
    if not path.exists():
        raise TraceFileError(f"path: {path} does not exist")
    if "store_kind" in (_top_attrs(path) or {}):
        raise TraceFileError(f"path: {path} is a trace_many store of many images; open it with "
                             "vitcam_nb.open_traces(path) (vitcam_nb.image_trace(store, i) gives one image's trace)")
    _check_declared(path, kind, max_bytes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = {"engine": "h5netcdf"} if kind == "netcdf" else {"engine": "zarr", "consolidated": True}
            with xr.open_datatree(path, **engine) as lazy:
                ds = lazy.load() if lazy.children else lazy.to_dataset().load()
    except Exception as exc:  # h5py/zarr raise many types for a damaged file; the user needs one answer
        raise TraceFileError(f"path: {path} could not be read as a {kind} trace "
                             f"(truncated, corrupted or not a trace): {exc}") from exc
    _check_schema(path, ds)
    stored = ds.attrs.pop(CHECKSUM_ATTR, None)
    if isinstance(ds, xr.DataTree):
        ds = xr.DataTree.from_dict({node.path: _clean(node.to_dataset(inherit=False)) for node in ds.subtree})
    else:
        ds = _clean(ds)
    if verify:
        if stored is None:
            raise TraceFileError(f"path: {path} has no {CHECKSUM_ATTR}; it was not written by vitcam_nb.save "
                                 "(pass verify=False to read it anyway)")
        actual = _checksum(ds)
        if actual != stored:
            raise TraceFileError(f"path: {path} failed its checksum (stored {stored[:12]}…, content "
                                 f"{actual[:12]}…): the file is corrupted or was modified")
    ds.encoding[CHECKSUM_ATTR] = stored
    return ds


def _check_schema(path: Path, ds: xr.Dataset | xr.DataTree) -> None:
    """Refuse what is no trace of a schema this version reads: a foreign file, another schema version, bad
    attributes or variables (checked before the checksum, which reads them all)."""
    version = _plain(ds.attrs.get("schema_version"))
    if version is None:
        raise TraceFileError(f"path: {path} is not a vitcam_nb trace (no schema_version attribute)")
    if not is_int(version) or int(version) not in SUPPORTED_SCHEMAS:
        raise TraceFileError(f"path: {path} has schema_version {repr(version)[:40]}; this vitcam_nb reads "
                             f"{list(SUPPORTED_SCHEMAS)}. Re-trace the model, or load it with the vitcam_nb "
                             "version that wrote it and save again")
    nodes = [n.to_dataset(inherit=False) for n in ds.subtree] if isinstance(ds, xr.DataTree) else [ds]
    found = [p for node in nodes for p in problems(node)]
    checksum = ds.attrs.get(CHECKSUM_ATTR)
    if checksum is not None and not isinstance(checksum, str):
        found.append(f"attribute {CHECKSUM_ATTR!r} is {type(checksum).__name__}, not a str")
    if found:
        raise TraceFileError(f"path: {path} is a damaged or edited trace: " + "; ".join(found[:5]))
