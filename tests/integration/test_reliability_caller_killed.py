"""Issue #35, the store lock of the distributed path, without a cluster: a caller whose process is killed mid-run
leaves a stale lock and a store that the next call resumes to the same bytes (compared, array for array and
bitwise, with the store a single process writes), and a worker's batch writes only while the call that sent it
holds the store lock."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import zarr
from worker_runs import BATCH, RECIPES, SPEC, random_images, tiny_model, whole_stores
from worker_runs import assert_same_store as _assert_same_store
from worker_runs import recording as _recording

import vitcam_nb as vc
from vitcam_nb.capture.store_lock import LOCK_NAME
from vitcam_nb.compute.map_writer import MapWriter

pytest.importorskip("distributed")  # as test_reliability_cluster.py: the distributed path's tests

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def images():
    return random_images()


@pytest.fixture(scope="module")
def whole(tmp_path_factory, model, images) -> dict[str, Path]:
    """The stores a single process writes."""
    return whole_stores(tmp_path_factory.mktemp("whole"), model, images)


# -- the caller killed -----------------------------------------------------------------------------------------------
# The caller's process killed (os._exit: no finally, no lock release) after a batch's maps are written and before
# its facts and done flags are; the lock file stays behind, naming a process that is gone.
KILLED_CALLER = """
    import os, sys
    import torch
    torch.set_num_threads(int(sys.argv[3]))  # the store records the threads of its first batch: as in the tests
    sys.path.insert(0, sys.argv[1])
    import worker_runs as t
    import vitcam_nb as vc
    from vitcam_nb.compute.map_writer import MapWriter

    real = MapWriter.write_meta
    def killed(self, start, arrays):
        if start > 0:
            os._exit(3)
        return real(self, start, arrays)
    MapWriter.write_meta = killed
    vc.map_many(t.tiny_model(), t.random_images(), t.RECIPES, sys.argv[2], batch_size=t.BATCH, progress=False)
"""


@pytest.mark.slow
def test_map_many_caller_killed_mid_run_resumes_to_the_same_store(tmp_path, whole, model, images, monkeypatch):
    path = tmp_path / "killed.zarr"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-c", textwrap.dedent(KILLED_CALLER), Path(__file__).parent, path, torch.get_num_threads()]
    proc = subprocess.run(list(map(str, argv)), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert (path / LOCK_NAME).exists()  # stale: its writer is gone
    group = zarr.open_group(str(path), mode="r")
    assert group["done"][:].tolist() == [True, True, False, False, False, False]
    assert group["maps"][2:4].any()  # the second batch's maps were written, its done flags never
    recorded = _recording(monkeypatch, MapWriter, "write_meta", lambda args: args[0])
    # No cluster runs in this module: worker_model is used only with a running dask client, so this call runs here.
    vc.map_many(model, images, RECIPES, path, batch_size=BATCH, progress=False, worker_model=SPEC)
    assert sorted(recorded) == [2, 4]
    _assert_same_store(path, whole["maps"])


def test_a_worker_writes_only_while_its_sender_holds_the_store_lock(tmp_path):
    from vitcam_nb.capture.store_lock import StoreLock
    from vitcam_nb.capture.worker_model import check_sender

    with pytest.raises(vc.TraceFileError, match="no longer written by the call that sent this batch"):
        check_sender(str(tmp_path), "any")  # no lock at all
    lock = StoreLock(tmp_path)
    lock.acquire()
    check_sender(str(tmp_path), lock.token)  # the sender holds it: the batch writes
    with pytest.raises(vc.TraceFileError, match="no longer written"):
        check_sender(str(tmp_path), StoreLock(tmp_path).token)  # another call's lock
    lock.release()
    with pytest.raises(vc.TraceFileError, match="no longer written"):
        check_sender(str(tmp_path), lock.token)  # released: the sender stopped
    (tmp_path / LOCK_NAME).write_text("[garbled")
    with pytest.raises(vc.TraceFileError, match="no longer written"):
        check_sender(str(tmp_path), lock.token)
