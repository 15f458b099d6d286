"""Replacing a store that a ``trace_many`` or ``map_many`` call with ``overwrite=True`` found at its path.

The old store stays where it is, whole and locked, while the new call checks its arguments and computes its first
batch; only when that batch is ready to be written is the old store moved aside, the new one created in its place,
and the old one removed. A call refused before that, or a creation that fails, leaves the old store as it was.

Example:
    >>> import tempfile
    >>> from vitcam_nb.capture.store_lock import StoreLock
    >>> path = Path(tempfile.mkdtemp()) / "s.zarr"
    >>> path.mkdir(); _ = (path / "old").write_text("old")
    >>> lock = StoreLock(path); lock.acquire()
    >>> replace_store(path, lambda: path.mkdir() or "new", lock)
    'new'
    >>> sorted(p.name for p in path.parent.iterdir()), lock.held
    (['s.zarr'], False)
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from vitcam_nb.capture.store_lock import StoreLock

__all__ = ["replace_store", "tree_bytes"]

T = TypeVar("T")


def replace_store(path: Path, create: Callable[[], T], lock: StoreLock) -> T:
    """Create a new store at ``path`` with ``create()`` in place of the old store there, and remove the old one once
    the new one exists; a failed ``create`` puts the old store back. ``lock`` is the old store's lock, held until
    then and released after (its file went with the old store); the new store's lock is the caller's to take.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "s.zarr"
        >>> path.mkdir()
        >>> def fails():
        ...     raise OSError("disk full")
        >>> replace_store(path, fails, StoreLock(path))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        OSError: disk full
        >>> path.is_dir()
        True
    """
    old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(path, old)
    try:
        made = create()
    except BaseException:
        if not path.exists():  # another call may have created its store there meanwhile: that one is kept
            os.replace(old, path)
        raise
    lock.release()
    shutil.rmtree(old, ignore_errors=True)
    return made


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (a store about to be replaced: disk space the replacement frees).

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "a").write_bytes(b"abc")
        >>> tree_bytes(folder)
        3
    """
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)
