"""Stores and trace files keep what the user has when a call is refused: ``path`` and ``overwrite`` checked by
name first, every image held in memory checked before any pass, an old store kept whole until a replacing call's
first batch is ready, a saved zarr trace never replaced over a file kept inside it, and a Shapley cache file that is
no cache left alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from store_trace import IMAGE, MODEL, TRACE

import vitcam_nb as vc
from vitcam_nb.capture import trace_many as trace_many_module
from vitcam_nb.capture.io import _foreign_files
from vitcam_nb.capture.store import Store
from vitcam_nb.compute.map_writer import MapWriter
from vitcam_nb.evaluate.report.shapley_cache import ShapleyCache

IMAGES = [IMAGE, IMAGE // 2]


def _files(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (or the file itself) with its bytes: what a refused call must leave as it was."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def passes():
    """The forward passes of MODEL's first block during the test, counted by a hook."""
    calls: list[int] = []
    handle = MODEL.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    yield calls
    handle.remove()


def _store(kind: str, path: Path) -> Path:
    if kind == "trace_many":
        return vc.trace_many(MODEL, IMAGES, path, targets="top1", sites=["F1"], progress=False)
    return vc.map_many(MODEL, IMAGES, ["gradcam"], path, progress=False)


def _call(kind: str, images, path, **kwargs):
    if kind == "trace_many":
        return vc.trace_many(MODEL, images, path, targets="top1", sites=["F1"], progress=False, **kwargs)
    return vc.map_many(MODEL, images, ["gradcam"], path, progress=False, **kwargs)


# -- save and load: path and overwrite by name; a zarr trace checked at every depth --------------------------
@pytest.mark.parametrize(("where", "named"), [
    (lambda p: p / "act" / "user_notes.txt", "act/user_notes.txt"),  # beside an array's chunks
    (lambda p: p / "act" / "0.0.0.0.0.bak", "act/0.0.0.0.0.bak"),  # named almost like a chunk
    (lambda p: p / "act" / "notes" / "a.txt", "act/notes/a.txt"),  # a folder of the user's in an array
    (lambda p: p / "mine" / "a.txt", "mine/"),  # a folder of the user's in the group
    (lambda p: p / "0.0", "0.0"),  # a chunk-like name where a group holds no chunks
])
def test_save_keeps_a_file_nested_in_an_earlier_zarr_trace(tmp_path, where, named):
    path = vc.save(TRACE, tmp_path / "t.zarr")
    user = where(path)
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text("mine")
    before = _files(path)
    with pytest.raises(vc.OutputExistsError, match=rf"^path: {path} holds files vitcam_nb did not write "
                                                   rf"\({named}\); it is left alone"):
        vc.save(TRACE, path)
    assert _files(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.zarr"]  # no temporary or moved-aside folder left


def test_save_replaces_its_own_zarr_trace_and_with_overwrite_anything(tmp_path):
    path = vc.save(TRACE, tmp_path / "t.zarr")
    vc.save(TRACE, path)  # every file is zarr's: replaced without overwrite
    (path / "act" / "user_notes.txt").write_text("mine")
    vc.save(TRACE, path, overwrite=True)  # asked for: the whole folder is replaced
    assert not (path / "act" / "user_notes.txt").exists()
    assert vc.load(path).identical(vc.load(vc.save(TRACE, tmp_path / "u.zarr")))


def test_zarr_v3_chunk_keys_are_zarr_files(tmp_path):
    import zarr

    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=3)
    group.create_array("a", shape=(3, 4), chunks=(2, 2), dtype="f4")[:] = 1
    group.create_array("scalar", shape=(), dtype="f4")[()] = 2
    group.create_group("sub").create_array("b", shape=(2,), chunks=(1,), dtype="i4")[:] = 3
    assert _foreign_files(tmp_path / "s.zarr") == []
    (tmp_path / "s.zarr" / "a" / "c" / "notes.txt").write_text("mine")
    assert _foreign_files(tmp_path / "s.zarr") == ["a/c/notes.txt"]


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_save_refuses_an_overwrite_that_is_not_a_bool_and_keeps_the_users_file(tmp_path, suffix):
    path = tmp_path / f"user{suffix}"
    path.write_text("user data") if suffix == ".nc" else vc.save(TRACE, path)
    before = _files(path)
    for value in ("no", 1, None):
        with pytest.raises(vc.ArgumentTypeError, match=r"^overwrite: expected True or False, got"):
            vc.save(TRACE, path, overwrite=value)
    assert _files(path) == before


@pytest.mark.parametrize("value", [123, None, b"t.nc"])
def test_save_and_load_name_a_path_that_is_no_path(value):
    with pytest.raises(vc.ArgumentTypeError, match=r"^path: expected a file or folder path"):
        vc.save(TRACE, value)
    with pytest.raises(vc.ArgumentTypeError, match=r"^path: expected a file or folder path"):
        vc.load(value)


def test_save_names_a_text_attribute_netcdf_cannot_hold(tmp_path):
    ds = TRACE.copy()
    ds.attrs["note"] = "a\x00b"
    with pytest.raises(vc.TraceFileError, match=r"^trace: attribute 'note' holds a NUL character, which netCDF "
                                                r"cannot store"):
        vc.save(ds, tmp_path / "t.nc")
    assert list(tmp_path.iterdir()) == []
    assert vc.load(vc.save(ds, tmp_path / "t.zarr")).attrs["note"] == "a\x00b"  # zarr's JSON metadata holds it


# -- trace_many and map_many: every check before a store is touched or the model runs -------------------------
BAD_CALLS = {
    "a str among the images": (lambda: [IMAGE, "oops", IMAGE], {}, vc.ArgumentTypeError,
                               r"^images\[1\]: expected a PIL image, a numpy array .* got str"),
    "a 1-D array among the images": (lambda: [IMAGE, np.zeros(5, np.uint8)], {}, vc.TraceError,
                                     r"^images\[1\]: expected an HxW, HxWx1, HxWx3 or HxWx4 array, got shape \(5,\)"),
    "a bool image": (lambda: [IMAGE, IMAGE > 0], {}, vc.TraceError, r"^images\[1\]: array of dtype bool has no pixel"),
    "a NaN image": (lambda: [IMAGE, np.full((32, 32, 3), np.nan, np.float32)], {}, vc.TraceError,
                    r"^images\[1\]: contains NaN or inf values"),
    "a float tensor of another shape": (lambda: [IMAGE, torch.zeros(2, 3, 32, 32)], {}, vc.TraceError,
                                        r"^images\[1\]: expected a float tensor of shape \(1,3,H,W\)"),
    "a label out of range": (lambda: IMAGES, {"image_labels": [0, 5000]}, vc.TraceError,
                             r"^image_labels: image 1 has label 5000; the model has 10 classes"),
    "a label carried by an item": (lambda: [(IMAGE, 0), (IMAGE, 10)], {}, vc.TraceError,
                                   r"^image_labels: image 1 has label 10; the model has 10 classes"),
    "overwrite not a bool": (lambda: IMAGES, {"overwrite": "no"}, vc.ArgumentTypeError,
                             r"^overwrite: expected True or False, got 'no'"),
}


@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_a_refused_overwrite_keeps_the_old_store_and_runs_no_pass(tmp_path, passes, kind, case):
    images, kwargs, error, match = BAD_CALLS[case]
    path = _store(kind, tmp_path / "s.zarr")
    before = _files(path)
    passes.clear()
    with pytest.raises(error, match=match):
        _call(kind, images(), path, batch_size=1, **{"overwrite": True, **kwargs})
    assert passes == [] and _files(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


def test_a_mask_of_another_size_is_refused_before_any_pass(tmp_path, passes):
    path = _store("trace_many", tmp_path / "s.zarr")
    before = _files(path)
    passes.clear()
    masks = [np.ones((32, 32), bool), np.ones((16, 16), bool)]
    with pytest.raises(vc.TraceError, match=r"^masks: image 1 is 32x32 but its mask is 16x16"):
        vc.trace_many(MODEL, IMAGES, path, targets="top1", sites=["F1"], masks=masks, batch_size=1, overwrite=True,
                      progress=False)
    assert passes == [] and _files(path) == before


@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
def test_a_bad_image_read_from_an_iterator_is_named_and_the_old_store_kept(tmp_path, passes, kind):
    # An iterator is read once, as it is traced: its second image is refused when read, before the first batch
    # (of two) is full, and the store it would replace is still whole.
    path = _store(kind, tmp_path / "s.zarr")
    before = _files(path)
    passes.clear()
    with pytest.raises(vc.ArgumentTypeError, match=r"^images\[1\]: expected a PIL image, .* got str"):
        _call(kind, iter([IMAGE, "oops"]), path, batch_size=2, overwrite=True)
    assert passes == [] and _files(path) == before


@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
def test_a_replacing_call_that_fails_to_create_its_store_puts_the_old_one_back(tmp_path, monkeypatch, kind):
    path = _store(kind, tmp_path / "s.zarr")
    before = _files(path)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Store if kind == "trace_many" else MapWriter, "create", full_disk)
    with pytest.raises(vc.TraceFileError, match=f"^path: writing {path} failed: No space left on device"):
        _call(kind, IMAGES[::-1], path, overwrite=True)
    assert _files(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
def test_a_replacing_call_replaces_the_store_and_leaves_nothing_beside_it(tmp_path, passes, kind):
    path = _store(kind, tmp_path / "s.zarr")
    _call(kind, [IMAGE] * 3, path, overwrite=True)
    opened = vc.open_traces(path) if kind == "trace_many" else vc.open_maps(path)
    assert opened.sizes["image"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]
    assert not (path / ".vitcam_nb.lock").exists()
    passes.clear()
    _call(kind, [IMAGE] * 3, path)  # resumed as any store: complete, nothing traced again
    assert passes == []


@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
@pytest.mark.parametrize("value", [123, None])
def test_a_path_that_is_no_path_is_named_before_any_work(monkeypatch, kind, value):
    def never(*args, **kwargs):
        raise AssertionError("the store's settings (the weights hash) were computed before the path was checked")

    monkeypatch.setattr(trace_many_module, "store_settings", never)
    monkeypatch.setattr("vitcam_nb.compute.map_many.store_settings", never)
    with pytest.raises(vc.ArgumentTypeError, match=r"^path: expected a file or folder path .* got "
                                                   rf"{type(value).__name__}"):
        _call(kind, IMAGES, value)


# -- a trace's int attributes, the Shapley cache file --------------------------------------------------------
@pytest.mark.parametrize("name", ["num_layers", "grid_h", "schema_version"])
def test_cam_names_an_edited_int_attribute(name):
    with pytest.raises(vc.TraceError, match=rf"^trace: attribute '{name}' is 'x'; expected an int"):
        vc.cam(TRACE.assign_attrs({name: "x"}), vc.Recipe())


@pytest.mark.parametrize("content", ["my notes, not json", b"\xff\xfe binary", None])
def test_a_shapley_cache_path_that_is_no_json_is_refused_by_name_and_left_alone(tmp_path, content):
    path = tmp_path / "notes.txt"
    if content is None:  # a folder
        path.mkdir()
        (path / "a.txt").write_text("mine")
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    before = _files(path)
    with pytest.raises(vc.ArgumentError, match=rf"^shapley_cache: {path} could not be read as a vitcam_nb Shapley "
                                               r"cache \(a JSON file\)"):
        ShapleyCache(path)
    assert _files(path) == before
    with pytest.raises(vc.ArgumentTypeError, match=r"^shapley_cache: expected a file or folder path"):
        ShapleyCache(123)


def test_report_presets_refuses_a_non_json_shapley_cache_and_keeps_it(tmp_path):
    from vitcam_nb.evaluate.report.presets import report_presets

    path = tmp_path / "notes.txt"
    path.write_text("my notes, not json")
    with pytest.raises(vc.ArgumentError, match=r"^shapley_cache: .*notes.txt could not be read"):
        report_presets(n_images=1, names=["gradcam"], shapley_images=1, shapley_grid=(1, 2), shapley_cache=path,
                       deletion_steps=2, progress=False)
    assert path.read_text() == "my notes, not json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
@pytest.mark.parametrize("flag", ["verify", "progress"])
def test_verify_and_progress_take_only_a_bool(tmp_path, kind, flag):
    """``verify=0`` would silently skip checking that a resumed store's images are the same images."""
    path = tmp_path / "s.zarr"
    kwargs = {"progress": False, flag: 0}
    with pytest.raises(vc.ArgumentTypeError, match=rf"^{flag}: expected True or False, got 0$"):
        if kind == "trace_many":
            vc.trace_many(MODEL, IMAGES, path, targets="top1", sites=["F1"], **kwargs)
        else:
            vc.map_many(MODEL, IMAGES, ["gradcam"], path, **kwargs)
    assert not path.exists()
