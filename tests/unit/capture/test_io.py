"""Acceptance tests of save/load (issue #2): round trips, damaged and foreign files, atomic writes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xarray as xr

import vitcam_nb as vc


@pytest.fixture(scope="module")
def traces(model_factory, model_input):
    """A float32 and a float16 trace of a tiny distilled DeiT (prefix tokens, all sites)."""
    model, x = model_factory("deit_distilled"), model_input("deit_distilled")
    sites = ["F1", "F2", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid"]
    return {
        "float32": vc.trace(model, x, targets="top3", sites=sites),
        "float16": vc.trace(model, x, targets=[1, 4], dtype="float16"),
    }


def _only(folder) -> list[str]:
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_round_trip_identical(traces, tmp_path, suffix, dtype):
    tr = traces[dtype]
    attrs_before = dict(tr.attrs)
    path = vc.save(tr, tmp_path / f"t{suffix}")
    assert str(path) == str(tmp_path / f"t{suffix}")
    assert dict(tr.attrs) == attrs_before, "save must not modify the trace it was given"
    loaded = vc.load(tmp_path / f"t{suffix}")
    xr.testing.assert_identical(loaded, tr)
    for name in ("act", "grad", "attn", "attn_grad"):
        assert loaded[name].dtype == np.dtype(dtype), name
    assert loaded["image"].dtype == np.uint8
    assert _only(tmp_path) == [f"t{suffix}"], "temporary files left behind"
    # fully in memory: no lazy arrays
    for name, var in loaded.variables.items():
        assert isinstance(var.data, np.ndarray), name
    # loads from a str path too, and a second save over an existing file works
    vc.save(loaded, str(tmp_path / f"t{suffix}"))
    xr.testing.assert_identical(vc.load(str(tmp_path / f"t{suffix}")), tr)
    assert _only(tmp_path) == [f"t{suffix}"]


def test_truncated_netcdf_refused(traces, tmp_path):
    path = vc.save(traces["float32"], tmp_path / "t.nc")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(vc.TraceFileError) as info:
        vc.load(path)
    assert isinstance(info.value, ValueError)
    assert "t.nc" in str(info.value)


def test_empty_file_refused(tmp_path):
    (tmp_path / "empty.nc").write_bytes(b"")
    with pytest.raises(vc.TraceFileError):
        vc.load(tmp_path / "empty.nc")


def test_foreign_netcdf_refused(tmp_path):
    path = tmp_path / "foreign.nc"
    foreign = xr.Dataset({"a": ("x", np.arange(3.0))}, attrs={"title": "not a trace"})
    foreign.to_netcdf(path, engine="h5netcdf")
    with pytest.raises(vc.TraceFileError, match="foreign.nc"):
        vc.load(path)


def test_file_with_schema_but_no_checksum_refused(traces, tmp_path):
    path = tmp_path / "nochecksum.nc"
    traces["float32"].to_netcdf(path, engine="h5netcdf")
    with pytest.raises(vc.TraceFileError):
        vc.load(path)


def test_modified_zarr_value_fails_checksum(traces, tmp_path):
    import zarr

    tr = traces["float32"]
    path = vc.save(tr, tmp_path / "t.zarr")
    group = zarr.open_group(str(path), mode="r+")
    old = float(group["act"][0, 0, 0, 0])
    group["act"][0, 0, 0, 0] = old + 0.25
    assert float(group["act"][0, 0, 0, 0]) != old
    with pytest.raises(vc.TraceFileError, match="checksum"):
        vc.load(path)


def test_modified_netcdf_value_fails_checksum(traces, tmp_path):
    import h5py

    path = vc.save(traces["float32"], tmp_path / "t.nc")
    with h5py.File(path, "r+") as f:
        f["grad"][0, 0, 0, 0, 0] = f["grad"][0, 0, 0, 0, 0] + 1.0
    with pytest.raises(vc.TraceFileError, match="checksum"):
        vc.load(path)


def test_modified_attribute_fails_checksum(traces, tmp_path):
    import h5py

    path = vc.save(traces["float32"], tmp_path / "t.nc")
    with h5py.File(path, "r+") as f:
        f.attrs["model_name"] = "something_else"
    with pytest.raises(vc.TraceFileError, match="checksum"):
        vc.load(path)


@pytest.mark.parametrize("name", ["t.h5", "t.pkl", "t", "t.nc.bak"])
def test_wrong_suffix_refused(traces, tmp_path, name):
    with pytest.raises(ValueError, match="path") as info:
        vc.save(traces["float32"], tmp_path / name)
    assert name in str(info.value)
    assert _only(tmp_path) == []
    (tmp_path / name).write_bytes(b"x")
    with pytest.raises(ValueError, match="path"):
        vc.load(tmp_path / name)


def test_missing_file_refused(tmp_path):
    with pytest.raises(vc.TraceFileError, match="missing.nc"):
        vc.load(tmp_path / "missing.nc")


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_future_schema_version_refused_with_advice(traces, tmp_path, suffix):
    tr = traces["float32"].copy()
    tr.attrs["schema_version"] = 99
    path = vc.save(tr, tmp_path / f"future{suffix}")
    with pytest.raises(vc.TraceFileError, match="99") as info:
        vc.load(path)
    message = str(info.value).lower()
    assert "schema" in message
    assert "re-trace" in message or "convert" in message or "save" in message, message


def test_save_refuses_non_dataset(tmp_path):
    with pytest.raises(TypeError, match="trace"):
        vc.save({"act": 1}, tmp_path / "t.nc")


def test_failed_netcdf_write_leaves_nothing(traces, tmp_path, monkeypatch):
    def half_write(self, target=None, *args, **kwargs):  # save hands HDF5 a file object
        target.write(b"\x89HDF\r\n\x1a\n partial")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(xr.Dataset, "to_netcdf", half_write)
    with pytest.raises(OSError, match="simulated"):
        vc.save(traces["float32"], tmp_path / "t.nc")
    assert _only(tmp_path) == []


def test_failed_netcdf_write_keeps_the_previous_file(traces, tmp_path, monkeypatch):
    path = vc.save(traces["float32"], tmp_path / "t.nc")
    before = path.read_bytes()

    def half_write(self, target=None, *args, **kwargs):
        target.write(b"partial")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(xr.Dataset, "to_netcdf", half_write)
    with pytest.raises(OSError):
        vc.save(traces["float16"], tmp_path / "t.nc")
    monkeypatch.undo()
    assert _only(tmp_path) == ["t.nc"]
    assert path.read_bytes() == before
    xr.testing.assert_identical(vc.load(path), traces["float32"])


def test_failed_zarr_write_leaves_nothing(traces, tmp_path, monkeypatch):
    real = xr.Dataset.to_zarr

    def half_write(self, store=None, *args, **kwargs):
        real(self[["logits"]], store, *args, **kwargs)  # something really lands on disk
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(xr.Dataset, "to_zarr", half_write)
    with pytest.raises(OSError, match="simulated"):
        vc.save(traces["float32"], tmp_path / "t.zarr")
    assert _only(tmp_path) == []
