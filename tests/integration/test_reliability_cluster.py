"""Issue #35, the distributed path on a LocalCluster of two worker processes: a worker that dies in the middle of
writing its region is retried and the region rewritten whole, never left half-written; a caller interrupted
(KeyboardInterrupt) leaves a store the next call resumes to the same bytes; a batch still running after its caller
stopped writes nothing into the store of a later call; the caller computes no batch, the store is the first batch's
even when another batch finishes first, and each call unloads only its own model from them. Every store is compared,
array for array and bitwise, with the store a single process writes. The deaths are made deterministic by a marker
file taken atomically (the first write of any worker takes it and dies; every later write finds it taken), never by
timing."""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import zarr
from worker_runs import BATCH, RECIPES, SPEC, TRACE_ARGS, N, random_images, tiny_model, whole_stores
from worker_runs import assert_same_store as _assert_same_store
from worker_runs import recording as _recording
from worker_runs import store_arrays as _arrays
from worker_runs import store_files as _files

import vitcam_nb as vc
from vitcam_nb.capture.store import Store
from vitcam_nb.capture.store_lock import LOCK_NAME
from vitcam_nb.compute.map_writer import MapWriter

distributed = pytest.importorskip("distributed")

GARBAGE = 7.0


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def images():
    return random_images()


@pytest.fixture(scope="module")
def whole(tmp_path_factory, model, images) -> dict[str, Path]:
    """The stores a single process writes (made before the cluster starts: with a Client active, they would be
    sharded)."""
    return whole_stores(tmp_path_factory.mktemp("whole"), model, images)


@pytest.fixture(scope="module")
def client(whole):
    import cloudpickle

    # The plugin below travels by value: a worker process need not import this test module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                      silence_logs=50) as cluster, distributed.Client(cluster) as c:
            yield c
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class DieMidWrite(distributed.WorkerPlugin):
    """Wraps a worker's write function (``module.name``): the first call of any worker takes ``marker``
    (O_EXCL: exactly one caller can), writes garbage over the first image of its region, records the region and
    kills its own process (``os._exit``: no cleanup, no exception the task could report); every later call writes
    as the kit does."""

    def __init__(self, module: str, name: str, marker: str) -> None:
        self.module, self.func, self.marker = module, name, marker

    def setup(self, worker) -> None:
        module = importlib.import_module(self.module)
        real = getattr(module, self.func)
        real = getattr(real, "__wrapped__", real)
        marker, half = self.marker, self.half

        def dying(path, *args):
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return real(path, *args)
            region = half(real, path, *args)
            os.write(fd, json.dumps({"pid": os.getpid(), "region": region}).encode())
            os.close(fd)
            os._exit(1)

        dying.__wrapped__ = real
        setattr(module, self.func, dying)

    def teardown(self, worker) -> None:
        module = importlib.import_module(self.module)
        setattr(module, self.func, getattr(getattr(module, self.func), "__wrapped__", getattr(module, self.func)))

    @staticmethod
    def half(real, path, *args) -> list[int]:
        """Write garbage over the region's first image only (a region half written); the region's indices."""
        if len(args) == 2:  # map_writer.write_region(path, start, arrays)
            start, arrays = args
            real(path, start, {k: np.full_like(v[:1], GARBAGE) for k, v in arrays.items()})
            return list(range(start, start + len(next(iter(arrays.values())))))
        (batch,) = args  # trace_shard.write_traces(path, batch)
        first = batch.isel(image=[0]).copy(deep=True)
        for name, var in first.data_vars.items():
            if var.dtype.kind == "f":
                first[name] = var.copy(data=np.full(var.shape, GARBAGE, var.dtype))
        real(path, first)
        return [int(i) for i in batch["image"].values]


def _died(client, marker: Path) -> list[int]:
    """The region the dead worker half wrote; that its process is gone (the worker now running is another)."""
    assert marker.exists(), "no worker wrote, so none died: the test would prove nothing"
    died = json.loads(marker.read_text())
    assert died["pid"] not in client.run(os.getpid).values()
    return died["region"]


# -- a worker dies mid-write --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_map_many_worker_dying_mid_write_is_retried_and_its_region_rewritten(tmp_path, client, model, images,
                                                                              monkeypatch):
    from vitcam_nb.compute import map_shard

    marker = tmp_path / "died.json"
    client.register_plugin(DieMidWrite("vitcam_nb.compute.map_shard", "write_region", str(marker)), name="die-map")
    recorded = _recording(monkeypatch, MapWriter, "write_meta", lambda args: (args[0], len(args[1]["trace_id"])))
    many = images + images  # six batches: those sent before the store exists hand their maps back, later ones write
    try:
        path = vc.map_many(model, many, RECIPES, tmp_path / "cluster.zarr", batch_size=BATCH, progress=False,
                           worker_model=SPEC)
    finally:
        client.unregister_worker_plugin("die-map")
    region = _died(client, marker)
    assert region in ([8, 9], [10, 11])
    # Every batch recorded (facts, then done flags) exactly once, by the calling process.
    assert sorted(recorded) == [(start, 2) for start in range(0, 2 * N, 2)]
    monkeypatch.setattr(map_shard, "active_client", lambda: None)  # the single-process store of the same images
    _assert_same_store(path, vc.map_many(model, many, RECIPES, tmp_path / "whole.zarr", batch_size=BATCH,
                                         progress=False))
    maps = _arrays(path)["maps"]
    assert not (maps[region] == GARBAGE).any()
    attrs = dict(zarr.open_group(str(path)).attrs)
    assert attrs["complete"] == 1 and attrs["n_images"] == 2 * N and _arrays(path)["done"].all()
    assert not (path / LOCK_NAME).exists()


@pytest.mark.slow
def test_trace_many_worker_dying_mid_write_is_retried_and_its_region_rewritten(tmp_path, client, whole, model,
                                                                                images, monkeypatch):
    marker = tmp_path / "died.json"
    client.register_plugin(DieMidWrite("vitcam_nb.capture.trace_shard", "write_traces", str(marker)),
                           name="die-trace")
    recorded = _recording(monkeypatch, Store, "write",
                          lambda args: tuple(int(i) for i in args[0]["image"].values))
    try:
        path = vc.trace_many(model, images, tmp_path / "cluster.zarr", worker_model=SPEC, **TRACE_ARGS)
    finally:
        client.unregister_worker_plugin("die-trace")
    region = _died(client, marker)
    assert region in ([2, 3], [4, 5])
    _assert_same_store(path, whole["traces"])
    assert sorted(recorded) == [(2, 3), (4, 5)]  # the first batch created the store; each other recorded once
    attrs = dict(zarr.open_group(str(path)).attrs)
    assert attrs["complete"] == 1 and attrs["n_images"] == N and _arrays(path)["done"].all()
    assert not (path / LOCK_NAME).exists()


# -- the caller interrupted -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_map_many_caller_interrupted_on_a_cluster_resumes_to_the_same_store(tmp_path, client, whole, model,
                                                                            images, monkeypatch):
    real = MapWriter.write_meta

    def interrupt_at_the_first_worker_batch(self, start, arrays):
        if start > 0:
            raise KeyboardInterrupt
        return real(self, start, arrays)

    monkeypatch.setattr(MapWriter, "write_meta", interrupt_at_the_first_worker_batch)
    path = tmp_path / "cluster.zarr"
    with pytest.raises(KeyboardInterrupt):
        vc.map_many(model, images, RECIPES, path, batch_size=BATCH, progress=False, worker_model=SPEC)
    assert not (path / LOCK_NAME).exists()
    assert _arrays(path)["done"].tolist() == [True, True, False, False, False, False]
    monkeypatch.setattr(MapWriter, "write_meta", real)
    recorded = _recording(monkeypatch, MapWriter, "write_meta", lambda args: args[0])
    vc.map_many(model, images, RECIPES, path, batch_size=BATCH, progress=False, worker_model=SPEC)
    assert sorted(recorded) == [2, 4]  # only the batches not done: nothing recorded twice
    _assert_same_store(path, whole["maps"])


# -- a batch still running after its caller stopped ---------------------------------------------------------------
# Each sharded path: its module, its sharder, the function a worker runs per batch.
SHARDED = {"maps": ("vitcam_nb.compute.map_shard", "Sharder", "_worker_batch"),
           "traces": ("vitcam_nb.capture.trace_shard", "TraceSharder", "_worker_traces")}


def _run(kind: str, model, images, path: Path, **kwargs) -> Path:
    if kind == "maps":
        return vc.map_many(model, images, RECIPES, path, batch_size=BATCH, progress=False, **kwargs)
    return vc.trace_many(model, images, path, **TRACE_ARGS, **kwargs)


class HoldFirstBatch(distributed.WorkerPlugin):
    """The first batch any worker starts that writes into the store (``module``'s worker function) takes
    ``folder/held`` and waits (files, not a clock, order the steps) until ``folder/go`` exists; once that
    batch's worker function has ended, ``folder/settled`` says how."""

    def __init__(self, module: str, func: str, folder: str) -> None:
        self.module, self.func, self.folder = module, func, folder

    def setup(self, worker) -> None:
        module = importlib.import_module(self.module)
        folder, state = Path(self.folder), {}
        loaded, batch = module.loaded_model, getattr(module, self.func)
        self.real = loaded, batch

        def held(key):
            model = loaded(key)  # before the hold: the stopped call unloads the model from its workers
            if not state.get("writes"):  # a map batch sent before its store existed: it hands its maps back
                return model
            try:
                os.close(os.open(folder / "held", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return model
            state["held"] = True
            _wait_for(folder / "go")
            return model

        def settled(*args):
            outcome = "wrote"
            state["writes"] = args[-1] if isinstance(args[-1], bool) else True  # map batches end (..., token, write)
            try:
                return batch(*args)
            except Exception as exc:
                outcome = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                if state.pop("held", False):
                    (folder / "settled").write_text(outcome)

        module.loaded_model = held
        setattr(module, self.func, settled)

    def teardown(self, worker) -> None:
        module = importlib.import_module(self.module)
        module.loaded_model = self.real[0]
        setattr(module, self.func, self.real[1])


def _wait_for(path: Path) -> None:
    for _ in range(6000):
        if path.exists():
            return
        threading.Event().wait(0.02)
    raise AssertionError(f"{path} never appeared")


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(SHARDED))
def test_a_batch_still_running_after_its_caller_stopped_never_writes_into_the_next_store(tmp_path, client, model,
                                                                                        images, monkeypatch, kind):
    from vitcam_nb.capture import trace_many
    from vitcam_nb.compute import map_shard

    module, sharder, func = SHARDED[kind]
    folder = tmp_path / "steps"
    folder.mkdir()
    client.register_plugin(HoldFirstBatch(module, func, str(folder)), name="hold")
    path = tmp_path / "store.zarr"
    try:
        # The first call is interrupted while a worker still runs one of its batches (cancelling a running task
        # does not stop it).
        def interrupted(self):
            _wait_for(folder / "held")
            raise KeyboardInterrupt

        monkeypatch.setattr(getattr(importlib.import_module(module), sharder), "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):  # map_many: enough batches that some are sent once its store exists
            _run(kind, model, images + images if kind == "maps" else images, path, worker_model=SPEC)
        monkeypatch.undo()
        # The next call replaces the store with other images', and finishes (in this process, no Client), before
        # the orphaned batch gets to write.
        monkeypatch.setattr(map_shard, "active_client", lambda: None)
        monkeypatch.setattr(trace_many, "active_client", lambda: None)
        others = images[::-1]
        _run(kind, model, others, path, overwrite=True)
        before, files = _arrays(path), _files(path)
    finally:
        (folder / "go").touch()
        _wait_for(folder / "settled")
        client.unregister_worker_plugin("hold")
    after = _arrays(path)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert _files(path) == files
    assert (folder / "settled").read_text().startswith("TraceFileError: path:"), "the orphaned batch was not refused"
    _assert_same_store(path, _run(kind, model, others, tmp_path / "whole.zarr"))


class FirstBatchLast(distributed.WorkerPlugin):
    """The batch of image 0 (map_many's worker function) waits until another batch has finished (``folder/other``,
    files, not a clock, order the steps), and says in ``folder/first-waited`` that it did."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def setup(self, worker) -> None:
        from vitcam_nb.compute import map_shard

        folder, real = Path(self.folder), map_shard._worker_batch

        def ordered(*args):
            if args[6] != 0:  # (key, entries, n_parts, plan_args, settings_id, path, start, ...)
                out = real(*args)
                (folder / "other").touch()
                return out
            _wait_for(folder / "other")
            (folder / "first-waited").touch()
            return real(*args)

        ordered.__wrapped__ = real
        map_shard._worker_batch = ordered

    def teardown(self, worker) -> None:
        from vitcam_nb.compute import map_shard

        map_shard._worker_batch = getattr(map_shard._worker_batch, "__wrapped__", map_shard._worker_batch)


@pytest.mark.slow
def test_the_caller_computes_no_batch_and_the_first_batch_shapes_the_store_even_when_it_finishes_last(
        tmp_path, client, whole, model, images, monkeypatch):
    from vitcam_nb.compute import map_many

    def refused(*args, **kwargs):  # in the calling process only (the workers have their own module)
        raise AssertionError("a batch was computed in the calling process")

    monkeypatch.setattr(map_many, "compute_batch", refused)
    monkeypatch.setattr(map_many, "compute_batch_torch", refused)
    folder = tmp_path / "steps"
    folder.mkdir()
    client.register_plugin(FirstBatchLast(str(folder)), name="first-last")
    try:
        path = vc.map_many(model, images, RECIPES, tmp_path / "sharded.zarr", batch_size=BATCH, progress=False,
                           worker_model=SPEC)
    finally:
        client.unregister_worker_plugin("first-last")
    assert (folder / "first-waited").exists()  # another batch had finished before the store could be made
    # The same store: the recipes' table carries image 0's checklist, the attributes are those of its batch.
    _assert_same_store(path, whole["maps"])


def test_a_refused_model_raises_when_the_workers_are_needed_and_unloads_nothing(client, model):
    from vitcam_nb.capture.worker_model import ModelSending

    with pytest.raises(vc.TraceError, match="worker_model"):  # timm cannot build it: refused before sending
        ModelSending(client, model, {"timm": "no_such_model"}, "cpu", "map_many")
    sending = ModelSending(client, model, {**SPEC, "depth": 1}, "cpu", "map_many")  # builds other weights
    with pytest.raises(vc.TraceError, match="worker_model"):
        sending.names()
    sending.drop()  # nothing reached the workers: nothing to unload, no error


def _loaded(key: str) -> bool:
    from vitcam_nb.capture.worker_model import loaded_model

    try:
        loaded_model(key)
    except KeyError:
        return False
    return True


@pytest.mark.slow
def test_two_calls_sending_one_model_unload_only_their_own(client, model):
    from vitcam_nb.capture.worker_model import drop_model, send_model

    first = send_model(client, model, SPEC, "cpu", "map_many")
    second = send_model(client, model, SPEC, "cpu", "trace_many")
    try:
        assert first[0] != second[0] and first[1] != second[1]
        drop_model(client, first[1])  # the first call ends while the second still runs batches
        assert not any(client.run(_loaded, first[0]).values())
        assert all(client.run(_loaded, second[0]).values())
    finally:
        drop_model(client, second[1])
    assert not any(client.run(_loaded, second[0]).values())
