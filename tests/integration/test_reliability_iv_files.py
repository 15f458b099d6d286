"""Issue #52, trace files: ``vc.load`` of a foreign file reads only what the trace schema defines at the sizes it
declares, and ``vc.save`` to a full disk names the path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from store_trace import TRACE

import vitcam_nb as vc
from vitcam_nb.capture import budget


def _declare(path: Path, name: str, n: int, dim: str) -> None:
    """Add an array ``name`` of ``n`` float64 on dimension ``dim`` to a saved trace, chunked and never written."""
    if path.suffix == ".nc":
        import h5py

        with h5py.File(path, "r+") as f:
            f.create_dataset(name, shape=(n,), dtype="f8", chunks=(1024,), compression="gzip")
    else:
        import zarr

        group = zarr.open_group(str(path), mode="r+")
        group.create_array(name, shape=(n,), dtype="f8", chunks=(1024,), attributes={"_ARRAY_DIMENSIONS": [dim]})
        zarr.consolidate_metadata(str(path))


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_load_does_not_allocate_a_huge_array_the_schema_does_not_define(tmp_path, monkeypatch, suffix):
    path = vc.save(TRACE, tmp_path / f"t{suffix}")
    _declare(path, "junk", 2**40, "junk")  # 8.8 TB declared, a few kB on disk
    # A machine whose memory budget it fits in (the check must not depend on this machine's RAM)
    monkeypatch.setattr(budget, "available_bytes", lambda: 1e16)
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} declares '/?junk' of shape \(1099511627776,\) "
                                                r"\(8796.09 GB\), an array the trace schema does not define, larger "
                                                r"than any it does \(67 MB\); nothing was read"):
        vc.load(path)


def test_load_refuses_arrays_that_disagree_on_a_dimension(tmp_path, monkeypatch):
    path = vc.save(TRACE, tmp_path / "t.zarr")
    _declare(path, "extra", 2**40, "token")  # the trace's token dimension has 17
    monkeypatch.setattr(budget, "available_bytes", lambda: 1e16)
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} declares '.*' with dimension 'token' of size "
                                                r"(17|1099511627776), and '.*' with (17|1099511627776); a trace's "
                                                "arrays agree on their dimensions"):
        vc.load(path)


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_load_keeps_a_small_array_of_the_users(tmp_path, suffix):
    extra = TRACE.assign(note=("note", np.arange(5.0)))
    back = vc.load(vc.save(extra, tmp_path / f"t{suffix}"))
    np.testing.assert_array_equal(back["note"].values, np.arange(5.0))
    assert back["act"].equals(TRACE["act"])


def test_save_zarr_on_a_full_disk_names_the_path(tmp_path, monkeypatch):
    import xarray as xr

    old = vc.save(TRACE, tmp_path / "t.zarr")
    before = {p.relative_to(old).as_posix(): p.read_bytes() for p in old.rglob("*") if p.is_file()}

    def full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(xr.Dataset, "to_zarr", full)
    with pytest.raises(OSError, match=rf"^\[Errno 28\] path: could not write {old} \(No space left on device\); "
                                      "any file there was left as it was"):
        vc.save(TRACE, old, overwrite=True)
    assert {p.relative_to(old).as_posix(): p.read_bytes() for p in old.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.zarr"]
