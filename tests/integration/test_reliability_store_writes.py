"""Issue #32, writing stores and trace files: the store lock taken over atomically (real processes racing),
empty or garbled lock files, a failed save on a full disk that leaves the process healthy, and read-only and
symlinked paths."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from store_trace import IMAGE, MODEL, TRACE

import vitcam_nb as vc
from vitcam_nb.capture.store_lock import LOCK_NAME, StoreLock

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, *args: object, **kwargs) -> subprocess.Popen:
    """A real Python process running ``code`` with this checkout first on its path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _wait_for(paths: list[Path], procs: list[subprocess.Popen]) -> None:
    """Wait until every path exists, failing at once when a process died with an error."""
    import time

    deadline = time.monotonic() + 120
    while not all(p.exists() for p in paths):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        assert not failed and time.monotonic() < deadline, [p.communicate() for p in failed]
        time.sleep(0.01)


# -- the lock ---------------------------------------------------------------------------------------------
# Each racer reads the stale lock, then waits until every racer has read it and every racer before it has
# finished its attempt: the window between reading a stale lock and replacing it, as wide as it can be, in
# the same order on every run (files as the barrier, no sleep decides the outcome).
# The lock module is imported alone (the package's own __init__ would import torch in every racer).
LOCK_ALONE = f"""
    import sys, types
    pkg = types.ModuleType("vitcam_nb")
    pkg.__path__ = [{str(ROOT / "vitcam_nb")!r}]
    sys.modules["vitcam_nb"] = pkg
    from vitcam_nb.capture.store_lock import StoreLock
"""
RACER = LOCK_ALONE + """
    import time
    from pathlib import Path

    store, i, n = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sync = store.parent / "sync"
    read = StoreLock._owner
    first = [True]

    def wait_for(paths):
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.002)

    def owner(self):
        out = read(self)
        if first[0]:
            first[0] = False
            (sync / f"read-{i}").touch()
            wait_for([sync / f"read-{j}" for j in range(n)])
            wait_for([sync / f"done-{j}" for j in range(i)])
        return out

    StoreLock._owner = owner
    lock = StoreLock(store)
    try:
        lock.acquire()
        result = "won"
    except Exception as exc:
        result = f"{type(exc).__name__}: {exc}"
    (sync / f"result-{i}").write_text(result)
    (sync / f"done-{i}").touch()
    if result == "won":
        wait_for([sync / "release"])
        lock.release()
"""


def test_racing_processes_taking_over_one_stale_lock_give_exactly_one_writer(tmp_path):
    store, n = tmp_path / "s.zarr", 4
    store.mkdir()
    (tmp_path / "sync").mkdir()
    dead = _dead_pid()
    (store / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "since": "then"}))
    procs = [_python(RACER, store, i, n) for i in range(n)]
    sync = tmp_path / "sync"
    try:
        # the losers exit by themselves; the winner holds the lock until "release" once every result is in
        _wait_for([sync / f"result-{i}" for i in range(n)], procs)
        results = {i: (sync / f"result-{i}").read_text() for i in range(n)}
        winners = [i for i, r in results.items() if r == "won"]
        assert len(winners) == 1, results
        holder = json.loads((store / LOCK_NAME).read_text())
        assert holder["pid"] == procs[winners[0]].pid
        for i, r in results.items():
            if i != winners[0]:
                assert r.startswith(f"TraceFileError: path: {store} is being written by another trace_many call"), r
    finally:
        (tmp_path / "sync" / "release").touch()
        outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, outs
    assert not (store / LOCK_NAME).exists()


def _half_store(path: Path) -> list[np.ndarray]:
    images = [IMAGE, 255 - IMAGE, IMAGE[::-1].copy()]
    vc.trace_many(MODEL, iter(images[:2]), path, targets="top1", sites=["F1"], progress=False)
    return images


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2]", '{"pid": null, "host": null}', '{"pid": -1}'])
def test_an_empty_or_garbled_lock_file_nobody_holds_is_taken_over(tmp_path, content):
    path = tmp_path / "s.zarr"
    images = _half_store(path)
    (path / LOCK_NAME).write_text(content)
    vc.trace_many(MODEL, images, path, targets="top1", sites=["F1"], progress=False)
    ds = vc.open_traces(path)
    assert ds.sizes["image"] == 3 and ds.attrs["complete"] == 1 and not (path / LOCK_NAME).exists()


HOLDER = LOCK_ALONE + """
    import fcntl, os
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_a_lock_held_by_a_live_process_refuses_with_a_clear_message_even_when_empty(tmp_path):
    path = tmp_path / "s.zarr"
    images = _half_store(path)
    holder = _python(HOLDER, path / LOCK_NAME, stdin=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(vc.TraceFileError, match=r"^path: .*s.zarr is being written by another trace_many call \("
                                                    r"a process that has not named itself yet .*delete .*\.lock$"):
            vc.trace_many(MODEL, images, path, targets="top1", sites=["F1"], progress=False)
        (path / LOCK_NAME).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "since": "now"}))
        with pytest.raises(vc.TraceFileError, match=rf"\(process {holder.pid} on .*, since now\); one store"):
            vc.trace_many(MODEL, images, path, targets="top1", sites=["F1"], progress=False)
    finally:
        holder.communicate("\n", timeout=60)
    assert vc.open_traces(path).sizes["image"] == 2  # nothing was written meanwhile
    # The holder is gone and its flock with it; its own pid (now dead) in the file is a stale lock.
    vc.trace_many(MODEL, images, path, targets="top1", sites=["F1"], progress=False)
    assert vc.open_traces(path).sizes["image"] == 3


def test_a_lock_naming_a_live_process_that_holds_no_flock_is_left_alone(tmp_path):
    """An older vitcam_nb wrote its lock without flock: while its process lives, the store is its."""
    path = tmp_path / "s.zarr"
    images = _half_store(path)
    alive = _python("import sys; sys.stdin.readline()", stdin=subprocess.PIPE)
    try:
        (path / LOCK_NAME).write_text(json.dumps({"pid": alive.pid, "host": socket.gethostname(), "since": "x"}))
        with pytest.raises(vc.TraceFileError, match=rf"\(process {alive.pid} on .*\) and holds no file lock"):
            vc.trace_many(MODEL, images, path, targets="top1", sites=["F1"], progress=False)
    finally:
        alive.communicate("\n", timeout=60)
    assert (path / LOCK_NAME).exists()


def test_the_lock_is_a_context_manager_and_a_second_holder_in_one_process_is_refused(tmp_path):
    with StoreLock(tmp_path) as lock:
        assert lock.held and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(vc.TraceFileError, match="is being written by another trace_many call"):
            StoreLock(tmp_path).acquire()
        assert json.loads((tmp_path / LOCK_NAME).read_text())["writer"] == "trace_many"
    with StoreLock(tmp_path, writer="vc.score"):
        with pytest.raises(vc.TraceFileError, match="is being written by another vc.score call"):
            StoreLock(tmp_path).acquire()
    assert not lock.held and not (tmp_path / LOCK_NAME).exists()
    with StoreLock(tmp_path):  # free again
        pass


# -- a failed save on a full disk ------------------------------------------------------------------------------
FULL_DISK = """
    import gc, resource, signal, sys
    import numpy as np, xarray as xr
    import vitcam_nb as vc

    folder = sys.argv[1]
    small = xr.Dataset({"a": ("x", np.arange(4.0))}, attrs={"schema_version": 1, "name": "small"})
    large = xr.Dataset({"a": (("x", "y"), np.random.default_rng(0).random((300, 300)))},
                       attrs={"schema_version": 1, "name": "large"})
    for suffix in (".nc", ".zarr"):
        vc.save(small, folder + "/t" + suffix)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    for suffix in (".nc", ".zarr"):
        try:
            vc.save(large, folder + "/t" + suffix)
        except OSError as exc:
            print(suffix, type(exc).__name__, exc, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    gc.collect()
    for suffix in (".nc", ".zarr"):
        print(suffix, vc.load(folder + "/t" + suffix).attrs["name"], flush=True)
"""


def test_a_save_that_fails_on_a_full_disk_leaves_the_process_and_the_file_healthy(tmp_path):
    proc = _python(FULL_DISK, tmp_path)  # output to pipes: files of this process obey its size limit too
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (proc.returncode, out, err[-3000:])  # old code: -11 (SIGSEGV) at exit
    lines = out.splitlines()
    assert lines[0] == f".nc OSError [Errno 27] path: could not write {tmp_path}/t.nc (File too large); any file " \
                       "there was left as it was"
    # the zarr write names its path in the same words (it named none before 0.3.0)
    assert lines[1] == f".zarr OSError [Errno 27] path: could not write {tmp_path}/t.zarr (File too large); any file " \
                       "there was left as it was"
    assert lines[2:] == [".nc small", ".zarr small"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.nc", "t.zarr"]  # no temporary file left


# -- read-only folders and symlinks ----------------------------------------------------------------------------
def _without_write_access(folder: Path, work) -> str:
    """``work()``'s outcome ("ok" or "Type: message") run where ``folder`` cannot be written: as root (whom
    permissions do not stop), in a forked child that became nobody; otherwise with the folder made read-only."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")] if p.is_dir()}
        for p in modes:
            p.chmod(0o555)
        try:
            work()
            return "ok"
        except Exception as exc:  # the outcome is compared by the caller
            return f"{type(exc).__name__}: {exc}"
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child only touches files: the model is not run after the fork
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                work()
                outcome = "ok"
            except Exception as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            os.write(write, outcome.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        outcome = f.read()
    os.waitpid(pid, 0)
    return outcome


@pytest.fixture
def open_folder():
    """A folder others may enter and read (not write): pytest's own tmp_path is closed to them."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_read_only_folders_give_a_trace_file_error_naming_the_path(open_folder):
    store = vc.trace_many(MODEL, iter([IMAGE]), open_folder / "s.zarr", targets="top1", sites=["F1"],
                          progress=False)
    for p in store.rglob("*"):
        if p.is_dir():
            p.chmod(0o755)
    for name in ("u.nc", "u.zarr"):
        outcome = _without_write_access(open_folder, lambda name=name: vc.save(TRACE, open_folder / name))
        assert outcome.startswith(f"TraceFileError: path: cannot write {open_folder / name}: Permission denied ("), \
            outcome
    outcome = _without_write_access(open_folder, lambda: vc.trace_many(MODEL, [IMAGE, IMAGE], store, targets="top1",
                                                                       sites=["F1"], progress=False))
    assert outcome == (f"TraceFileError: path: cannot create the lock file {store / LOCK_NAME} (Permission denied); "
                       "a store is written only in a folder this process can write to")
    assert sorted(p.name for p in open_folder.iterdir()) == ["s.zarr"]


def test_a_store_whose_array_folder_leads_outside_it_is_not_written(tmp_path):
    import shutil

    path = tmp_path / "s.zarr"
    images = _half_store(path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(path / "act", outside / "act")
    (path / "act").symlink_to(outside / "act")
    before = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} holds act, a symlink to {outside / 'act'} outside "
                                                "the store; the store is written only inside its own folder"):
        vc.trace_many(MODEL, images, path, targets="top1", sites=["F1"], progress=False)
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == before
    assert not (path / LOCK_NAME).exists()


def test_a_symlinked_store_is_resumed_and_replaced_where_it_leads(tmp_path):
    real, link = tmp_path / "real.zarr", tmp_path / "link.zarr"
    images = _half_store(real)
    link.symlink_to(real)
    assert vc.trace_many(MODEL, images, link, targets="top1", sites=["F1"], progress=False) == link
    assert vc.open_traces(link).sizes["image"] == 3
    vc.trace_many(MODEL, images[:1], link, targets="top2", sites=["F1"], overwrite=True, progress=False)
    assert link.is_symlink() and vc.open_traces(real).sizes["target"] == 3  # top1, top2, expected_logit
    dangling = tmp_path / "dangling.zarr"
    dangling.symlink_to(tmp_path / "nowhere" / "s.zarr")
    with pytest.raises(vc.TraceFileError, match=r"^path: .*dangling.zarr is a symlink to .*nowhere/s.zarr, which "
                                                "does not exist"):
        vc.trace_many(MODEL, images, dangling, targets="top1", sites=["F1"], progress=False)


def test_a_call_taking_the_lock_waits_for_a_batch_its_predecessor_sent_to_finish_writing(tmp_path, monkeypatch):
    # A sharded call's worker checked its caller's token and is writing a batch when that caller stops and the next
    # call takes the lock (to resume the store, or to delete it): the next call goes on only once the batch is
    # written (it used to delete the store under the writing worker: "Directory not empty", or worse, the batch
    # landed in the new store). The order is set by events, not by a clock.
    import threading

    from vitcam_nb.capture import store_lock
    from vitcam_nb.capture.worker_model import sender_writes

    store = tmp_path / "s.zarr"
    store.mkdir()
    first = StoreLock(store, writer="map_many")
    first.acquire()
    writing, may_finish, next_waits = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def worker() -> None:
        with sender_writes(str(store), first.token):  # the sender holds the lock: the write goes ahead
            writing.set()
            assert may_finish.wait(60)
            (store / "chunk").write_text("batch")
            order.append("batch written")

    def waiting(seconds: float) -> None:  # the next call found a batch being written
        next_waits.set()
        real_sleep(seconds)

    real_sleep = store_lock._sleep
    monkeypatch.setattr(store_lock, "_sleep", waiting)
    writer = threading.Thread(target=worker)
    writer.start()
    assert writing.wait(60)
    first.release()  # the sender stops (interrupted) while its batch is being written
    second = StoreLock(store, writer="map_many")
    taker = threading.Thread(target=lambda: (second.acquire(), order.append("next call holds the lock")))
    taker.start()
    assert next_waits.wait(60), "the next call took the lock without waiting for the batch being written"
    assert order == []
    may_finish.set()
    writer.join(60)
    taker.join(60)
    assert order == ["batch written", "next call holds the lock"]
    with pytest.raises(vc.TraceFileError, match="no longer written by the call that sent this batch"):
        with sender_writes(str(store), first.token):  # a batch of the stopped call arriving now writes nothing
            pass
    second.release()


def test_a_filesystem_that_cannot_lock_a_folder_still_takes_the_store_lock_and_writes(tmp_path, monkeypatch):
    # NFS emulates flock with record locks: a folder (opened read-only) cannot take an exclusive one (EBADF). The
    # store lock and the workers' writes work there as before, guarded by the token check alone.
    import errno
    import fcntl
    import stat

    from vitcam_nb.capture.worker_model import sender_writes

    real = fcntl.flock

    def nfs_like(fd: int, op: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", nfs_like)
    store = tmp_path / "s.zarr"
    store.mkdir()
    with StoreLock(store, writer="map_many") as lock:
        with sender_writes(str(store), lock.token):
            (store / "chunk").write_text("batch")
    with pytest.raises(vc.TraceFileError, match="no longer written by the call that sent this batch"):
        with sender_writes(str(store), lock.token):
            pass
    assert (store / "chunk").read_text() == "batch"
