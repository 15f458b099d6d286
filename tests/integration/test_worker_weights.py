"""How a sharded run's model reaches its workers (issue #35, item 4): as a safetensors file (in a folder in memory
where it has room, else the temporary folder) when every worker reads it there, so hundreds of megabytes do not
travel through the scheduler to each worker; as bytes in the worker plugin otherwise. Either way the worker's model
has the caller's weights (its weights hash), and unloading the model removes the file the call wrote."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import timm
import torch
import zarr
from safetensors.torch import load_file, save_file

import vitcam_nb as vc
from vitcam_nb.capture import worker_model
from vitcam_nb.core.provenance import weights_sha256

distributed = pytest.importorskip("distributed")
SPEC = {"timm": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 8, "depth": 1, "num_classes": 5}


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return timm.create_model(SPEC["timm"], pretrained=False, **{k: v for k, v in SPEC.items() if k != "timm"}).eval()


def _loaded(key: str) -> str | None:
    from vitcam_nb.capture.worker_model import _MODELS  # on the worker: this process's loaded models

    got = _MODELS.get(key)
    return None if got is None else weights_sha256(got[0])


def _weights_files() -> set[str]:
    folders = {tempfile.gettempdir(), worker_model._MEMORY_FOLDER}
    return {f for d in folders if os.path.isdir(d) for f in os.listdir(d) if f.startswith("vitcam_nb-weights-")}


@pytest.fixture
def written(monkeypatch) -> list[str]:
    """The weights files this process creates during the test. The folders are shared with every other process
    (other pytest-xdist workers, other runs on the machine), so a listing before and after may see their files."""
    paths: list[str] = []
    real = tempfile.mkstemp

    def recorded(*args, **kwargs):
        fd, path = real(*args, **kwargs)
        if os.path.basename(path).startswith("vitcam_nb-weights-"):
            paths.append(path)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", recorded)
    return paths


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=40) as cluster, distributed.Client(cluster) as c:
        yield c


@pytest.mark.slow
def test_workers_on_this_machine_read_the_weights_from_a_file_the_call_removes(client, written):
    model = _model()
    key, name = worker_model.send_model(client, model, SPEC, "cpu", "map_many")
    path = worker_model._FILES[name]
    assert written == [path] and os.path.basename(path) in _weights_files()
    on_file = load_file(path)
    assert on_file.keys() == model.state_dict().keys()
    assert all(torch.equal(on_file[k], v) for k, v in model.state_dict().items())
    assert set(client.run(_loaded, key).values()) == {weights_sha256(model)}
    worker_model.drop_model(client, name)
    assert not os.path.exists(path) and name not in worker_model._FILES
    assert set(client.run(_loaded, key).values()) == {None}


@pytest.mark.slow
def test_a_worker_that_cannot_read_the_file_gets_the_weights_as_bytes(client, monkeypatch, written):
    model = _model()
    real_run = client.run
    # Every worker answers that it cannot read the file (a worker on another machine).
    monkeypatch.setattr(client, "run", lambda fn, *args, **kw: {"tcp://elsewhere:1": -1})
    key, name = worker_model.send_model(client, model, SPEC, "cpu", "map_many")
    monkeypatch.setattr(client, "run", real_run)
    assert len(written) == 1 and not os.path.exists(written[0])  # written, found unreadable, removed
    assert name not in worker_model._FILES
    assert set(client.run(_loaded, key).values()) == {weights_sha256(model)}
    worker_model.drop_model(client, name)


@pytest.mark.slow
def test_sharded_stores_state_the_weights_origin_a_single_process_states(client, tmp_path, monkeypatch):
    from vitcam_nb.compute import map_shard

    # A model loaded from a weights file: its origin lives in its pretrained_cfg, which the workers' model now has.
    trained = _model()
    with torch.no_grad():  # norms off their initial values: else the origin is "random-init" whatever was loaded
        for name, p in trained.named_parameters():
            if "norm" in name:
                p.add_(0.1)
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(tmp_path / "w.safetensors"))
    model = vc.load_model(SPEC["timm"], weights=tmp_path / "w.safetensors",
                          **{k: v for k, v in SPEC.items() if k != "timm"})
    images = list(np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8))
    with monkeypatch.context() as here:  # the single-process store, while the client is running
        here.setattr(map_shard, "active_client", lambda: None)
        local = vc.map_many(model, images, ["gradcam"], tmp_path / "local.zarr", batch_size=2, progress=False)
    sharded = vc.map_many(model, images, ["gradcam"], tmp_path / "sharded.zarr", batch_size=2, progress=False,
                          worker_model=SPEC)
    attrs = [dict(zarr.open_group(str(p), mode="r").attrs) for p in (local, sharded)]
    assert "file w.safetensors (file sha256 " in attrs[0]["trace_attrs"]
    assert attrs[1] == attrs[0]
    # trace_many traces its first batch here and the second on the worker: one store, one origin.
    traces = vc.trace_many(model, images, tmp_path / "traces.zarr", targets="top1", sites=["F1"], batch_size=2,
                           progress=False, worker_model=SPEC)
    assert vc.open_traces(traces).attrs["weights_origin"].startswith("file w.safetensors (file sha256 ")


def _refaults(n: int = 32) -> tuple[int | None, int]:
    """On a worker: its environment's fixed mmap threshold, and the page faults of allocating, filling and freeing
    a 1 MiB array ``n`` times in a hole below a live block (from the heap: its pages stay; mapped anew: 256 each)."""
    import resource

    import numpy as np

    from vitcam_nb.capture.heap import fixed_threshold

    hole = np.ones(1 << 18, np.float32)
    above = np.ones(1 << 18, np.float32)  # keeps the hole off the heap's top, which the trim threshold returns
    del hole
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        block = np.ones(1 << 18, np.float32)
        del block
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
    del above
    return fixed_threshold(), faults


@pytest.mark.slow
def test_a_loaded_model_has_blocks_above_128_kib_served_from_the_heap_and_unloading_sets_dask_s_threshold_back(
        client):
    # dask's nanny fixes glibc's mmap threshold at 128 KiB (MALLOC_TRIM_THRESHOLD_): a 1 MiB block is mapped anew
    # at every allocation, 256 page faults each; with the kit's model loaded the hole is reused.
    fixed, before = next(iter(client.run(_refaults).values()))
    if fixed is None:
        pytest.skip("this dask configuration starts workers with glibc's own malloc settings")
    assert fixed == 128 * 1024 and before >= 32 * 256
    key, name = worker_model.send_model(client, _model(), SPEC, "cpu", "map_many")
    _, loaded = next(iter(client.run(_refaults).values()))
    assert loaded < 32 * 256 / 8, loaded
    worker_model.drop_model(client, name)
    _, after = next(iter(client.run(_refaults).values()))
    assert after >= 32 * 256, after
