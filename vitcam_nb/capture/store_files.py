"""What is on disk at a store's path, checked before a store call writes there: the files a zarr writer makes (and
those it does not: a user's, kept in a store folder), whether the folder a new store is created in can be written,
and a full disk named by the path it was writing.

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> check_writable(folder, folder / "s.zarr")
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from pathlib import Path

from vitcam_nb.core.errors import OutputExistsError, TraceFileError

__all__ = ["DISK_FULL", "check_no_foreign", "check_writable", "disk_full_error", "foreign_files", "store_target"]

#: errno values of a write that failed for want of space: no space on the device, over the quota, over the file size
#: limit.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: Entries a store's own writer keeps in its folder besides zarr's files (the lock of a call writing it).
_OWN = (".vitcam_nb.lock",)


#: The metadata files a zarr v2 or v3 writer makes in a group's or an array's folder.
_ZARR_METADATA = frozenset({".zarray", ".zattrs", ".zgroup", ".zmetadata", "zarr.json"})
#: A chunk's key inside its array's folder: v2 ``0.0.1`` (or ``0/0/1``), v3 ``c/0/0`` (``c.0.0``; ``c`` for 0-d).
_CHUNK_KEY = re.compile(r"c|(c[./])?\d+([./]\d+)*")


def _node_kind(folder: Path) -> str | None:
    """"array" or "group" for a zarr node's folder (by its metadata file), None for any other folder."""
    if (folder / ".zarray").is_file():
        return "array"
    meta = folder / "zarr.json"
    if meta.is_file():
        try:
            return "array" if json.loads(meta.read_text()).get("node_type") == "array" else "group"
        except (OSError, ValueError, AttributeError):  # unreadable or not an object: holds no chunks of ours
            return "group"
    return "group" if (folder / ".zgroup").is_file() else None


def foreign_files(path: Path) -> list[str]:
    """Every file or folder of a zarr store, at any depth, that no zarr writer made (another program's files kept
    in it): a zarr writer makes only node folders, their metadata files, and chunk files in an array's folder.

    Example:
        >>> import tempfile, zarr
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = zarr.open_group(str(folder), mode="w").create_array("a", shape=(2,), dtype="f4")
        >>> _ = (folder / "a" / "notes.txt").write_text("mine")
        >>> foreign_files(folder)
        ['a/notes.txt']
    """
    out: list[str] = []

    def visit(folder: Path, array: Path | None) -> None:
        kind = _node_kind(folder)
        if kind is not None:
            array = folder if kind == "array" else None
        elif array is None:  # a folder in a group that is no node: not zarr's
            out.append(f"{folder.relative_to(path).as_posix()}/")
            return
        for entry in sorted(folder.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                visit(entry, array)
            elif not (entry.is_file() and not entry.is_symlink() and (
                    (kind is not None and entry.name in _ZARR_METADATA)
                    or (array is not None and _CHUNK_KEY.fullmatch(entry.relative_to(array).as_posix())))):
                out.append(entry.relative_to(path).as_posix())

    visit(path, None)
    return out


def check_no_foreign(path: Path) -> None:
    """Refuse to replace (``overwrite=True``) a store folder holding files no zarr writer made, naming them: the
    replacement removes the whole folder, and a user's files kept in it would go with it.

    Example:
        >>> import tempfile, zarr
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = zarr.open_group(str(folder), mode="w")
        >>> check_no_foreign(folder)
        >>> _ = (folder / "notes.txt").write_text("mine")
        >>> check_no_foreign(folder)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        OutputExistsError: path: ... holds files no store writer made (notes.txt) ...
    """
    found = [f for f in foreign_files(path) if f not in _OWN]
    if found:
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        raise OutputExistsError(f"path: {path} holds files no store writer made ({', '.join(found[:5])}{more}); "
                                "overwrite=True replaces the whole folder and would delete them. Move them out of "
                                "the store, or use a new path")


def check_writable(folder: Path, path: Path) -> None:
    """Refuse, before any pass, a folder a new store (``path``, made in a temporary folder beside it and renamed)
    cannot be created in: a file is created there and removed again. Permission bits alone do not say it (root
    ignores them; a read-only mount or a full quota refuses root too), so the probe writes.

    Example:
        >>> import tempfile
        >>> check_writable(Path(tempfile.mkdtemp()), Path("s.zarr"))
    """
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.probe-")
    except OSError as exc:
        raise TraceFileError(f"path: cannot create {path}: {folder} cannot be written ({exc.strerror}); write the "
                             "store in a folder this process can write to") from exc
    os.close(fd)
    os.unlink(probe)


def disk_full_error(path: Path, exc: BaseException, kept: str) -> TraceFileError | None:
    """The kit's error for ``exc`` when it is a write that failed for want of space (else None), naming the store
    and saying what was ``kept``.

    Example:
        >>> str(disk_full_error(Path("s.zarr"), OSError(28, "No space left on device"), "nothing was written"))[:52]
        'path: writing s.zarr failed: No space left on device'
        >>> disk_full_error(Path("s.zarr"), OSError(13, "Permission denied"), "") is None
        True
    """
    if not isinstance(exc, OSError) or exc.errno not in DISK_FULL:
        return None
    return TraceFileError(f"path: writing {path} failed: {exc.strerror or os.strerror(exc.errno)}; {kept}. Free "
                          "space on that disk, or use another path")


def store_target(path: Path) -> Path:
    """Where a store at ``path`` is written: the folder a symlink leads to (written, resumed and replaced there,
    the link kept), else ``path``.

    Example:
        >>> store_target(Path("/nonexistent/s.zarr")).name
        's.zarr'
    """
    if not path.is_symlink():
        return path
    if not path.exists():
        raise TraceFileError(f"path: {path} is a symlink to {os.readlink(path)}, which does not exist; create that "
                             "folder's parent, or remove the link")
    return path.resolve()
