"""One writer per ``trace_many`` store: a lock file inside the store, held while a call writes to it.

The lock is ``<store>/.vitcam_nb.lock``, created exclusively (``O_CREAT | O_EXCL``) and holding the writer's
process id, host and start time. A second call that finds it refuses with :class:`TraceFileError` naming the
writer. A stale lock (its process on this host is gone, e.g. after a crash or a kill) is taken over; a lock
written on another host is never judged stale here: delete the file by hand once that writer is gone.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> store = Path(tempfile.mkdtemp())
    >>> lock = StoreLock(store)
    >>> lock.acquire(); (store / LOCK_NAME).exists()
    True
    >>> lock.release(); (store / LOCK_NAME).exists()
    False
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

from vitcam_nb.core.errors import TraceFileError

__all__ = ["LOCK_NAME", "StoreLock", "lock_entry_ignored"]

LOCK_NAME = ".vitcam_nb.lock"


@contextlib.contextmanager
def lock_entry_ignored() -> Iterator[None]:
    """Silence zarr's warning about the lock file, the one non-zarr entry a store holds while it is written.

    Example:
        >>> with lock_entry_ignored():
        ...     pass
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f"Object at {LOCK_NAME} is not recognized")
        yield


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


class StoreLock:
    """The lock of the store at ``path``: :meth:`acquire` before writing, :meth:`release` after (idempotent;
    only this lock's own file is removed).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> store = Path(tempfile.mkdtemp())
        >>> first, second = StoreLock(store), StoreLock(store)
        >>> first.acquire()
        >>> second.acquire()  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceFileError: path: ... is being written by another trace_many call ...
        >>> first.release()
    """

    def __init__(self, path: Path):
        self.file = Path(path) / LOCK_NAME
        self.token = uuid.uuid4().hex
        self.held = False

    def _owner(self) -> dict:
        try:
            return json.loads(self.file.read_text())
        except (OSError, ValueError):  # being written this instant, or not ours to read: treat as held
            return {}

    def acquire(self) -> None:
        """Take the lock, or refuse (``TraceFileError``) while another writer holds it."""
        for _ in range(2):  # the second try follows the removal of a stale lock
            try:
                fd = os.open(self.file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                pid, host = owner.get("pid"), owner.get("host")
                if isinstance(pid, int) and host == socket.gethostname() and not _alive(pid):
                    # Renamed away, not deleted: of two calls finding the same stale lock, only one moves it.
                    try:
                        os.replace(self.file, self.file.with_name(f"{LOCK_NAME}.stale-{self.token}"))
                        os.remove(self.file.with_name(f"{LOCK_NAME}.stale-{self.token}"))
                    except FileNotFoundError:
                        pass
                    continue
                since = owner.get("since", "an unknown time")
                raise TraceFileError(
                    f"path: {self.file.parent} is being written by another trace_many call (process {pid} on "
                    f"{host}, since {since}); one store has one writer. Rerun once it has finished to resume; if "
                    f"that writer is gone for good (another machine, or a reused process id), delete "
                    f"{self.file}") from None
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "token": self.token,
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
            self.held = True
            return
        raise TraceFileError(f"path: could not take the lock {self.file}; another call keeps taking it")

    def release(self) -> None:
        """Remove the lock file if this lock holds it."""
        if self.held and self._owner().get("token") == self.token:
            self.file.unlink(missing_ok=True)
        self.held = False
