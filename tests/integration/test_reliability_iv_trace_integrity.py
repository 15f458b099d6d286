"""Issue 52, trace store integrity: every chunk of a trace store's large arrays is checked, as it is read, against
the per-image checksum trace_many wrote with it, on every read path (``image_trace`` eagerly, ``open_traces`` and
``vc.cam(open_traces(p), r)`` lazily): a flipped byte zstd decodes into other values, a truncated, zeroed or
deleted chunk and an edited checksum are refused naming the store, the image and the array, never read back as
other activations or gradients; a chunk zstd cannot decode is a ``TraceFileError`` on the lazy path too (it was
numcodecs' bare ``RuntimeError``); a store written before checksums (0.1's fixture, or one with its checksum
removed) opens with a warning and the same values; a store resumed after its writer was killed verifies whole."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
import zarr
from store_trace import IMAGE, MODEL

import vitcam_nb as vc
from vitcam_nb import Recipe as R

ROOT = Path(__file__).resolve().parents[2]
OLD = ROOT / "tests" / "data" / "v0_1" / "store.zarr"  # written by vitcam_nb 0.1: no checksums
IMAGES = [IMAGE, IMAGE // 2, 255 - IMAGE]
LAYER0 = R(site="F1", layer=0)  # reads act and grad of layer 0: image 0's damaged chunk below
VERIFIED = "sha256 per image, array and chunk, verified as each chunk is read"
pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.preprocess.InputCropWarning",
                                        "ignore::vitcam_nb.DegenerateMapWarning")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace_integrity") / "t.zarr"
    return vc.trace_many(MODEL, IMAGES, path, targets="top1", batch_size=2, progress=False)


def _copy(store: Path, tmp_path: Path) -> Path:
    path = tmp_path / "t.zarr"
    shutil.copytree(store, path)
    return path


def _raw(path: Path) -> dict[str, np.ndarray]:
    """Every data variable as xarray alone reads it from the store (no vitcam_nb), for the values compared."""
    ds = xr.open_zarr(str(path), consolidated=False)
    return {k: ds[k].values for k in ("act", "grad", "attn", "attn_grad", "logits", "pixels") if k in ds}


def _decoded(path: Path) -> np.ndarray | None:
    """Image 0's layer-0 activations as zarr itself decodes them; None where zstd detects the damage."""
    try:
        return np.asarray(zarr.open_group(str(path), mode="r")["act"][0, 0])
    except Exception:  # noqa: BLE001 - zarr and numcodecs raise several types
        return None


def _refused_everywhere(path: Path, image: int = 0, name: str = "act", cam: bool = True) -> None:
    """Each read path that returns image ``image``'s values refuses it, naming the store, image and array
    (``cam``: also the lazy map of every image)."""
    message = rf"^path: {path} is damaged: array '{name}' of image {image}"
    with pytest.raises(vc.TraceFileError, match=message):
        vc.image_trace(vc.open_traces(path), image)
    with pytest.raises(vc.TraceFileError, match=message):
        vc.open_traces(path)[name].values  # noqa: B018 - the lazy read is the point
    if cam:
        with pytest.raises(vc.TraceFileError, match=message):
            vc.cam(vc.open_traces(path), LAYER0).values  # noqa: B018


def test_a_trace_chunk_changed_on_disk_is_refused_never_read_as_other_values(tmp_path, store):
    path = _copy(store, tmp_path)
    good = _raw(path)
    chunk = path / "act" / "c" / "0" / "0" / "0" / "0" / "0"  # image 0, layer 0 (one image and layer a chunk)
    original = chunk.read_bytes()
    silent = []
    for k in range(0, len(original), max(1, len(original) // 40)):  # one bit flipped, at 40 places of the chunk
        data = bytearray(original)
        data[k] ^= 0x10
        chunk.write_bytes(bytes(data))
        decoded = _decoded(path)
        if decoded is not None and np.array_equal(decoded, good["act"][0, 0], equal_nan=True):
            np.testing.assert_array_equal(vc.image_trace(vc.open_traces(path), 0)["act"].values, good["act"][0])
            continue  # a byte zstd ignores (padding, a frame field): the same values, read
        if decoded is not None:
            silent.append(k)  # what checksums are for: zstd decodes other activations without a word
        _refused_everywhere(path, cam=len(silent) < 3)  # the lazy map (slowest) on the first silent cases
    assert len(silent) > 5, silent  # the silent case is exercised, not only zstd's own errors
    chunk.write_bytes(original)
    np.testing.assert_array_equal(vc.open_traces(path)["act"].values, good["act"])  # intact again: read


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "emptied", "deleted"])
def test_a_truncated_zeroed_or_deleted_trace_chunk_is_refused(tmp_path, store, damage):
    path = _copy(store, tmp_path)
    chunk = path / "grad" / "c" / "1" / "0" / "2" / "0" / "0" / "0"  # image 1, target 0, layer 2
    original = chunk.read_bytes()
    {"truncated": lambda: chunk.write_bytes(original[: len(original) // 2]),
     "zeroed": lambda: chunk.write_bytes(b"\0" * len(original)),
     "emptied": lambda: chunk.write_bytes(b""), "deleted": chunk.unlink}[damage]()
    message = rf"^path: {path} is damaged: array 'grad' of image 1"
    with pytest.raises(vc.TraceFileError, match=message):
        vc.image_trace(vc.open_traces(path), 1)
    with pytest.raises(vc.TraceFileError, match=message):
        vc.cam(vc.open_traces(path), R(site="F1", layer=2)).values  # noqa: B018
    vc.image_trace(vc.open_traces(path), 0)  # the other images' chunks are whole, and read


def test_the_lazy_cam_on_an_undecodable_chunk_is_a_trace_file_error_naming_store_and_image(tmp_path, store):
    path = _copy(store, tmp_path)
    chunk = path / "act" / "c" / "2" / "0" / "0" / "0" / "0"  # image 2, layer 0: not the image cam checks eagerly
    chunk.write_bytes(chunk.read_bytes()[:20])
    with pytest.raises(Exception):  # noqa: B017, PT011 - zstd itself refuses it: the case of the finding
        zarr.open_group(str(path), mode="r")["act"][2, 0]
    maps = vc.cam(vc.open_traces(path), LAYER0)  # lazy: nothing of image 2 read yet
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is damaged: array 'act' of image 2 cannot be read "
                                                r"\((RuntimeError|.*Error): .*\); trace the image again"):
        maps.compute()
    np.testing.assert_array_equal(maps[:2].values, vc.cam(vc.open_traces(store), LAYER0)[:2].values)


def test_an_edited_checksum_is_refused_not_trusted(tmp_path, store):
    path = _copy(store, tmp_path)
    group = zarr.open_group(str(path), mode="r+")
    sums = json.loads(str(group["checksum"][1:2][0]))
    sums["logits"] = ["0" * 16]
    group["checksum"][1:2] = np.array([json.dumps(sums)], dtype=object)
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is damaged: array 'logits' of image 1 no longer"):
        vc.image_trace(vc.open_traces(path), 1)
    group["checksum"][1:2] = np.array([""], dtype=object)  # a done image whose checksum was removed
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is damaged: array '\w+' of image 1 has no checksum"):
        vc.image_trace(vc.open_traces(path), 1)
    vc.image_trace(vc.open_traces(path), 0)


def test_a_trace_store_written_before_checksums_opens_unverified_with_the_same_values(tmp_path, store):
    path = _copy(store, tmp_path)
    shutil.rmtree(path / "checksum")  # the layout of a 0.2.0 / 0.3.0 store: no checksum array, no attribute
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"].pop("checksums")
    (path / "zarr.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match=rf"path: {path} has no checksums \(none: this store was written before"):
        ds = vc.open_traces(path)
    assert ds.attrs["checksums"].startswith("none: ")
    assert vc.open_traces(store).attrs["checksums"] == VERIFIED
    assert "checksum" not in vc.open_traces(store).variables  # the schema v1 variables, as before
    raw = _raw(store)
    for name, values in raw.items():
        np.testing.assert_array_equal(ds[name].values, values, err_msg=name)
    for i in range(len(IMAGES)):
        with pytest.warns(UserWarning, match="has no checksums"):
            old, new = vc.image_trace(vc.open_traces(path), i), vc.image_trace(vc.open_traces(store), i)
        xr.testing.assert_identical(old, new)
    # A chunk zstd cannot decode is still refused by name in a store without checksums.
    chunk = path / "act" / "c" / "0" / "0" / "0" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:20])
    with pytest.warns(UserWarning, match="has no checksums"):
        maps = vc.cam(vc.open_traces(path), R(site="F1", layer=1))  # image 0's layer 1: whole
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is damaged: array 'act' of image 0 cannot be read"):
        vc.cam(vc.open_traces(path), LAYER0)  # image 0 is read eagerly
    assert maps.shape[0] == len(IMAGES)
    # A store whose attributes say it has checksums, but lacks them, is damaged, not old.
    shutil.rmtree(path)
    shutil.copytree(store, path)
    shutil.rmtree(path / "checksum")
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is a damaged trace store: .* lacks the array "
                                                "'checksum'"):
        vc.open_traces(path)


def test_the_0_1_store_fixture_opens_unverified_and_reads_what_xarray_reads():
    with pytest.warns(UserWarning, match=rf"path: {OLD} has no checksums"):
        ds = vc.open_traces(OLD)
    assert ds.attrs["checksums"].startswith("none: ")
    for name, values in _raw(OLD).items():
        np.testing.assert_array_equal(ds[name].values, values, err_msg=name)


def test_resuming_a_store_without_checksums_keeps_it_one_without(tmp_path, store):
    path = _copy(store, tmp_path)
    shutil.rmtree(path / "checksum")
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"].pop("checksums")
    (path / "zarr.json").write_text(json.dumps(meta))
    zarr.open_group(str(path), mode="r+")["done"][2] = False
    vc.trace_many(MODEL, IMAGES, path, targets="top1", batch_size=2, progress=False)  # traces image 2 again
    assert not (path / "checksum").exists()  # not half checked: no image of it reads as verified
    with pytest.warns(UserWarning, match="has no checksums"):
        ds = vc.open_traces(path)
    for name, values in _raw(store).items():
        np.testing.assert_array_equal(ds[name].values, values, err_msg=name)


# The writer killed (os._exit: no finally) after its second batch's arrays and checksums are written and before
# they are marked done.
KILLED = """
    import os, sys, warnings
    import torch
    torch.set_num_threads(int(sys.argv[3]))  # as in this process: the same kernels, bitwise the same values
    warnings.simplefilter("ignore")
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/.."]
    from store_trace import IMAGE, MODEL
    import vitcam_nb as vc
    from vitcam_nb.capture.store import Store

    real = Store.mark_done
    def killed(self, batch):
        if int(batch["image"].values[0]) > 0:
            os._exit(3)
        return real(self, batch)
    Store.mark_done = killed
    vc.trace_many(MODEL, [IMAGE, IMAGE // 2, 255 - IMAGE], sys.argv[2], targets="top1", batch_size=2,
                  progress=False)
"""


def test_a_store_resumed_after_its_writer_was_killed_verifies_whole(tmp_path, store):
    path = tmp_path / "killed.zarr"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-c", textwrap.dedent(KILLED), str(Path(__file__).parent), str(path),
            str(torch.get_num_threads())]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert zarr.open_group(str(path), mode="r")["done"][:].tolist() == [True, True, False]
    vc.trace_many(MODEL, IMAGES, path, targets="top1", batch_size=2, progress=False)
    ds = vc.open_traces(path)
    assert ds.attrs["checksums"] == VERIFIED
    for name, values in _raw(store).items():  # every chunk read through its checksum: all verify
        np.testing.assert_array_equal(ds[name].values, values, err_msg=name)
    assert [str(s) for s in zarr.open_group(str(path), mode="r")["checksum"][:]] == [
        str(s) for s in zarr.open_group(str(store), mode="r")["checksum"][:]]
