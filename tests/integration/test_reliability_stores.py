"""Issue #17, "no store is clobbered": vc.save replaces only a single trace it wrote, trace_many refuses odd
paths and two concurrent creations of one store give one store and one TraceFileError; vc.load points a
store to open_traces; attributes that cannot be stored are refused by name."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
from vitcam_testing import make_model

import vitcam_nb as vc

MODEL = make_model("vit")
IMAGE = np.random.default_rng(5).integers(0, 255, (32, 32, 3), dtype=np.uint8)
TRACE = vc.trace(MODEL, IMAGE, targets="top1", sites=["F1"])


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_save_replaces_its_own_single_trace(tmp_path, suffix):
    path = tmp_path / f"t{suffix}"
    vc.save(TRACE, path)
    other = vc.trace(MODEL, 255 - IMAGE, targets="top1", sites=["F1"])
    vc.save(other, path)
    assert vc.load(path).attrs["trace_id"] == other.attrs["trace_id"] != TRACE.attrs["trace_id"]


def test_save_leaves_another_programs_zarr_store_alone(tmp_path):
    import xarray as xr

    path = tmp_path / "theirs.zarr"
    xr.Dataset({"v": ("x", np.arange(3.0))}).to_zarr(path)
    (path / "notes.txt").write_text("mine")
    with pytest.raises(vc.TraceFileError, match=r"^path: .* is not a trace vitcam_nb.save wrote; it is left alone"):
        vc.save(TRACE, path)
    assert (path / "notes.txt").read_text() == "mine"
    vc.save(TRACE, path, overwrite=True)
    assert not (path / "notes.txt").exists() and vc.load(path).attrs["trace_id"] == TRACE.attrs["trace_id"]


def test_save_keeps_foreign_files_inside_its_own_zarr_trace(tmp_path):
    path = vc.save(TRACE, tmp_path / "t.zarr")
    (path / "README").write_text("kept")
    with pytest.raises(vc.TraceFileError, match=r"holds files vitcam_nb did not write \(README\)"):
        vc.save(TRACE, path)


def test_save_refuses_a_trace_many_store_and_load_points_to_open_traces(tmp_path):
    store = vc.trace_many(MODEL, [IMAGE], tmp_path / "s.zarr", targets="top1", sites=["F1"], progress=False)
    with pytest.raises(vc.TraceFileError, match=r"is a trace_many store; save will not replace it"):
        vc.save(TRACE, store)
    assert vc.open_traces(store).sizes["image"] == 1
    with pytest.raises(vc.TraceFileError, match=r"is a trace_many store .* open it with vitcam_nb.open_traces"):
        vc.load(store)


def test_save_refuses_a_foreign_file_a_folder_and_a_bool_attribute(tmp_path):
    foreign = tmp_path / "x.nc"
    foreign.write_bytes(b"not netcdf")
    with pytest.raises(vc.TraceFileError, match="is not a trace vitcam_nb.save wrote"):
        vc.save(TRACE, foreign)
    assert foreign.read_bytes() == b"not netcdf"
    (tmp_path / "d.nc").mkdir()
    with pytest.raises(vc.TraceFileError, match=r"is a folder; a .nc trace is one file"):
        vc.save(TRACE, tmp_path / "d.nc", overwrite=True)
    flagged = TRACE.copy()
    flagged.attrs["reviewed"] = True
    with pytest.raises(vc.TraceFileError, match=r"^trace: attribute 'reviewed' is bool"):
        vc.save(flagged, tmp_path / "b.nc")


@pytest.mark.parametrize("name", ["s.nc", "s", "s.zarr.bak"])
def test_trace_many_refuses_paths_that_are_not_zarr(tmp_path, name):
    with pytest.raises(vc.TraceFileError, match=r"^path: a trace_many store is a zarr folder"):
        vc.trace_many(MODEL, [IMAGE], tmp_path / name, targets="top1", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_two_concurrent_creations_of_one_store_give_one_store_and_one_trace_file_error(tmp_path):
    path = tmp_path / "s.zarr"
    models = [MODEL, copy.deepcopy(MODEL)]
    outcomes: list = [None, None]
    barrier = threading.Barrier(2)

    def work(i):
        barrier.wait()
        try:
            outcomes[i] = vc.trace_many(models[i], [IMAGE] * 2, path, targets="top1", sites=["F1"], progress=False)
        except vc.TraceFileError as exc:
            outcomes[i] = exc

    for _ in range(3):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(o == path or isinstance(o, vc.TraceFileError) for o in outcomes), outcomes
        ds = vc.open_traces(path)
        assert ds.sizes["image"] == 2 and ds.attrs["complete"] == 1
        assert [p.name for p in tmp_path.iterdir()] == ["s.zarr"]  # no temporary folder left behind
        import shutil

        shutil.rmtree(path)


def test_trace_many_names_a_broken_image_file_and_an_out_of_range_label(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "broken.png").write_bytes(b"not a png")
    with pytest.raises(vc.TraceError, match=r"^images: .*broken.png could not be read as an image"):
        vc.trace_many(MODEL, folder, tmp_path / "a.zarr", targets="top1", progress=False)
    model = make_model("vit", num_classes=5)
    with pytest.raises(vc.TraceError, match=r"^image_labels: image 1 has label 77; the model has 5 classes"):
        vc.trace_many(model, [IMAGE, IMAGE], tmp_path / "b.zarr", targets="top1", image_labels=[1, 77],
                      progress=False)
    assert not (tmp_path / "a.zarr").exists() and not (tmp_path / "b.zarr").exists()


def _half_store(path):
    images = [IMAGE, 255 - IMAGE, IMAGE[::-1].copy(), IMAGE[:, ::-1].copy()]
    vc.trace_many(MODEL, iter(images[:2]), path, targets="top1", sites=["F1"], progress=False)  # length unknown
    return images


def test_a_store_being_written_is_not_resumed_or_replaced_by_a_second_call(tmp_path):
    from vitcam_nb.capture.store_lock import LOCK_NAME, StoreLock

    path = tmp_path / "s.zarr"
    images = _half_store(path)
    assert not (path / LOCK_NAME).exists()  # released after the call
    writer = StoreLock(path)
    writer.acquire()  # another call writing, in this very process
    for overwrite in (False, True):
        with pytest.raises(vc.TraceFileError, match=r"^path: .*s.zarr is being written by another trace_many call "
                                                    r"\(process \d+ on .*\); one store has one writer"):
            vc.trace_many(MODEL, images, path, targets="top1", sites=["F1"], overwrite=overwrite, progress=False)
    assert vc.open_traces(path).sizes["image"] == 2 and (path / LOCK_NAME).exists()
    writer.release()
    vc.trace_many(MODEL, images, path, targets="top1", sites=["F1"], progress=False)
    assert vc.open_traces(path).sizes["image"] == 4 and not (path / LOCK_NAME).exists()


def test_a_stale_lock_is_taken_over_and_a_refused_resume_releases_its_lock(tmp_path):
    import json
    import socket
    import subprocess
    import sys

    from vitcam_nb.capture.store_lock import LOCK_NAME

    path = tmp_path / "s.zarr"
    images = _half_store(path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (path / LOCK_NAME).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "since": "then"}))
    with pytest.raises(vc.TraceFileError, match="another model or settings"):
        vc.trace_many(MODEL, images, path, targets="top2", sites=["F1"], progress=False)
    assert not (path / LOCK_NAME).exists()  # the stale lock was taken over, then released on the refusal
    (path / LOCK_NAME).write_text(json.dumps({"pid": gone.pid, "host": "elsewhere", "since": "then"}))
    with pytest.raises(vc.TraceFileError, match=r"on elsewhere, since then\).*delete .*\.vitcam_nb\.lock"):
        vc.trace_many(MODEL, images, path, targets="top1", sites=["F1"], progress=False)


def test_two_concurrent_resumes_of_one_store_give_one_complete_store(tmp_path):
    path = tmp_path / "s.zarr"
    images = _half_store(path)
    lone = vc.trace_many(MODEL, images, tmp_path / "lone.zarr", targets="top1", sites=["F1"], progress=False)
    models = [MODEL, copy.deepcopy(MODEL)]
    outcomes: list = [None, None]
    barrier = threading.Barrier(2)

    def work(i):
        barrier.wait()
        try:
            outcomes[i] = vc.trace_many(models[i], images, path, targets="top1", sites=["F1"], batch_size=1,
                                        progress=False)
        except vc.TraceFileError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path in outcomes and all(o == path or "being written by another" in str(o) for o in outcomes), outcomes
    ds, ref = vc.open_traces(path), vc.open_traces(lone)
    assert ds.attrs["complete"] == 1 and ds.sizes["image"] == 4
    # Each image traced once, in its place (batch sizes differ from the lone store's: float rounding only).
    np.testing.assert_allclose(ds["grad"].values, ref["grad"].values, rtol=1e-4, atol=1e-6)
    assert list(ds["input_sha256"].values) == list(ref["input_sha256"].values)
