"""Issue #52, stores that refused calls leave untouched: a refused resume writes nothing, a destination that cannot
be written and a disk too small are found before any pass (the store's recipe table counted), a full disk is named
by the path, and ``overwrite=True`` never deletes a user's files nor replaces a symlinked store by a folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from store_trace import IMAGE, MODEL
from vitcam_testing import assert_equal_to_rounding

import vitcam_nb as vc
from vitcam_nb.capture import store_files
from vitcam_nb.capture.store_lock import LOCK_NAME
from vitcam_nb.compute import map_sizes
from vitcam_nb.compute.map_writer import MapWriter

A, B = IMAGE, IMAGE // 2


def _state(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``path`` with its bytes and modification time (ns): what a refused call must not change."""
    return {p.relative_to(path).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def _call(kind: str, images, path, **kwargs):
    if kind == "trace_many":
        return vc.trace_many(MODEL, images, path, targets="top1", sites=["F1"], progress=False, **kwargs)
    return vc.map_many(MODEL, images, ["gradcam"], path, progress=False, **kwargs)


def _open(kind: str, path: Path):
    return vc.open_traces(path) if kind == "trace_many" else vc.open_maps(path)


@pytest.fixture
def passes():
    """The forward passes of MODEL's first block during the test, counted by a hook."""
    calls: list[int] = []
    handle = MODEL.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    yield calls
    handle.remove()


# -- finding 4: a refused resume changes nothing ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
def test_a_refused_resume_leaves_the_finished_store_as_it_was(tmp_path, passes, kind):
    path = _call(kind, [A, B], tmp_path / "s.zarr")
    before = _state(path)
    passes.clear()
    with pytest.raises(vc.TraceFileError, match=r"holds another image at index 0"):
        _call(kind, [B, A], path)
    assert passes == []
    assert _state(path) == before  # bytes and modification times: nothing was rewritten
    assert _open(kind, path).sizes["image"] == 2  # still complete: no "incomplete (2 of 2 images done)"


# -- finding 5: a destination that cannot be written, found before any pass -------------------------------------
@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
def test_a_store_under_a_file_is_refused_by_path_before_any_pass(tmp_path, passes, kind):
    # A folder that cannot hold files even for root (who ignores permission bits): a path under a file.
    under = tmp_path / "notes.txt"
    under.write_text("mine")
    with pytest.raises(vc.TraceFileError, match=rf"^path: cannot create {under}/s.zarr: {under} cannot be written"):
        _call(kind, [A], under / "s.zarr")
    assert passes == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def _as_nobody(work) -> str:
    """``work()``'s outcome ("ok" or "Type: message") in a forked child that became nobody (as root: permissions
    then apply), or here when not root; the model is never run in the child by a call refused before any pass."""
    if os.geteuid() != 0:
        try:
            work()
            return "ok"
        except Exception as exc:  # compared by the caller
            return f"{type(exc).__name__}: {exc}"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            import torch

            torch.set_num_threads(1)
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


@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
def test_a_read_only_folder_is_refused_by_path_before_any_pass(kind):
    import tempfile

    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        folder.chmod(0o555)  # others may enter and read, nobody but root may write
        outcome = _as_nobody(lambda: _call(kind, [A], folder / "s.zarr"))
        assert outcome.startswith(f"TraceFileError: path: cannot create {folder}/s.zarr: {folder} cannot be written "
                                  "(Permission denied)"), outcome
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


# -- finding 6: the disk check counts the recipe table; a full disk named by the path ---------------------------
def _free(monkeypatch, free: int) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(map_sizes.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=free))


def test_the_disk_check_counts_the_recipe_table_before_any_pass(tmp_path, monkeypatch, passes):
    space = {"site": ["F1", "F4", "F6"], "layer": [0, 1], "weighting": ["gradcam", "layercam", "gradcampp"]}
    path = vc.map_many(MODEL, [A, B], space, tmp_path / "ref.zarr", progress=False)
    on_disk = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    table = len((path / "zarr.json").read_bytes())
    maps = vc.open_maps(path)["maps"]
    assert table > 2 * maps.size * 4  # the recipe table is most of such a store, as in the issue
    # A disk with room for the maps (and their chunks) but not the table: refused by path before any pass.
    _free(monkeypatch, table // 2 + maps.size * 4 * 4)
    passes.clear()
    with pytest.raises(vc.TraceFileError, match=rf"^recipes_or_space: 18 recipes over 2 images make a store of about "
                                                rf"[0-9.]+ MB .* kB of recipe table, attributes and file blocks\); "
                                                rf"{tmp_path} has "):
        vc.map_many(MODEL, [A, B], space, tmp_path / "new.zarr", progress=False)
    assert passes == [] and not (tmp_path / "new.zarr").exists()
    # the estimate is an upper bound of what such a store takes
    _free(monkeypatch, 10**12)
    sizes = map_sizes.table_bytes(map_sizes_entries(space))
    assert sizes >= table - 4096 and on_disk > 0


def map_sizes_entries(space):
    from vitcam_nb.compute.map_recipes import as_recipes, plan_entries

    return plan_entries(as_recipes(space), len(MODEL.blocks), list(vc.adapters.find_adapter(MODEL).site_table(MODEL)),
                        "top1")[0]


def test_an_overwrite_refused_for_the_table_keeps_the_old_store(tmp_path, monkeypatch):
    space = {"site": ["F1", "F4"], "layer": [0, 1], "weighting": ["gradcam", "layercam"]}
    path = vc.map_many(MODEL, [A, B], ["gradcam"], tmp_path / "s.zarr", progress=False)
    before = _state(path)
    monkeypatch.setattr(map_sizes, "CHECKLIST_BYTES", 0)  # the estimate before the pass lets it through ...
    real = shutil.disk_usage
    # ... and the disk has room for the maps, not for the recipe table with its checklists
    monkeypatch.setattr(map_sizes.shutil, "disk_usage", lambda p: real(p)._replace(free=12_000))
    monkeypatch.setattr(map_sizes, "_files_bytes", lambda *a: 0)
    with pytest.raises(vc.TraceFileError, match=rf"^path: the store's attributes \(its recipe table with every "
                                                rf"checklist\) need [0-9.]+ MB, and {tmp_path} has 0.01 MB free; "
                                                "nothing was written and the store there is kept"):
        vc.map_many(MODEL, [A, B], space, path, progress=False, overwrite=True)
    assert _state(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
def test_a_full_disk_while_writing_is_named_by_the_path(tmp_path, monkeypatch, kind):
    path = _call(kind, [A, B], tmp_path / "s.zarr")
    before = _state(path)
    import zarr

    def full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    # the replacing call fails creating its store: the old store is put back, the error names the path
    monkeypatch.setattr(vc.capture.store.Store if kind == "trace_many" else MapWriter, "create", full)
    with pytest.raises(vc.TraceFileError, match=rf"^path: writing {path} failed: No space left on device; nothing "
                                                "was written and a store this call replaces is kept"):
        _call(kind, [B, A], path, overwrite=True)
    assert _state(path) == before
    monkeypatch.undo()
    # a resumed store whose next batch meets a full disk: named, the batches before kept
    new = _call(kind, iter([A]), tmp_path / "r.zarr")
    monkeypatch.setattr(zarr.Array, "__setitem__", full)
    with pytest.raises(vc.TraceFileError, match=rf"^path: writing {new} failed: No space left on device; the "
                                                "batches finished before are kept"):
        _call(kind, [A, B], new)


# -- LOW: overwrite=True and a user's files, a symlinked store ---------------------------------------------------
@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
def test_overwrite_names_a_users_file_in_the_store_and_deletes_nothing(tmp_path, passes, kind):
    path = _call(kind, [A, B], tmp_path / "s.zarr")
    (path / "my_notes.txt").write_text("mine")
    before = _state(path)
    passes.clear()
    with pytest.raises(vc.OutputExistsError, match=rf"^path: {path} holds files no store writer made "
                                                   r"\(my_notes.txt\); overwrite=True replaces the whole folder"):
        _call(kind, [B, A], path, overwrite=True)
    assert passes == [] and _state(path) == before


@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
def test_overwrite_of_a_symlinked_store_replaces_it_where_the_link_leads(tmp_path, kind):
    real = _call(kind, [A, B], tmp_path / "real.zarr")
    link = tmp_path / "link.zarr"
    link.symlink_to(real)
    assert _call(kind, [B, A], link, overwrite=True) == link
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.zarr", "real.zarr"]
    reopened = _open(kind, link)
    first = reopened["input_sha256"].values[0]
    assert first == _open(kind, _call(kind, [B], tmp_path / "b.zarr"))["input_sha256"].values[0]


# -- LOW: worker_model without a Client; map_many(rule=...) --------------------------------------------------------
@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
def test_worker_model_without_a_client_is_named_in_a_warning(tmp_path, kind):
    with pytest.warns(UserWarning, match=r"^worker_model: no dask.distributed Client is active"):
        _call(kind, [A], tmp_path / "s.zarr", worker_model={"timm": "vit_tiny_patch16_224"})


def test_map_many_names_the_rule_it_computes_under(tmp_path, passes):
    with pytest.raises(vc.TraceError, match=r"^rule: map_many computes maps under the 'gradient' rule only, got "
                                            r"'cp_lrp'; trace the images with vc.trace_many\(..., rule='cp_lrp'\)"):
        vc.map_many(MODEL, [A], ["gradcam"], tmp_path / "s.zarr", rule="cp_lrp", progress=False)
    with pytest.raises(vc.TraceError, match=r"^rule: "):
        vc.map_many(MODEL, [A], ["gradcam"], tmp_path / "s.zarr", rule="nope", progress=False)
    assert passes == [] and not (tmp_path / "s.zarr").exists()
    path = vc.map_many(MODEL, [A], ["gradcam"], tmp_path / "s.zarr", rule="gradient", progress=False)
    # To rounding, not bitwise: map_many's pass captures only the last block (its graph starts there), the trace's
    # every block, so their backward runs matrix products of other shapes.
    assert_equal_to_rounding(vc.cam(vc.open_maps(path), vc.presets.gradcam()).values[0],
                             vc.cam(vc.trace(MODEL, A, targets="top1"), vc.presets.gradcam()).values, "gradcam map")


def test_store_files_probe_leaves_nothing(tmp_path):
    store_files.check_writable(tmp_path, tmp_path / "s.zarr")
    assert list(tmp_path.iterdir()) == []


# -- finding 8: a damaged map store -------------------------------------------------------------------------------
def _maps_store(tmp_path: Path) -> Path:
    return vc.map_many(MODEL, [A, B], ["gradcam", "F1@0"], tmp_path / "m.zarr", batch_size=1, progress=False)


def _edit_attrs(path: Path, edit) -> None:
    import json

    meta = json.loads((path / "zarr.json").read_text())
    edit(meta["attributes"])
    (path / "zarr.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(("edit", "named"), [
    (lambda a: a.pop("recipes"), "lacks the attribute 'recipes'"),
    (lambda a: a.pop("pad"), "lacks the attribute 'pad'"),
    (lambda a: a.update(recipes="[1, 2]"), "its attribute 'recipes' is not the recipe table"),
    (lambda a: a.update(recipes="{"), "its attribute 'recipes' is not the recipe table"),
])
def test_open_maps_refuses_a_store_without_its_recipe_table_by_name(tmp_path, edit, named):
    path = _maps_store(tmp_path)
    _edit_attrs(path, edit)
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is a damaged map store: .*{named}"):
        vc.open_maps(path)


def test_a_truncated_chunk_is_named_by_store_and_array(tmp_path):
    path = _maps_store(tmp_path)
    chunk = path / "maps" / "c" / "1" / "0" / "0" / "0"  # image 1's maps (one image per chunk)
    chunk.write_bytes(chunk.read_bytes()[:10])
    ds = vc.open_maps(path)
    vc.cam(vc.image_maps(ds, 0), vc.presets.gradcam())  # image 0 is whole
    for read in (lambda: vc.image_maps(ds, 1), lambda: vc.cam(ds, vc.presets.gradcam())):
        with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is damaged: array 'maps' of image 1 cannot be "
                                                    "read"):
            read()


def test_a_deleted_map_chunk_is_missing_not_a_zero_map(tmp_path):
    path = _maps_store(tmp_path)
    good = vc.cam(vc.image_maps(vc.open_maps(path), 1), vc.presets.gradcam())
    assert float(good.max()) == 1.0  # a real map, normalised
    shutil.rmtree(path / "maps" / "c" / "1")  # image 1's maps chunk, gone
    ds = vc.open_maps(path)
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is damaged: array 'maps' of image 1 is missing "
                                                r"values \(a chunk of the store was deleted or never written\)"):
        vc.cam(vc.image_maps(ds, 1), vc.presets.gradcam())


def test_image_maps_refuses_a_negative_position_as_the_explorer_does(tmp_path):
    ds = vc.open_maps(_maps_store(tmp_path))
    for i in (-1, -2, 2, True, 1.0):
        with pytest.raises((vc.ArgumentIndexError, vc.ArgumentTypeError), match=r"^i: expected an image position in "
                                                                                 r"\[0, 1\]"):
            vc.image_maps(ds, i)
    assert str(vc.image_maps(ds, 1)["trace_id"].values) == str(ds["trace_id"].values[1])


# -- LOW: x.ZARR ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["trace_many", "map_many"])
def test_a_store_path_ending_in_upper_case_zarr_is_refused(tmp_path, passes, kind):
    with pytest.raises(vc.TraceFileError, match=r"^path: a (trace|map)_many store is a zarr folder and its path ends "
                                                r"in .zarr \(lower case\), got .*x.ZARR$"):
        _call(kind, [A], tmp_path / "x.ZARR")
    assert passes == [] and list(tmp_path.iterdir()) == []
