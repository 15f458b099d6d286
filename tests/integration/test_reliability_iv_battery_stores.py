"""Battery findings on stores: an image of a map store can be displayed; a map store whose image size was edited to
0, a ``max_bytes`` too small for map_many, a map store given to vc.save and a corrupted chunk of a trace_many store
are each refused by the kit, naming the argument or the store and the array, before any write."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from store_trace import IMAGE, MODEL

import vitcam_nb as vc

A, B = IMAGE, IMAGE // 2


@pytest.fixture(scope="module")
def maps_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("battery") / "m.zarr"
    return vc.map_many(MODEL, [A, B], ["gradcam"], path, batch_size=1, progress=False)


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_an_image_of_a_map_store_displays_its_text_arrays(maps_store):
    one = vc.image_maps(vc.open_maps(maps_store), 1)
    text = repr(one)  # an AttributeError ('str' object has no attribute 'dtype') before
    html = one._repr_html_()
    trace_id = str(one["trace_id"].values)
    assert len(trace_id) == 16 and trace_id in text and trace_id in html
    for name in ("trace_id", "input_sha256", "source", "provenance"):
        assert one[name].shape == () and one[name].dtype.kind == "U"
    # The values are the ones the store holds for image 1 (read with zarr, independently of xarray).
    import zarr
    group = zarr.open_group(str(maps_store), mode="r")
    for name in ("trace_id", "input_sha256", "provenance"):
        assert str(one[name].values) == str(group[name][1])
    assert json.loads(str(one["provenance"].values))["trace_id"] == trace_id
    vc.cam(one, vc.presets.gradcam())  # still readable as before


@pytest.mark.parametrize("name", ["img_height", "img_width"])
@pytest.mark.parametrize("value", [0, -3, 2.5, "32"])
def test_a_map_store_with_an_edited_image_size_is_refused_by_name(tmp_path, maps_store, name, value):
    path = tmp_path / "m.zarr"
    shutil.copytree(maps_store, path)
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"][name] = value
    (path / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is a damaged map store: its attribute '{name}' is "
                                                f"{re.escape(repr(value))}, not the positive image size"):
        vc.cam(vc.open_maps(path), vc.presets.gradcam())


def test_a_tiny_max_bytes_of_map_many_is_named_and_readable(tmp_path):
    path = tmp_path / "m.zarr"
    # Per image: the 4x4 float32 patch-grid map (64 B) and 64 B of its recipe's row; a batch of 2 images: 256 B.
    with pytest.raises(vc.TraceError, match=r"^max_bytes: 1 recipes \(0 fused parts\) need about 256 B of maps "
                                            r"per batch of 2, above max_bytes=10 \(10 B\)"):
        vc.map_many(MODEL, [A, B], ["gradcam"], path, batch_size=2, max_bytes=10, progress=False)
    assert not path.exists()


def test_vc_save_refuses_a_map_store_by_name_before_writing(tmp_path, maps_store):
    before = _files(maps_store)
    for ds in (vc.open_maps(maps_store), vc.image_maps(vc.open_maps(maps_store), 0)):
        for target in (tmp_path / "copy.zarr", tmp_path / "copy.nc", maps_store):
            with pytest.raises(vc.ArgumentTypeError, match=r"^trace: this is a map store from vc.open_maps"):
                vc.save(ds, target, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert _files(maps_store) == before


def test_a_corrupted_chunk_of_a_trace_many_store_is_named_by_store_and_array(tmp_path):
    path = vc.trace_many(MODEL, [A, B], tmp_path / "t.zarr", targets="top1", sites=["F1"], batch_size=1,
                         progress=False)
    good = vc.image_trace(vc.open_traces(path), 1)
    # The first index of a chunk's key is its image (batch_size=1: one image per chunk).
    chunks = sorted(p for p in (path / "grad" / "c" / "0").rglob("*") if p.is_file())
    assert chunks and len(chunks) == len([p for p in (path / "grad" / "c" / "1").rglob("*") if p.is_file()])
    data = bytearray(chunks[0].read_bytes())
    data[40] ^= 0x01
    chunks[0].write_bytes(bytes(data))
    ds = vc.open_traces(path)
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is damaged: array 'grad' of image 0 cannot be read"):
        vc.image_trace(ds, 0)
    again = vc.image_trace(ds, 1)  # image 1's chunks are whole
    np.testing.assert_array_equal(again["grad"].values, good["grad"].values)
