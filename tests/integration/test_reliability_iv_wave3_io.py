"""Issue 52 (Reliability IV), battery 2, files: ``vc.save`` refuses, before the disk is touched, a destination no
file can be created in and a trace ``vc.load`` would refuse; ``vc.load`` of a netCDF whose HDF5 metadata is damaged,
``vc.open_maps`` of a non-path and ``vc.image_trace`` of a map store are refused by name (kit errors), not by
h5py's, pathlib's or xarray's own exceptions.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import pytest

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb.core.errors import ArgumentTypeError, TraceFileError
from vitcam_nb.models import sample_image

MODEL = vc.load_model("shapes-vit")
TR = vc.trace(MODEL, sample_image("shapes", 0), targets="top2")


def _tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or ``path`` itself) by its sha256: what a refused call must leave as it was."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.mark.parametrize("back", [1000, 2000, 3000])
def test_a_netcdf_with_damaged_hdf5_metadata_is_refused_naming_the_path(tmp_path, back):
    p = tmp_path / "t.nc"
    vc.save(TR, p)
    raw = bytearray(p.read_bytes())
    raw[len(raw) - back] ^= 0x20  # the attribute heap near the end: h5py raised a bare RuntimeError
    q = tmp_path / "flipped.nc"
    q.write_bytes(bytes(raw))
    with pytest.raises(TraceFileError, match=f"^path: {q}"):
        vc.load(q)


@pytest.mark.parametrize("ext", ["nc", "zarr"])
def test_saving_a_trace_with_its_attrs_stripped_is_refused_before_the_old_trace_is_touched(tmp_path, ext):
    p = tmp_path / f"t.{ext}"
    vc.save(TR, p)
    before = _tree(p)
    with pytest.raises(TraceFileError, match="^trace: the trace is not a vitcam_nb trace"):
        vc.save(TR.drop_attrs(), p, overwrite=True)
    assert _tree(p) == before
    assert vc.load(p).identical(vc.load(p))  # still a trace vc.load reads
    with pytest.raises(TraceFileError, match="^trace: "):
        vc.save(TR.drop_attrs(), tmp_path / f"new.{ext}")
    assert sorted(os.listdir(tmp_path)) == [f"t.{ext}"]


@pytest.mark.parametrize("where", ["/proc/vitcam_x.nc", "/proc/vitcam_x.zarr", "/sys/vitcam_x.zarr"])
def test_a_destination_no_file_can_be_created_in_is_refused_naming_the_path(where):
    with pytest.raises(TraceFileError, match=f"^path: cannot write {where}"):
        vc.save(TR, where)
    assert not os.path.exists(where)


def test_a_destination_inside_a_file_is_refused_naming_the_path(tmp_path):
    user = tmp_path / "user.nc"
    user.write_text("mine")
    with pytest.raises(TraceFileError, match="^path: .*user.nc is a file, not a folder"):
        vc.save(TR, user / "x.nc")
    assert user.read_text() == "mine" and os.listdir(tmp_path) == ["user.nc"]


@pytest.mark.parametrize("bad", [None, ["x"], 5])
def test_open_maps_refuses_a_non_path_by_name(bad):
    with pytest.raises(ArgumentTypeError, match="^path: expected a file or folder path"):
        vc.open_maps(bad)


def test_image_trace_of_a_map_store_points_at_image_maps(tmp_path):
    p = tmp_path / "maps.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vc.map_many(MODEL, [sample_image("shapes", 1)], [Recipe()], p, progress=False)
    store = vc.open_maps(p)
    with pytest.raises(ArgumentTypeError, match=r"^ds: this is a map store .*vc\.image_maps"):
        vc.image_trace(store, 0)
    assert vc.image_maps(store, 0)["maps"].shape[0] == 1  # the store itself is fine
