"""Issue #32, trace files and stores refused with the kit's own errors: damaged and edited files, declared sizes
checked before a load allocates them, and odd recipes refused by a store exactly as by a single trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_trace import IMAGE, MODEL, TRACE

import vitcam_nb as vc


# -- damaged and edited files ------------------------------------------------------------------------------
def _edited(tmp_path: Path, edit, name: str = "t.nc") -> Path:
    """A trace edited in memory and saved (a valid checksum: only the schema checks can refuse it)."""
    ds = TRACE.copy(deep=True)
    return vc.save(edit(ds) or ds, tmp_path / name)


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
@pytest.mark.parametrize(("edit", "message"), [
    (lambda ds: ds.attrs.update(schema_version="abc"), r"has schema_version 'abc'; this vitcam_nb reads \[1\]"),
    (lambda ds: ds.attrs.update(schema_version=1.7), r"has schema_version 1.7; this vitcam_nb reads \[1\]"),
    (lambda ds: ds.assign_coords(patch_row=("token", np.r_[ds["patch_row"].values[:-1], 99])),
     r"is a damaged or edited trace: coordinate 'patch_row' holds values outside -1..3 \(grid_h 4\)"),
    (lambda ds: ds.assign(grad=ds["grad"].transpose(*reversed(ds["grad"].dims))),
     r"is a damaged or edited trace: variable 'grad' has dimensions \('channel', 'token', 'site', 'layer', "
     r"'target'\); the schema's are \('target', 'layer', 'site', 'token', 'channel'\)"),
])
def test_load_refuses_an_edited_trace_by_name(tmp_path, suffix, edit, message):
    path = _edited(tmp_path, edit, f"t{suffix}")
    for verify in (True, False):
        with pytest.raises(vc.TraceFileError, match=rf"^path: {path} " + message):
            vc.load(path, verify=verify)


@pytest.mark.parametrize(("value", "kind"), [(np.arange(3), r"ndarray of shape \(3,\)"),
                                             (np.void(b"\x00\x01"), r"void of shape \(\)")])
def test_load_refuses_an_array_or_bytes_attribute(tmp_path, value, kind):
    import h5py

    path = vc.save(TRACE, tmp_path / "t.nc")
    with h5py.File(path, "r+") as f:
        f.attrs["model_name"] = value
    for verify in (True, False):
        with pytest.raises(vc.TraceFileError, match=rf"edited trace: attribute 'model_name' is {kind}; a trace's "
                                                    "attributes are single str, int or float values"):
            vc.load(path, verify=verify)


def _declare_huge(path: Path, n: int) -> None:
    """Add an array of ``n`` float64 to a saved trace, chunked and never written: a tiny file declaring it."""
    if path.suffix == ".nc":
        import h5py

        with h5py.File(path, "r+") as f:
            f.create_dataset("huge", shape=(n,), dtype="f8", chunks=(1024,), compression="gzip")
    else:
        import zarr

        group = zarr.open_group(str(path), mode="r+")
        group.create_array("huge", shape=(n,), dtype="f8", chunks=(1024,), attributes={"_ARRAY_DIMENSIONS": ["h"]})
        zarr.consolidate_metadata(str(path))


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_load_checks_declared_sizes_before_allocating_them(tmp_path, suffix):
    path = vc.save(TRACE, tmp_path / f"t{suffix}")
    assert vc.load(path, max_bytes=1e6)["act"].shape == TRACE["act"].shape  # a 25 kB trace fits in 1 MB
    with pytest.raises(vc.TraceFileError, match=r"declares 0.00 GB of arrays .* over the budget of 0.00 GB "
                                                r"\(max_bytes\); nothing was read"):
        vc.load(path, max_bytes=1e3)
    _declare_huge(path, 2**47)  # 1.1 PB declared, a few kB on disk
    assert sum(f.stat().st_size for f in [path, *path.rglob("*")] if f.is_file()) < 1e6
    with pytest.raises(vc.TraceFileError, match=r"declares 1125899.91 GB of arrays \(the largest, '/?huge', of "
                                                r"shape \(140737488355328,\)\), over the budget of .* GB \(50% of "
                                                "the available memory\\); nothing was read"):
        vc.load(path)
    with pytest.raises(vc.TraceError, match=r"^max_bytes: expected a positive number of bytes or None, got '1GB'"):
        vc.load(path, max_bytes="1GB")


KIT_ERRORS = (vc.TraceFileError, vc.TraceError, vc.RecipeError)
# Written straight into the file through h5py, which refuses a string holding NUL before the kit is called (the
# kit's own refusal of a NUL through vc.save is drawn by the "attr" edits below; test_reliability_store_args too).
RAW_TEXT = st.text(st.characters(exclude_characters="\x00"), max_size=8)
ATTR_VALUES = st.one_of(RAW_TEXT, st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                        st.lists(st.integers(-9, 9), min_size=1, max_size=3).map(np.array),
                        st.binary(min_size=1, max_size=4).map(np.void))
COORDS = ["layer", "site", "token", "token_kind", "patch_row", "patch_col", "target", "target_class",
          "target_label", "class", "class_label", "y", "x", "rgb"]


def _coord_values(name: str, data) -> np.ndarray:
    n = TRACE[name].size
    kind = data.draw(st.sampled_from(["int", "str", "float"]), label="coordinate kind")
    if kind == "int":
        return np.array(data.draw(st.lists(st.integers(-40, 40), min_size=n, max_size=n), label="ints"), np.int64)
    if kind == "float":
        return np.array(data.draw(st.lists(st.floats(-40, 40), min_size=n, max_size=n), label="floats"))
    return np.array(data.draw(st.lists(st.text("abcF1_ ", max_size=6), min_size=n, max_size=n), label="strs"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_load_of_edited_files_raises_only_kit_errors(data):
    """Random attribute and coordinate edits: written through save (valid checksum) or straight into the file
    (h5py: arrays and bytes save refuses); vc.load returns a trace or refuses with the kit's own error."""
    import tempfile

    import h5py

    ds = TRACE.copy(deep=True)
    raw = {}
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        what = data.draw(st.sampled_from(["attr", "raw attr", "coord"]), label="edit")
        key = data.draw(st.sampled_from([*TRACE.attrs, "extra"]), label="key")
        if what == "coord":
            name = data.draw(st.sampled_from(COORDS), label="coordinate")
            ds = ds.assign_coords({name: (TRACE[name].dims, _coord_values(name, data))})
        elif what == "attr":
            ds.attrs[key] = data.draw(st.one_of(st.text(max_size=8), st.integers(-2**40, 2**40), st.floats()))
        else:
            raw[key] = data.draw(ATTR_VALUES, label="value")
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = vc.save(ds, Path(folder) / "t.nc")
        except vc.TraceFileError as exc:  # a text attribute holding a NUL character, which netCDF cannot store
            assert "holds a NUL character" in str(exc)
            return
        with h5py.File(path, "r+") as f:
            f.attrs.update(raw)
        try:
            vc.load(path)
            vc.load(path, verify=False)
        except KIT_ERRORS:
            pass


def test_the_fuzz_setup_draws_nothing_h5py_refuses_and_its_draws_are_the_same_every_run():
    from hypothesis import find, settings
    from hypothesis.errors import NoSuchExample

    with pytest.raises(NoSuchExample):  # the draw that failed the test's own setup (issue 51) cannot come
        find(RAW_TEXT, lambda v: "\x00" in v, settings=settings(max_examples=300))  # st.text: found in 1 draw
    # tests/conftest.py's profile: the same examples every run, nothing kept between runs
    assert settings.default.derandomize and settings.default.database is None


# -- a store refuses a recipe exactly as a single trace does ------------------------------------------------
@pytest.fixture(scope="module")
def store_and_trace(tmp_path_factory):
    path = vc.trace_many(MODEL, [IMAGE, 255 - IMAGE], tmp_path_factory.mktemp("s") / "s.zarr", targets="top2",
                         sites=["F1", "F2", "F6"], layers=[0, 2], progress=False)
    ds = vc.open_traces(path)
    return ds, vc.image_trace(ds, 0)


def _outcome(compute):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return "map", np.asarray(compute())
        except Exception as exc:  # the comparison is the point: whatever one raises, the other must too
            return type(exc), str(exc)


def _same(single, store) -> None:
    assert single[0] == store[0], (single, store)
    if single[0] == "map":
        np.testing.assert_array_equal(store[1], single[1])
    else:
        assert store[1] == single[1]


def test_a_store_refuses_a_stage_block_layer_as_a_single_trace_does(store_and_trace):
    ds, one = store_and_trace
    recipe = vc.Recipe(layer="1.0")
    with pytest.raises(vc.RecipeError, match=r"^layer: '1.0' is a 'stage.block' address, which only hierarchical"):
        vc.cam(ds, recipe)
    _same(_outcome(lambda: vc.cam(one, recipe).values), _outcome(lambda: vc.cam(ds, recipe).values[0]))
    # A site the recipe needs that the store lacks: the message lists every traced site, as the trace's does.
    recipe = vc.Recipe(site="F4")
    with pytest.raises(vc.RecipeError, match=r"traced sites: \['F1', 'F6', 'F2'\]"):
        vc.cam(ds, recipe)


def _recipes():
    from vitcam_nb.core import recipe as R
    from vitcam_nb.core.weighting import weighting_names

    choices = dict(site=["F1", "F2", "F6", "F4", "bogus"],
                   layer=[0, 1, 2, -1, -3, 3, 99, "1.0", "all", (0, 2), (0, 1), True, "0"],
                   class_=["top1", "top2", "top3", 0, 9, 10, -1, "expected"], target=list(R.TARGETS),
                   weighting=[*weighting_names(), "bogus"], layer_fusion=list(R.LAYER_FUSIONS),
                   heads=[*R.HEAD_RULES, 0, 1, 5], attn_rows=list(R.ATTN_ROWS), upsample=list(R.UPSAMPLES),
                   weight_tokens=list(R.WEIGHT_TOKENS), normalize=list(R.NORMALIZES), relu=list(R.RELUS))
    return st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in choices.items()})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(fields=_recipes())
def test_fuzz_cam_on_a_store_matches_the_single_trace(store_and_trace, fields):
    ds, one = store_and_trace
    try:
        recipe = vc.Recipe(**fields)
    except vc.RecipeError:
        return
    _same(_outcome(lambda: vc.cam(one, recipe).values), _outcome(lambda: vc.cam(ds, recipe).values[0]))
