"""Issue #32 (export) and #36 ("an export offers only what it holds"): vc.export_html, vitcam-nb export and the
demo replace only files the kit wrote, atomically; every argument is refused by name before any map is computed
(limits estimated from the axes, layers out of range, wrong types); a page offers only the recipes it can show
and says once, in words for a reader, what it left out."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import math
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vitcam_testing import make_model

import vitcam_nb as vc
from vitcam_nb import demo
from vitcam_nb.cli import main
from vitcam_nb.core import outfiles
from vitcam_nb.core.outfiles import MANIFEST, OutputFolder
from vitcam_nb.core.weighting import channel_weighting_names
from vitcam_nb.widgets import bundle as bundle_module
from vitcam_nb.widgets.bundle import build_bundle

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.DegenerateMapWarning")

MODEL = make_model("vit")
IMAGE = np.random.default_rng(7).integers(0, 255, (32, 32, 3), dtype=np.uint8)
TRACE = vc.trace(MODEL, IMAGE, targets="top2")
SMALL = {"site": ["F1", "F4"], "layer": [-1], "weighting": ["gradcam"], "target": ["logit"], "class_": ["top1"]}
KIT_ERRORS = (vc.ExportError, vc.RecipeError, vc.TraceError, vc.TraceFileError)
ARGUMENTS = ("axes", "size", "max_mb", "quantize", "title", "opacity", "colormap", "path", "recipe", "trace")


@pytest.fixture
def spy(monkeypatch):
    """Counts the maps an export computes (every one goes through bundle.compute_grid)."""
    calls = []
    real = bundle_module.compute_grid

    def counted(trace, recipe):
        calls.append(recipe)
        return real(trace, recipe)

    monkeypatch.setattr(bundle_module, "compute_grid", counted)
    return calls


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


# -- files the kit did not write are kept -------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"my notes\n", b"<!doctype html><html><body>mine</body></html>"])
def test_export_refuses_a_file_it_did_not_write_and_leaves_it_alone(tmp_path, spy, content):
    path = tmp_path / "notes.html"
    path.write_bytes(content)
    with pytest.raises(vc.OutputExistsError, match=r"^path: .*notes\.html exists and is not a page vitcam_nb wrote"):
        vc.export_html(TRACE, path, axes=SMALL, progress=False)
    assert path.read_bytes() == content and spy == [] and leftovers(tmp_path) == []
    assert isinstance(vc.OutputExistsError("x"), vc.TraceFileError)  # the refusal type vc.save gives


def test_export_refuses_to_replace_a_saved_trace(tmp_path):
    path = vc.save(TRACE, tmp_path / "t.nc")
    before = path.read_bytes()
    with pytest.raises(vc.OutputExistsError):
        vc.export_html(TRACE, path, axes=SMALL, progress=False)
    assert path.read_bytes() == before and vc.load(path).attrs["trace_id"] == TRACE.attrs["trace_id"]


def test_export_replaces_its_own_page_and_overwrite_replaces_anything(tmp_path, capsys):
    path = tmp_path / "e.html"
    vc.export_html(TRACE, path, axes=SMALL, title="first", progress=False)
    assert "<title>first</title>" in path.read_text()
    vc.export_html(TRACE, path, axes=SMALL, title="second", progress=False)
    assert "<title>second</title>" in path.read_text()
    path.write_text("user file")
    vc.export_html(TRACE, path, axes=SMALL, title="third", overwrite=True, progress=False)
    assert "<title>third</title>" in path.read_text() and leftovers(tmp_path) == []


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "e.html"
    vc.export_html(TRACE, path, axes=SMALL, title="old", progress=False)
    old = path.read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outfiles.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        vc.export_html(TRACE, path, axes=SMALL, title="new", progress=False)
    assert path.read_bytes() == old and leftovers(tmp_path) == []


def test_cli_export_refuses_a_users_file_unless_overwrite(tmp_path, capsys):
    vc.save(TRACE, tmp_path / "t.nc")
    out = tmp_path / "page.html"
    out.write_text("keep me")
    args = ["export", str(tmp_path / "t.nc"), "--out", str(out), "--axes", "site=F1", "--axes", "layer=-1",
            "--axes", "weighting=gradcam", "--quiet"]
    assert main(args) == 2
    assert "is not a page vitcam_nb wrote" in capsys.readouterr().err and out.read_text() == "keep me"
    assert main([*args, "--overwrite"]) == 0 and out.read_text().startswith("<!doctype html>")


def test_demo_refuses_a_folder_with_a_users_report_before_any_work(tmp_path, monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("the demo loaded a model before checking its outputs")

    monkeypatch.setattr(demo, "load_model", no_model)
    (tmp_path / "report.html").write_text("my report")
    (tmp_path / "recipes.json").write_text("{}")
    with pytest.raises(vc.OutputExistsError, match="report.html exists and is not a file vitcam_nb wrote"):
        demo.run_demo(tmp_path, progress=False)
    assert main(["demo", "--out", str(tmp_path), "--quiet"]) == 2
    assert "report.html" in capsys.readouterr().err
    assert (tmp_path / "report.html").read_text() == "my report" and (tmp_path / "recipes.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipes.json", "report.html"]


@pytest.mark.slow
def test_the_demo_replaces_its_own_outputs_and_keeps_a_file_the_user_changed(tmp_path, monkeypatch):
    if "shapes-vit" not in vc.models.bundled_names():
        pytest.skip("bundled model shapes-vit is not available")
    first = demo.run_demo(tmp_path, progress=False)
    listed = json.loads((tmp_path / MANIFEST).read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in first.values()) == sorted(demo.OUTPUTS)
    again = demo.run_demo(tmp_path, progress=False)  # every file is one it wrote: replaced
    assert again == first and leftovers(tmp_path) == []
    (tmp_path / "report.html").write_text("my edits")
    monkeypatch.setattr(demo, "load_model", lambda *a, **k: pytest.fail("the demo started before its check"))
    with pytest.raises(vc.OutputExistsError, match=r"report.html exists .* \(or it changed since\)"):
        demo.run_demo(tmp_path, progress=False)
    assert (tmp_path / "report.html").read_text() == "my edits"


def test_an_output_folder_replaces_only_unchanged_files_it_wrote(tmp_path):
    names = ["report.html", "recipes.json"]
    folder = OutputFolder(tmp_path, names, "test")
    folder.write("report.html", lambda p: p.write_text("v1"))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["files"] == {"report.html": hashlib.sha256(b"v1").hexdigest()}
    OutputFolder(tmp_path, names, "test").write("report.html", lambda p: p.write_text("v2"))  # its own: replaced
    (tmp_path / "report.html").write_text("edited by the user")
    with pytest.raises(vc.OutputExistsError, match="or it changed since"):
        OutputFolder(tmp_path, names, "test")
    (tmp_path / MANIFEST).write_text("not json")
    with pytest.raises(vc.OutputExistsError, match="is not a manifest vitcam_nb wrote"):
        OutputFolder(tmp_path, names, "test")
    OutputFolder(tmp_path, names, "test", overwrite=True).write("report.html", lambda p: p.write_text("v3"))
    assert (tmp_path / "report.html").read_text() == "v3" and leftovers(tmp_path) == []


# -- limits and arguments refused before any map ------------------------------------------------------------
def test_max_mb_is_refused_from_the_axes_before_any_map(tmp_path, spy):
    axes = {"site": "all", "layer": "all", "weighting": "all", "target": "all", "class_": "all",
            "upsample": ["bilinear", "nearest", "none"], "normalize": ["minmax", "none"], "relu": ["after", "none"],
            "heads": ["channels", "max"], "attn_rows": ["cls", "mean"], "layer_fusion": ["none", "mean", "sum"]}
    # 6 sites (F1..F6) x 3 layers x every weighting x 3 targets x 2 classes, then the listed fields.
    count = 6 * 3 * len(channel_weighting_names()) * 3 * 2 * 3 * 2 * 2 * 2 * 2 * 3
    assert count > 100_000
    with pytest.raises(vc.ExportError, match=rf"^max_mb: the {count} recipes of these axes need at least "):
        vc.export_html(TRACE, tmp_path / "big.html", axes=axes, max_mb=1, progress=False)
    assert spy == [] and not (tmp_path / "big.html").exists()


def test_a_page_over_max_mb_after_building_is_refused_and_not_written(tmp_path):
    size = len(vc.widgets.standalone.explorer_html(TRACE, axes=SMALL, progress=False).encode("utf-8"))
    limit = round((size - 2000) / 1e6, 3)  # the code alone (and 8 bytes a recipe) fit, the page does not
    with pytest.raises(vc.ExportError, match=rf"^max_mb: the file would be {size / 1e6:.2f} MB, over {limit} MB"):
        vc.export_html(TRACE, tmp_path / "e.html", axes=SMALL, max_mb=limit, progress=False)
    assert list(tmp_path.iterdir()) == []
    assert vc.export_html(TRACE, tmp_path / "e.html", axes=SMALL, max_mb=size / 1e6, progress=False).stat(
        ).st_size == size


def test_computing_stops_once_the_recipes_so_far_pass_max_mb(tmp_path, spy):
    count = 6 * 3 * len(channel_weighting_names()) * 3 * 2  # the default axes of TRACE
    # The page code and 8 bytes a recipe fit in 0.1 MB; the default page is about 0.2 MB.
    with pytest.raises(vc.ExportError, match=rf"^max_mb: after \d+ of {count} recipes the page is already over"):
        vc.export_html(TRACE, tmp_path / "e.html", max_mb=0.1, progress=False)
    assert 0 < len(spy) < count / 2 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("layers", [[99], [-1, 3], [-4]])
def test_a_layer_outside_the_model_is_refused_not_wrapped(tmp_path, spy, layers):
    with pytest.raises(vc.RecipeError, match=r"^axes: layer -?\d+ is out of range for a model with 3 blocks "
                                             r"\(allowed -3\.\.2\)"):
        vc.export_html(TRACE, tmp_path / "e.html", axes={"layer": layers}, progress=False)
    assert spy == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, error, match", [
    ({"size": "big"}, TypeError, r"^size: expected a whole number of pixels from 1 to 4096, got 'big'"),
    ({"size": -5}, vc.ExportError, r"^size: expected a display width from 1 to 4096 pixels, got -5"),
    ({"size": 0}, vc.ExportError, r"^size: .* got 0"),
    ({"size": 1e9}, TypeError, r"^size: .* got 1000000000.0"),
    ({"size": 10**9}, vc.ExportError, r"^size: .* got 1000000000"),
    ({"max_mb": "3"}, TypeError, r"^max_mb: expected a number of megabytes > 0 or None, got '3'"),
    ({"max_mb": -1}, vc.ExportError, r"^max_mb: expected a number of megabytes > 0 or None, got -1"),
    ({"max_mb": 0}, vc.ExportError, r"^max_mb: .* got 0"),
    ({"max_mb": float("nan")}, vc.ExportError, r"^max_mb: .* got nan"),
    ({"title": 5}, TypeError, r"^title: expected a string or None, got int"),
    ({"opacity": "0.5"}, TypeError, r"^opacity: expected a number in \[0, 1\], got '0.5'"),
    ({"opacity": 2}, vc.ExportError, r"^opacity: "),
    ({"colormap": "rainbow"}, vc.ExportError, r"^colormap: expected one of \['inferno'"),
    ({"quantize": "int4"}, vc.ExportError, r"^quantize: expected one of \['uint8', 'float16', 'float32'\]"),
    ({"axes": {"site": ["F2"], "weighting": ["scorecam"]}}, vc.ExportError,
     r"^axes: none of the \d+ recipes of these axes can be computed on this trace"),
    ({"axes": {"layer": [[0, 1]], "site": [object()]}}, TypeError, r"^axes: 'site' values must be"),
])
def test_raw_errors_become_kit_errors_naming_the_argument(tmp_path, spy, kwargs, error, match):
    with pytest.raises(error, match=match):
        vc.export_html(TRACE, tmp_path / "e.html", **{"axes": SMALL, **kwargs}, progress=False)
    assert list(tmp_path.iterdir()) == []
    if "axes" not in kwargs:
        assert spy == []


def test_a_trace_many_store_is_refused_by_name(tmp_path, spy):
    store = vc.open_traces(vc.trace_many(MODEL, [IMAGE, 255 - IMAGE], tmp_path / "s.zarr", targets="top1",
                                         progress=False))
    with pytest.raises(vc.TraceError, match=r"^trace: this is a trace_many store of many images"):
        vc.export_html(store, tmp_path / "e.html", progress=False)
    assert spy == [] and not (tmp_path / "e.html").exists()


def test_list_layers_are_exported_with_their_fusion(tmp_path):
    bundle = build_bundle(TRACE, axes={"layer": [[0, 1], (0, 1)], "layer_fusion": ["mean"], "site": ["F1"],
                                       "weighting": ["gradcam"], "target": ["logit"], "class_": ["top1"]},
                          progress=False)
    assert dict(bundle.meta["axes"])["layer"] == [[0, 1]] and bundle.meta["count"] == 1


# -- the page offers what it holds ----------------------------------------------------------------------------
def unpack(bundle):
    return json.loads(zlib.decompress(base64.b64decode(bundle.texts)))


def test_a_default_page_offers_only_values_and_presets_it_can_show():
    bundle = build_bundle(TRACE, progress=False)
    texts, meta = unpack(bundle), bundle.meta
    axes = dict(meta["axes"])
    combos = list(itertools.product(*(v for _, v in meta["axes"])))
    assert len(texts) == len(combos) == meta["count"] == math.prod(len(v) for v in axes.values())
    # Weightings that need vc.score outputs (or a k the page cannot set) are left out of the menu and the table.
    assert {"scorecam", "ablationcam", "gscorecam", "vitcx"}.isdisjoint(axes["weighting"])
    assert axes["weighting"] == [w for w in channel_weighting_names()
                                 if w not in ("scorecam", "ablationcam", "gscorecam", "vitcx")]
    menu = {f["name"]: [v for v, _ in f["values"]] for f in meta["options"]["fields"] if "values" in f}
    assert menu["weighting"] == axes["weighting"]
    for name, values in meta["axes"]:  # every value offered shows a map somewhere
        for value in values:
            assert any("e" not in e for c, e in zip(combos, texts) if c[[n for n, _ in meta["axes"]].index(name)]
                       == value), (name, value)
    names = [n for n, _ in meta["axes"]]
    for preset, _label, fields in meta["options"]["presets"]:
        want = vc.Recipe.from_dict(fields)
        draft = {**want.to_dict(), "layer": want.layer % 3}
        index = combos.index(tuple(draft[n] for n in names))
        assert "e" not in texts[index] and vc.Recipe.from_json(texts[index]["r"]) == vc.Recipe(**draft), preset
    offered = [p[0] for p in meta["options"]["presets"]]
    assert offered == ["pytorch_grad_cam_vit", "gradcam", "hirescam", "gradcam_elementwise", "gradcampp",
                       "xgradcam", "layercam", "eigencam", "eigengradcam"]
    left = meta["left_out"]
    assert left.startswith("Not in this page: weighting scorecam, ablationcam, vitcx (extra model passes are needed "
                           "that were not run for this trace); weighting gscorecam (a setting is needed that this "
                           "page does not offer: k); preset chefer_attention_gradcam, attention_rollout")
    assert "vc." not in left and "score(" not in left and left.count("Not in this page") == 1


def test_the_left_out_paragraph_is_escaped_as_text(tmp_path):
    # A value no recipe can take is refused by name before any work (0.3.0: it used to be left out of the page and
    # named in its paragraph); the title, which the page shows, is escaped.
    evil = "<img src=x onerror=alert(1)>"
    with pytest.raises(vc.RecipeError, match=r"^axes: site '<img src=x onerror=alert\(1\)>' is not a value"):
        vc.export_html(TRACE, tmp_path / "e.html", axes={**SMALL, "site": ["F1", evil]}, progress=False)
    assert not (tmp_path / "e.html").exists()
    html = vc.export_html(TRACE, tmp_path / "e.html", axes=SMALL, title=evil, progress=False).read_text()
    assert evil not in html.split("<script")[0]


def test_partly_refused_values_stay_with_their_refusal():
    bundle = build_bundle(TRACE, axes={"site": ["F1"], "weighting": ["gradcam"], "layer": [-1, "all"],
                                       "target": ["logit"], "class_": ["top1"], "layer_fusion": ["none", "mean"]},
                          progress=False)
    texts = unpack(bundle)
    axes = dict(bundle.meta["axes"])
    assert axes["layer"] == [2, "all"] and axes["layer_fusion"] == ["none", "mean"] and len(texts) == 4
    # layer 'all' with no fusion is refused, as vc.cam refuses it: the page shows that refusal.
    assert ["e" in t for t in texts] == [False, False, True, False]
    with pytest.raises(vc.RecipeError) as refused:
        vc.cam(TRACE, vc.Recipe(layer="all"))
    assert texts[2]["e"] == str(refused.value)
    assert bundle.meta["left_out"].startswith("Not in this page: preset ")


# -- fuzz ----------------------------------------------------------------------------------------------------
VALUES = {"site": ["F1", "F2", "F4", "F9", 3, None], "layer": [0, 1, -1, -2, 2, 99, "all", "x", [0, 1], True],
          "weighting": ["gradcam", "layercam", "scorecam", "nope", 7], "target": ["logit", "prob", "bogus"],
          "upsample": ["bilinear", "nearest", 1.5]}
AXES = st.one_of(st.none(), st.sampled_from(["site", [1], 5]), st.dictionaries(
    st.sampled_from([*VALUES, "colour"]),
    st.one_of(st.lists(st.sampled_from(sorted({json.dumps(v) for vs in VALUES.values() for v in vs})),
                       min_size=0, max_size=3).map(lambda vs: [json.loads(v) for v in vs]),
              st.sampled_from(["all", "F1", 4])), max_size=3))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(axes=AXES, size=st.one_of(st.integers(-10, 5000), st.floats(allow_nan=True), st.sampled_from(["9", None])),
       max_mb=st.one_of(st.none(), st.floats(allow_nan=True), st.integers(-2, 3), st.sampled_from(["1", True])),
       quantize=st.sampled_from(["uint8", "float16", "float32", "int8", 3, None]),
       title=st.one_of(st.none(), st.text(max_size=20), st.integers()))
def test_fuzz_export_arguments_give_a_page_or_a_kit_error_and_no_file(tmp_path_factory, axes, size, max_mb,
                                                                    quantize, title):
    folder = tmp_path_factory.mktemp("fuzz")
    base = {"site": ["F1"], "layer": [-1], "weighting": ["gradcam"], "target": ["logit"], "class_": ["top1"]}
    if isinstance(axes, dict):
        axes = {**base, **axes}
    path = folder / "e.html"
    try:
        vc.export_html(TRACE, path, axes=axes, size=size, max_mb=max_mb, quantize=quantize, title=title,
                       progress=False)
    except KIT_ERRORS:
        assert list(folder.iterdir()) == []
    except TypeError as exc:
        assert str(exc).split(":")[0] in ARGUMENTS, repr(exc)
        assert list(folder.iterdir()) == []
    else:
        assert path.read_text().startswith("<!doctype html>") and list(folder.iterdir()) == [path]
