"""Writing the kit's own output files (an exported page, the demo's outputs). A path is replaced only when
vitcam_nb wrote what is there (anything else is refused unless ``overwrite=True``), and every file is written
under a temporary name in the same folder and renamed over the path at the end: a failure (a full disk) leaves
the old file whole and no partial or temporary file behind. A folder of outputs keeps a manifest of the files
the kit wrote there with their SHA-256, so a file the user changed since is theirs again.

Example:
    >>> import tempfile
    >>> p = write_atomic(Path(tempfile.mkdtemp()) / "a.txt", b"hi")
    >>> p.read_bytes()
    b'hi'
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from vitcam_nb.core.arguments import as_flag
from vitcam_nb.core.errors import OutputExistsError, TraceFileError
from vitcam_nb.core.provenance import file_sha256

__all__ = ["MANIFEST", "OutputFolder", "check_output", "remove_unfinished_folder", "replacing", "write_atomic"]

#: The manifest of an output folder: {"written_by": ..., "files": {name: sha256}}.
MANIFEST = ".vitcam_nb-outputs.json"


def check_output(path: Path, *, overwrite: bool, ours: Callable[[Path], bool], what: str) -> None:
    """Refuse a path whose folder is missing or cannot be written, that is a folder, or that holds a file
    ``ours`` does not recognise as one vitcam_nb wrote (unless ``overwrite``, which must be True or False).

    Example:
        >>> check_output(Path("/nonexistent/x.html"), overwrite=False, ours=bool, what="page")
        Traceback (most recent call last):
        ...
        vitcam_nb.core.errors.TraceFileError: path: folder /nonexistent does not exist
    """
    overwrite = as_flag("overwrite", overwrite)
    if not path.parent.is_dir():
        raise TraceFileError(f"path: folder {path.parent} does not exist")
    if path.is_dir():
        raise OutputExistsError(f"path: {path} is a folder; the {what} is one file. Use another path")
    if path.exists() and not overwrite and not ours(path):
        raise OutputExistsError(f"path: {path} exists and is not a {what} vitcam_nb wrote; it is left alone. Use "
                                "another path, or overwrite=True (--overwrite) to replace it")
    # The file is written beside itself and renamed, so its folder must take a new file. Permission bits do not say
    # it (root ignores them; a read-only mount such as /sys refuses root too), so a probe file is made and removed,
    # before anything is computed.
    try:
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.probe-")
    except OSError as exc:
        raise TraceFileError(f"path: cannot write {path}: folder {path.parent} cannot be written ({exc.strerror}); "
                             f"nothing was computed. Write the {what} in a folder this process can write to") from exc
    os.close(fd)
    os.unlink(probe)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed over ``path`` when the block ends without an
    error, removed in every case.

    Example:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "b.txt"
        >>> with replacing(target) as tmp:
        ...     _ = tmp.write_text("done")
        >>> target.read_text()
        'done'
    """
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def remove_unfinished_folder(folder: Path) -> None:
    """Remove the temporary folder of a zarr write that failed, once zarr has stopped writing into it.

    zarr writes an array's chunks as concurrent tasks on its own event loop and, when one fails (a full
    disk), lets the others run on: removing the folder at once races with them, and a chunk written after the
    removal leaves a half-written temporary folder behind. Waiting for zarr's pending tasks first closes that.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp()) / ".t.zarr.tmp-1"
        >>> folder.mkdir()
        >>> remove_unfinished_folder(folder)
        >>> folder.exists()
        False
    """
    _wait_for_zarr_writes()
    shutil.rmtree(folder, ignore_errors=True)


def _wait_for_zarr_writes(timeout: float = 60.0) -> None:
    """Wait (up to ``timeout`` s) for every task on zarr's event loop to end; nothing when zarr was not used."""
    sync = getattr(sys.modules.get("zarr.core.sync"), "sync", None)
    if sync is None:
        return

    async def pending() -> None:
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    sync(pending())


def write_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename (see :func:`replacing`).

    Example:
        >>> import tempfile
        >>> write_atomic(Path(tempfile.mkdtemp()) / "c.bin", b"x").stat().st_size
        1
    """
    path = Path(path)
    with replacing(path) as tmp:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return path


class OutputFolder:
    """A folder of named outputs: on creation, every name that exists must be a file the kit wrote there and
    left unchanged (its manifest entry and SHA-256 agree) unless ``overwrite`` (True or False); a ``root`` that is
    a file is refused. Creating it checks only and creates nothing (the caller makes ``root`` before the first
    write); each :meth:`write` is atomic and recorded in the manifest at once.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> OutputFolder(root, ["r.txt"], "demo").write("r.txt", lambda p: p.write_text("1")).read_text()
        '1'
        >>> OutputFolder(root, ["r.txt"], "demo").write("r.txt", lambda p: p.write_text("2")).read_text()
        '2'
    """

    def __init__(self, root: Path, names: Sequence[str], written_by: str, *, overwrite: bool = False) -> None:
        overwrite = as_flag("overwrite", overwrite)
        self.root, self.written_by = Path(root), written_by
        if self.root.exists() and not self.root.is_dir():
            raise OutputExistsError(f"path: {self.root} is a file; the outputs are written into a folder. Use a "
                                    "folder path")
        manifest = self.root / MANIFEST
        self.files: dict[str, str] = {}
        if manifest.exists():
            try:
                data = json.loads(manifest.read_text(encoding="utf-8"))
                self.files = {str(k): str(v) for k, v in dict(data["files"]).items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                if not overwrite:
                    raise OutputExistsError(f"path: {manifest} is not a manifest vitcam_nb wrote; the folder is left "
                                            "alone. Use another folder, or overwrite=True (--overwrite)") from None
        for name in names:
            path = self.root / name
            if path.is_dir():
                raise OutputExistsError(f"path: {path} is a folder; it is left alone. Use another folder")
            changed = path.exists() and (name not in self.files or file_sha256(path) != self.files[name])
            if changed and not overwrite:
                raise OutputExistsError(f"path: {path} exists and is not a file vitcam_nb wrote there (or it changed "
                                        "since); it is left alone. Use another folder, or overwrite=True "
                                        "(--overwrite) to replace it")

    def write(self, name: str, writer: Callable[[Path], object]) -> Path:
        """Write output ``name`` with ``writer(temporary path)``, rename it into place and record it.

        Example:
            >>> folder.write("notes.txt", lambda p: p.write_text("x"))  # doctest: +SKIP
        """
        path = self.root / name
        with replacing(path) as tmp:
            writer(tmp)
        return self.record(name)

    def record(self, name: str) -> Path:
        """Record output ``name``, written in place by a writer that is atomic itself (``vc.save``).

        Example:
            >>> folder.record("trace.nc")  # doctest: +SKIP
        """
        self.files[name] = file_sha256(self.root / name)
        body = json.dumps({"written_by": self.written_by, "files": self.files}, indent=1, sort_keys=True)
        write_atomic(self.root / MANIFEST, body.encode("utf-8"))
        return self.root / name
