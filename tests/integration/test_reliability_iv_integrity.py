"""Issue 52, map store integrity: a map store's chunks are checked against the per-image checksums written with
them (a flipped byte zstd does not detect is refused, never read as another map); a store written before checksums
opens, said unverified; a stored map is found by every spelling of it (its canonical form on the store's model); a
recipe table whose JSON no longer matches its ids, or that is empty, is refused when the store is opened; and
``open_maps(incomplete=...)`` and ``worker_model`` are checked by type before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from store_trace import IMAGE, MODEL

import vitcam_nb as vc
from vitcam_nb import Recipe as R

A, B = IMAGE, IMAGE // 2
#: Three blocks (tests/vitcam_testing.py): layer -1 is block 2.
STORED = [R(), R(layer=(2, 0), layer_fusion="mean"), R(site="F4", layer="all", layer_fusion="max")]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("integrity") / "m.zarr"
    return vc.map_many(MODEL, [A, B], STORED, path, batch_size=1, progress=False)


def _copy(store: Path, tmp_path: Path) -> Path:
    path = tmp_path / "m.zarr"
    shutil.copytree(store, path)
    return path


def _grids(path: Path, i: int) -> list[np.ndarray]:
    one = vc.image_maps(vc.open_maps(path), i)
    return [np.asarray(vc.cam(one, r, grid=True).values) for r in STORED]


def _edit_attrs(path: Path, edit) -> None:
    meta = json.loads((path / "zarr.json").read_text())
    edit(meta["attributes"])
    (path / "zarr.json").write_text(json.dumps(meta))


def _decoded(path: Path) -> np.ndarray | None:
    """Image 0's maps as zarr itself decodes them, independently of vitcam_nb; None where zstd detects damage."""
    try:
        return np.asarray(zarr.open_group(str(path), mode="r")["maps"][0])
    except Exception:  # noqa: BLE001 - zarr and numcodecs raise several types
        return None


def test_a_maps_chunk_changed_on_disk_is_refused_never_read_as_another_map(tmp_path, store):
    path = _copy(store, tmp_path)
    good = [_grids(path, i) for i in (0, 1)]
    chunk = path / "maps" / "c" / "0" / "0" / "0" / "0"  # image 0's maps (batch_size=1: one image per chunk)
    original = chunk.read_bytes()
    stored = _decoded(path)
    silent = []
    for k in range(0, len(original), 5):  # one bit flipped, at every fifth byte of the compressed chunk
        data = bytearray(original)
        data[k] ^= 0x10
        chunk.write_bytes(bytes(data))
        decoded = _decoded(path)
        if decoded is not None and np.array_equal(decoded, stored, equal_nan=True):
            assert all(np.array_equal(a, b) for a, b in zip(_grids(path, 0), good[0]))  # same values: read
            continue
        if decoded is not None:
            silent.append(k)  # the battery's HIGH: zstd decodes other values without a word
        with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is damaged: .*image 0"):
            vc.cam(vc.image_maps(vc.open_maps(path), 0), STORED[0])
        if decoded is not None:  # the refusal names the array the checksum caught
            with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is damaged: image 0's array 'maps' no "
                                                        "longer matches the checksum written with it"):
                vc.cam(vc.open_maps(path), STORED[1])  # every image's map: image 0 refuses it
    assert len(silent) > 5  # the case checksums exist for is exercised
    for damage in (lambda f: f.unlink(), lambda f: f.write_bytes(original[: len(original) // 2]),
                   lambda f: f.write_bytes(b"\0" * len(original)), lambda f: f.write_bytes(b"")):
        chunk.write_bytes(original)
        damage(chunk)
        with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is damaged: .*'maps'.*image 0|"
                                                    rf"^path: {path} is damaged: image 0's array 'maps'"):
            vc.image_maps(vc.open_maps(path), 0)
    chunk.write_bytes(original)
    assert all(np.array_equal(a, b) for i in (0, 1) for a, b in zip(_grids(path, i), good[i]))


def test_a_per_image_fact_changed_on_disk_is_refused_by_its_checksum(tmp_path, store):
    path = _copy(store, tmp_path)
    group = zarr.open_group(str(path), mode="r+")
    group["scale"][1, 0] = np.float32(group["scale"][1, 0]) * 2  # a valid chunk, other values: zstd cannot tell
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is damaged: image 1's array 'scale' no longer"):
        vc.image_maps(vc.open_maps(path), 1)
    vc.image_maps(vc.open_maps(path), 0)  # image 0's values are whole


def test_a_store_written_before_checksums_opens_unverified(tmp_path, store):
    path = _copy(store, tmp_path)
    # the layout of a 0.2.0 / 0.3.0 store: no checksum array, no attribute
    shutil.rmtree(path / "checksum", ignore_errors=True)
    _edit_attrs(path, lambda a: a.pop("checksums", None))
    with pytest.warns(UserWarning, match=rf"path: {path} has no checksums \(none: this store was written before"):
        ds = vc.open_maps(path)
    assert ds.attrs["checksums"].startswith("none: ")
    assert vc.open_maps(store).attrs["checksums"] == "sha256 per image and array, verified on read"
    for i in (0, 1):
        assert all(np.array_equal(a, b) for a, b in zip(_grids(path, i), _grids(store, i)))
    # A store whose attributes say it has checksums, but lacks them, is damaged, not old.
    shutil.rmtree(path)
    shutil.copytree(store, path)
    shutil.rmtree(path / "checksum")
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is a damaged map store: it lacks the array "
                                                "'checksum'"):
        vc.open_maps(path)


SPELLINGS = [  # each a spelling of a stored map on this 3-block model: (spelling, the stored recipe it reads)
    (R(layer=2), STORED[0]), (R(layer=(2,), layer_fusion="mean"), STORED[0]), (R(layer=(-1,), layer_fusion="max"),
                                                                                STORED[0]),
    (R(layer=(0, 2), layer_fusion="mean"), STORED[1]), (R(layer=(-3, -1), layer_fusion="mean"), STORED[1]),
    (R(layer=(0, -1), layer_fusion="mean", upsample="nearest"), STORED[1].replace(upsample="nearest")),
    (R(site="F4", layer=(0, 1, 2), layer_fusion="max"), STORED[2]),
    (R(site="F4", layer=(2, 1, 0), layer_fusion="max"), STORED[2]),
]


@pytest.mark.parametrize(("spelling", "stored"), SPELLINGS, ids=[s.to_string()[:24] for s, _ in SPELLINGS])
def test_a_map_store_serves_every_spelling_of_a_stored_map(store, spelling, stored):
    one = vc.image_maps(vc.open_maps(store), 1)
    trace = vc.trace(MODEL, B, targets="top1")
    assert spelling.canonical_id(trace) == stored.canonical_id(trace)  # the same map, by the kit's own ids
    got, want = vc.cam(one, spelling), vc.cam(one, stored)
    np.testing.assert_array_equal(got.values, want.values)
    assert got.attrs["recipe_id"] == spelling.id  # labelled as asked, as vc.cam on a trace labels it
    # and the map vc.cam computes for the spelling on the image's own trace (another pass: float32 rounding)
    np.testing.assert_allclose(got.values, vc.cam(trace, spelling).values, atol=1e-5)
    assert spelling.canonical_id(one) == spelling.canonical_id(trace)
    whole = vc.cam(vc.open_maps(store), spelling)
    np.testing.assert_array_equal(whole.values[1], got.values)


def test_a_recipe_not_stored_is_still_refused_by_name(store):
    one = vc.image_maps(vc.open_maps(store), 0)
    for missing in (R(layer=1), R(layer=(0, 1), layer_fusion="mean"), R(layer=(2, 0), layer_fusion="sum"),
                    R(site="F4", layer=(0, 1, 2), layer_fusion="mean")):
        with pytest.raises(vc.RecipeError, match=rf"^recipe: .*\(id {missing.id}\) is not in this map store"):
            vc.cam(one, missing)
        with pytest.raises(vc.RecipeError, match="is not in this map store"):
            missing.canonical_id(vc.open_maps(store))  # refused on the whole store too, as vc.cam refuses it


def test_a_recipe_table_whose_json_was_swapped_is_refused_at_open(tmp_path, store):
    path = _copy(store, tmp_path)

    def swap(attrs: dict) -> None:
        rows = json.loads(attrs["recipes"])
        rows[0]["json"], rows[1]["json"] = rows[1]["json"], rows[0]["json"]
        attrs["recipes"] = json.dumps(rows)

    _edit_attrs(path, swap)
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is a damaged map store: recipe table entry 0 "
                                                rf"\('F1@-1 .*id '{STORED[0].id}'\) does not match the recipe its "
                                                rf"JSON holds \(.*id {STORED[1].id}\)"):
        vc.open_maps(path)


@pytest.mark.parametrize(("table", "problem"), [("[]", "its recipe table is empty"),
                                                ([], "its attribute 'recipes' is not the recipe table"),
                                                ({"key": 1}, "its attribute 'recipes' is not the recipe table")])
def test_an_empty_recipe_table_is_refused_at_open_with_the_path(tmp_path, store, table, problem):
    path = _copy(store, tmp_path)
    _edit_attrs(path, lambda a: a.__setitem__("recipes", table))
    with pytest.raises(vc.TraceFileError, match=rf"^path: {path} is a damaged map store: {problem}"):
        vc.open_maps(path)


def test_open_maps_refuses_an_incomplete_that_is_not_a_bool(store):
    for value in ("x", 1, None):
        with pytest.raises(vc.ArgumentTypeError, match=rf"^incomplete: expected True or False, got {value!r}"):
            vc.open_maps(store, incomplete=value)


@pytest.mark.parametrize("value", [5, "vit_tiny_patch16_224", {"name": "vit"}])
@pytest.mark.parametrize("kind", ["map_many", "trace_many"])
def test_a_worker_model_that_is_not_a_spec_is_refused_before_any_pass(tmp_path, kind, value):
    calls = []
    hook = MODEL.register_forward_hook(lambda *_: calls.append(1))
    path = tmp_path / "s.zarr"
    try:
        with pytest.raises(vc.ArgumentTypeError, match=r"^worker_model: expected None or a dict \{'timm': "):
            if kind == "map_many":
                vc.map_many(MODEL, [A, B], ["gradcam"], path, worker_model=value, progress=False)
            else:
                vc.trace_many(MODEL, [A, B], path, targets="top1", worker_model=value, progress=False)
    finally:
        hook.remove()
    assert calls == [] and not path.exists()
