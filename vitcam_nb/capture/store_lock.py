"""One writer per ``trace_many`` store: a lock file inside the store, held while a call writes to it.

The lock is ``<store>/.vitcam_nb.lock``. Holding it means holding an exclusive ``flock`` on that file: the kernel
arbitrates, so of several calls that find the same lock free (or stale) exactly one gets it, and a writer that dies
(a crash, a kill) lets go of it at once. The file names the writer (process id, host, start time, and a token the
workers of a sharded call check before they write) for the message a refused call gives. A worker writes a batch
while holding a shared ``flock`` on the store's folder (:func:`batch_writing`), and a call that takes the lock waits
until no worker holds it: a batch an earlier, interrupted call sent either finished writing before the new call
touches the store, or finds the new call's token and writes nothing. A second call refuses with
:class:`TraceFileError` naming the writer. A lock file that no process holds is stale and is taken over when it
names a process of this host that is gone, or nobody at all (an empty or garbled file); one naming a live process (a
writer of an older vitcam_nb, which did not flock) or a process on another host is left alone: delete the file by
hand once that writer is gone.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> store = Path(tempfile.mkdtemp())
    >>> with StoreLock(store):
    ...     (store / LOCK_NAME).exists()
    True
    >>> (store / LOCK_NAME).exists()
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

__all__ = ["LOCK_NAME", "StoreLock", "batch_writing", "lock_entry_ignored"]

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


def _pid(owner: dict) -> int | None:
    """The process id a lock file names, None for anything that is not a positive int (a garbled file)."""
    pid = owner.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def _flock(fd: int) -> bool:
    """Take an exclusive lock on ``fd`` without waiting: True when taken, False when another holder has it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


#: How long taking a store's lock waits for the batches workers are writing into it (seconds).
WRITES_TIMEOUT = 600.0


@contextlib.contextmanager
def batch_writing(path: Path) -> Iterator[None]:
    """On a worker, around writing one batch's chunks into the store at ``path``: a shared ``flock`` on the store's
    folder, which a call taking the store's lock waits for (:meth:`StoreLock.acquire`). Check the sender's token
    inside it: a call that took the lock meanwhile has its own token there by then. On a filesystem that cannot
    lock a folder (NFS emulates ``flock`` with record locks, which a folder cannot take exclusively), the token
    check alone guards the write, as it did before this lock.

    Example:
        >>> import tempfile
        >>> with batch_writing(Path(tempfile.mkdtemp())):
        ...     pass
    """
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError as exc:
            if not _no_folder_locks(exc):
                raise
        yield
    finally:
        os.close(fd)  # lets go of the flock


def _no_folder_locks(exc: OSError) -> bool:
    """Whether ``exc`` says the filesystem cannot ``flock`` a folder (NFS: ``EBADF`` for an exclusive lock on a
    read-only descriptor; others: no locks at all)."""
    import errno

    return exc.errno in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


def _sleep(seconds: float) -> None:
    # One name for the wait between polls, so that a test can see a call waiting without timing it.
    time.sleep(seconds)


def _wait_for_batch_writes(folder: Path) -> None:
    """Wait until no worker holds :func:`batch_writing` on ``folder``; refuse after :data:`WRITES_TIMEOUT`. A
    filesystem that cannot lock a folder is not waited on (see :func:`batch_writing`)."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY)
    try:
        deadline = time.monotonic() + WRITES_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TraceFileError(f"path: a worker has been writing a batch into {folder} for "
                                         f"{WRITES_TIMEOUT:.0f} s after the call that sent it stopped; rerun once "
                                         "it has finished") from None
                _sleep(0.05)
            except OSError as exc:
                if _no_folder_locks(exc):
                    return
                raise
    finally:
        os.close(fd)


def _writer(owner: dict) -> str:
    """The kind of call that holds a lock ("trace_many", "vc.score", "map_many"); locks written before 0.2 do not
    say."""
    writer = owner.get("writer")
    return writer if writer in ("trace_many", "vc.score", "map_many") else "trace_many"


class StoreLock:
    """The lock of the store at ``path``: :meth:`acquire` before writing, :meth:`release` after (idempotent;
    only this lock's own file is removed), or ``with StoreLock(path):`` around the writes.

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

    def __init__(self, path: Path, writer: str = "trace_many"):
        self.file = Path(path) / LOCK_NAME
        self.writer = writer  # what is writing, named in the lock file and in a second writer's refusal
        self.token = uuid.uuid4().hex
        self.held = False
        self._fd: int | None = None

    def __enter__(self) -> StoreLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _owner(self) -> dict:
        try:
            owner = json.loads(self.file.read_text())
        except (OSError, ValueError):  # being written this instant, garbled, or not ours to read
            return {}
        return owner if isinstance(owner, dict) else {}

    def _refuse(self, owner: dict, why: str = "") -> TraceFileError:
        pid, host = _pid(owner), owner.get("host")
        since = owner.get("since", "an unknown time")
        if pid is None:
            who = "a process that has not named itself yet (the lock file is empty or garbled)"
        elif why == "" and host == socket.gethostname() and not _alive(pid):
            who = f"a process taking over the stale lock of process {pid}"
        else:
            who = f"process {pid} on {host}, since {since}"
        return TraceFileError(
            f"path: {self.file.parent} is being written by another {_writer(owner)} call ({who}){why}; one store has "
            f"one writer. Rerun once it has finished to resume; if that writer is gone for good (another machine, "
            f"or a reused process id), delete {self.file}")

    def _open(self) -> int:
        try:
            return os.open(self.file, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as exc:
            raise TraceFileError(f"path: cannot create the lock file {self.file} ({exc.strerror}); a store is "
                                 "written only in a folder this process can write to") from exc

    def acquire(self) -> None:
        """Take the lock, or refuse (``TraceFileError``) while another writer holds it."""
        if self.held:
            return
        for _ in range(8):  # a retry follows a holder's removal of the file between our open and our flock
            fd = self._open()
            try:
                try:
                    taken = _flock(fd)
                except OSError as exc:  # a filesystem without locks (some network mounts)
                    raise TraceFileError(f"path: the filesystem of {self.file.parent} does not support file locks "
                                         f"({exc.strerror}); write the store to a local folder") from exc
                owner = self._owner()
                if not taken:
                    raise self._refuse(owner)
                try:
                    same = os.path.samestat(os.fstat(fd), os.stat(self.file))
                except FileNotFoundError:
                    same = False
                if not same:  # we locked a file its holder removed on release: open the new one
                    os.close(fd)
                    continue
                pid, host = _pid(owner), owner.get("host")
                if pid is not None and pid != os.getpid() and (
                        host != socket.gethostname() or _alive(pid)):
                    # No flock held, yet it names a writer that may be running: an older vitcam_nb's lock (it
                    # did not flock), or a writer on another host whose locks this host may not see.
                    raise self._refuse(owner, " and holds no file lock; it may be an older vitcam_nb")
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": self.token,
                                         "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                                         "writer": self.writer}).encode())
                # Our token is in the file now: a batch still being written was sent by an earlier call, and
                # its worker checked that call's token before this; let it finish before this call goes on.
                _wait_for_batch_writes(self.file.parent)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self.held = fd, True
            return
        raise TraceFileError(f"path: could not take the lock {self.file}; another call keeps taking it")

    def release(self) -> None:
        """Remove the lock file if this lock holds it (while still holding it, so nobody takes a removed file)."""
        if self._fd is None:
            self.held = False
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(self._fd), os.stat(self.file)):
                    self.file.unlink()
        finally:
            os.close(self._fd)
            self._fd, self.held = None, False
