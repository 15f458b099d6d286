"""Python-side tests of the notebook widgets (vitcam_nb.widgets): every control change yields exactly
``vc.cam(tr, recipe, grid=True)`` in the widget's buffer, refusals become messages, the browser gets
binary buffers, and the shared JavaScript upsamples and colours like torch and matplotlib (run with node
when it is installed). Browser tests live in tests/ui."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import warnings

import matplotlib
import numpy as np
import pytest
from ipywidgets.widgets.widget import _remove_buffers

import vitcam_nb as vc
from vitcam_nb.core.errors import DegenerateMapWarning, RecipeError
from vitcam_nb.widgets import Compare, Explorer, Gallery, assets, fallback
from vitcam_nb.widgets.encoding import grid_bytes, grid_from_bytes

matplotlib.use("Agg")
pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.core.errors.DegenerateMapWarning")

XSS = "<img src=x onerror=alert(1)>"
LABELS = ["circle", XSS, "tri & <b>angle</b>"] + [f"class {i}" for i in range(3, 10)]


@pytest.fixture(scope="module")
def tr(model_factory, model_input):
    return vc.trace(model_factory("vit"), model_input("vit"), labels=LABELS)


@pytest.fixture
def ex(tr):
    return Explorer(tr, vc.Recipe(layer=1))


def expected_grid(tr, recipe: vc.Recipe) -> bytes:
    return grid_bytes(vc.cam(tr, recipe, grid=True).values)


def send(widget, **state):
    """Deliver state as the front-end does: JSON over the wire, then ``set_state``."""
    widget.set_state(json.loads(json.dumps(state)))


def request(ex: Explorer, rid: int, changes: dict, base: vc.Recipe | None = None) -> None:
    draft = {**(base or ex.recipe).to_dict(), **changes}
    send(ex, request={"id": rid, "recipe": draft, "changed": list(changes)})


def field_values(ex: Explorer, name: str) -> list:
    spec = next(f for f in ex.options["fields"] if f["name"] == name)
    return spec["layers"] if spec["kind"] == "layer" else [v for v, _ in spec["values"]]


# -- construction ---------------------------------------------------------------------------------
def test_initial_state_is_the_recipe_on_the_grid(tr):
    ex = Explorer(tr)
    assert ex.recipe == vc.Recipe()
    assert ex.grid == expected_grid(tr, vc.Recipe())
    assert ex.grid_shape == [tr.attrs["grid_h"], tr.attrs["grid_w"]]
    assert ex.recipe_id == vc.Recipe().id and vc.Recipe.from_json(ex.recipe_json) == ex.recipe
    assert len(ex.image) == 32 * 32 * 4 and ex.image_shape == [32, 32]
    names = [f["name"] for f in ex.options["fields"]]
    assert sorted(names) == sorted(vc.Recipe().to_dict())  # a control for every taxonomy dimension
    m = vc.cam(tr, ex.recipe, grid=True)
    full = vc.cam(tr, ex.recipe)  # the report describes the recipe as chosen (bilinear), not the grid
    assert ex.methods == full.attrs["methods"] and ex.checklist == json.loads(full.attrs["checklist"])
    assert ex.recipe_id in ex.methods and "bilinear" in ex.methods
    assert ex.checklist_md.startswith("| category | item | value |")
    np.testing.assert_array_equal(ex.map, m.values)


def test_options_offer_only_what_the_trace_holds(tr):
    ex = Explorer(tr)
    assert field_values(ex, "site") == ["F1", "F2", "F3", "F4", "F5", "F6"]
    assert field_values(ex, "layer") == [0, 1, 2]
    classes = field_values(ex, "class_")
    traced = [int(c) for c in tr["target_class"].values if c >= 0]
    assert classes == [f"top{n}" for n in range(1, 6)] + traced
    heads = field_values(ex, "heads")
    assert heads[:4] == ["channels", "mean_then_relu", "relu_then_mean", "max"] and heads[4:] == [0, 1, 2, 3]
    when = {f["name"]: f["when"] for f in ex.options["fields"]}
    from vitcam_nb.core.schema import HEAD_SITES

    # heads show for every site with heads (the schema's list, which grows with new families), and only for those
    assert when["heads"][0]["field"] == "site" and {"F2", "F3", "xattn"} <= set(when["heads"][0]["in"])
    assert set(when["heads"][0]["in"]) <= set(HEAD_SITES) | {"F3"} and "F1" not in when["heads"][0]["in"]
    assert when["attn_rows"] == [{"field": "site", "in": ["F2"]}]


def test_class_labels_are_sent_as_plain_text(tr):
    ex = Explorer(tr)
    spec = next(f for f in ex.options["fields"] if f["name"] == "class_")
    texts = [text for _, text in spec["values"]]
    for c in (int(c) for c in tr["target_class"].values if c >= 0):
        assert f"{LABELS[c]} ({c})" in texts  # unchanged: the page inserts it with textContent
    assert any(XSS in t for t in texts) or 1 not in [int(c) for c in tr["target_class"].values]


def test_javascript_never_parses_strings_as_html():
    for path in assets.STATIC_DIR.glob("*.js"):
        code = path.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
            assert sink not in code, f"{path.name} uses {sink}"
        assert not re.search(r"^\s*import\s", code, re.M), f"{path.name} imports a module (no network, no build)"
        assert "http://" not in code and "https://" not in code


# -- every control -------------------------------------------------------------------------------
BASES = {
    "site": [vc.Recipe(layer=1)],
    "layer": [vc.Recipe(site="F4")],
    "target": [vc.Recipe(layer=1), vc.Recipe(site="F2", layer=1)],
    "class_": [vc.Recipe(layer=1)],
    "weight_tokens": [vc.Recipe(layer=1), vc.Recipe(layer=1, weighting="xgradcam")],
    "weighting": [vc.Recipe(layer=1), vc.Recipe(site="F3", layer=0)],
    "heads": [vc.Recipe(site="F3", layer=1), vc.Recipe(site="F2", layer=1)],
    "attn_rows": [vc.Recipe(site="F2", layer=1)],
    "layer_fusion": [vc.Recipe(site="F2", layer=1), vc.Recipe(site="F5", layer=1)],
    "relu": [vc.Recipe(layer=1)],
    "reshape": [vc.Recipe(layer=1)],
    "upsample": [vc.Recipe(layer=1)],
    "normalize": [vc.Recipe(layer=1, relu="none")],
}


def _expected(base: vc.Recipe, field: str, value) -> vc.Recipe:
    changes = {field: value}
    if field == "layer_fusion" and value != "none":
        changes["layer"] = "all"  # fusing a single layer means nothing: the page fuses all traced layers
    return base.replace(**changes)


@pytest.mark.parametrize("field", list(BASES))
def test_each_control_gives_exactly_cam_on_the_grid(tr, field):
    ex = Explorer(tr)
    rid = 0
    checked = refused = 0
    for base in BASES[field]:
        for value in field_values(ex, field):
            ex.recipe = base
            before = (ex.grid, ex.recipe)
            rid += 1
            frame = ex.frame
            request(ex, rid, {field: value})
            assert ex.response_id == rid and ex.frame == frame + 1
            try:
                want = _expected(base, field, value)
                grid = expected_grid(tr, want)
            except RecipeError as exc:
                assert ex.error == str(exc), (field, value)
                assert (ex.grid, ex.recipe) == before  # the last valid map stays
                refused += 1
                continue
            assert ex.error == "", (field, value, ex.error)
            assert ex.recipe == want, (field, value)
            assert ex.grid == grid, (field, value)
            assert vc.Recipe.from_json(ex.recipe_json) == want and ex.recipe_id == want.id
            checked += 1
    assert checked >= 1
    if field in ("heads",):
        assert refused == 0  # every head rule applies at F2/F3 with gradcam


def test_python_setter_updates_every_trait(tr, ex):
    frame, rid = ex.frame, ex.response_id
    r = vc.Recipe(site="F6", layer=0, weighting="layercam", normalize="max")
    ex.recipe = r
    assert ex.recipe == r and ex.grid == expected_grid(tr, r) and ex.recipe_json == r.to_json()
    assert ex.frame == frame + 1 and ex.response_id == rid  # the page accepts it: not older than its requests
    ex.recipe = {"site": "F5", "layer": 1}
    assert ex.recipe == vc.Recipe(site="F5", layer=1)
    ex.recipe = vc.Recipe(site="F4").to_json()
    assert ex.recipe.site == "F4"


def test_python_setter_raises_for_python_callers(ex):
    with pytest.raises(RecipeError):
        ex.recipe = vc.Recipe(site="F1", layer=7)
    with pytest.raises(TypeError):
        ex.recipe = 3


def test_invalid_combination_is_a_message_not_a_traceback(tr, ex, capsys):
    ex.recipe = vc.Recipe(site="F3", layer=1, weighting="eigencam")
    before = ex.grid
    request(ex, 1, {"heads": "max"})
    assert "eigencam" in ex.error and "heads" in ex.error
    assert ex.recipe == vc.Recipe(site="F3", layer=1, weighting="eigencam") and ex.grid == before
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    request(ex, 2, {"heads": "channels"})  # fixing it clears the message
    assert ex.error == "" and ex.frame > 0


@pytest.mark.parametrize("bad", [
    {"id": 1, "recipe": {"site": "F9"}, "changed": ["site"]},
    {"id": 2, "recipe": {"layer": 99}, "changed": ["layer"]},
    {"id": 3, "recipe": {"class_": 9999}, "changed": ["class_"]},
    {"id": 4, "recipe": {"nonsense": 1}, "changed": []},
    {"id": 5, "recipe": "not a dict", "changed": []},
    {"id": "x"},
    {"id": 6, "recipe": {"layer": "all"}, "changed": ["layer"]},
])
def test_malformed_requests_never_raise(ex, bad, capsys):
    recipe = ex.recipe
    send(ex, request=bad)
    assert ex.error and ex.recipe == recipe
    assert "Traceback" not in "".join(capsys.readouterr())


def test_hidden_controls_return_to_their_defaults(tr, ex):
    ex.recipe = vc.Recipe(site="F2", layer=1, heads="max", attn_rows="mean")
    request(ex, 1, {"site": "F1"})  # heads and attn_rows no longer apply: their controls are hidden
    assert ex.error == "" and ex.recipe == vc.Recipe(site="F1", layer=1)
    ex.recipe = vc.Recipe(layer=1, weight_tokens="all")
    request(ex, 2, {"weighting": "hirescam"})
    assert ex.recipe == vc.Recipe(layer=1, weighting="hirescam")


def test_layer_fusion_switches_between_one_layer_and_all(tr, ex):
    request(ex, 1, {"layer_fusion": "mean"})
    assert ex.recipe.layer == "all" and ex.grid == expected_grid(tr, ex.recipe)
    request(ex, 2, {"layer_fusion": "none"})
    assert ex.recipe.layer == 2 and ex.recipe.layer_fusion == "none"
    ex.recipe = vc.Recipe(layer=(0, 2), layer_fusion="max")  # a tuple from Python survives other changes
    request(ex, 3, {"normalize": "max"})
    assert ex.recipe == vc.Recipe(layer=(0, 2), layer_fusion="max", normalize="max")


def test_rollout_needs_f2_and_hides_the_weighting(tr, ex):
    request(ex, 1, {"layer_fusion": "rollout"})
    assert "F2" in ex.error
    ex.recipe = vc.Recipe(site="F2", layer=1, weighting="layercam", class_="top2")
    request(ex, 2, {"layer_fusion": "rollout"})
    want = vc.Recipe(site="F2", layer="all", layer_fusion="rollout")
    assert ex.error == "" and ex.recipe == want and ex.grid == expected_grid(tr, want)


def test_answers_carry_the_request_id_and_frames_increase(ex):
    frames = [ex.frame]
    for rid, site in ((1, "F3"), (2, "F4"), (5, "F5")):
        request(ex, rid, {"site": site})
        frames.append(ex.frame)
        assert ex.response_id == rid
    request(ex, 4, {"site": "F6"})  # an id older than one already answered never lowers response_id
    assert ex.response_id == 5
    assert frames == sorted(frames) and len(set(frames)) == len(frames)


def test_degenerate_variant_is_flagged_without_a_warning_escaping(tr, ex):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DegenerateMapWarning)
        request(ex, 1, {"site": "F5", "layer": 2})
    assert "zero" in ex.degenerate and not ex.map.any()
    request(ex, 2, {"layer": 1})
    assert ex.degenerate == ""


def test_grid_and_image_travel_as_binary_buffers(ex):
    state, paths, buffers = _remove_buffers(ex.get_state())
    assert ["grid"] in paths and ["image"] in paths
    grid = buffers[paths.index(["grid"])]
    assert bytes(grid) == ex.grid and len(grid) == 4 * 16
    assert "grid" not in state and "image" not in state


def test_callbacks_and_static_render(tr, ex):
    seen = []
    ex.on_change(seen.append)
    request(ex, 1, {"site": "F6"})
    ex.recipe = vc.Recipe(site="F1", layer=0)
    assert [r.site for r in seen] == ["F6", "F1"]
    fig = ex.static()
    assert isinstance(fig, matplotlib.figure.Figure)
    data, _ = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data and data["image/png"]
    fallback.STATIC_PNG = False
    try:
        assert "image/png" not in ex._repr_mimebundle_()[0]
    finally:
        fallback.STATIC_PNG = True


def test_explorer_refuses_bad_arguments(tr):
    with pytest.raises(ValueError, match="opacity"):
        Explorer(tr, opacity=2)
    with pytest.raises(ValueError, match="colormap"):
        Explorer(tr, colormap="rainbow")
    with pytest.raises(TypeError, match="trace"):
        Explorer({"not": "a trace"})
    with pytest.raises(RecipeError):
        Explorer(tr, vc.Recipe(layer=5))


def test_default_recipe_moves_to_a_traced_class_and_site(model_factory, model_input):
    trace = vc.trace(model_factory("vit"), model_input("vit"), targets=[7, 3], sites=["F4", "F6"], layers=[0, 1])
    ex = Explorer(trace)
    assert ex.recipe.site == "F4" and ex.recipe.class_ in (7, 3, "top1") and ex.recipe.layer in (-1, 1)
    assert ex.error == "" and ex.grid == expected_grid(trace, ex.recipe)


# -- gallery --------------------------------------------------------------------------------------
def test_gallery_thumbnails_are_the_cam_grids(tr):
    g = Gallery(tr, vc.Recipe(), vary=("layer", "site"))
    rows, cols, gh, gw = g.thumbnails.maps_shape
    assert (rows, cols) == (3, 6) and g.thumbnails.row_field == "layer" and g.thumbnails.col_field == "site"
    maps = grid_from_bytes(g.thumbnails.maps, g.thumbnails.maps_shape)
    for i in range(rows):
        for j in range(cols):
            r = g.recipe_at(i, j)
            np.testing.assert_allclose(maps[i, j], vc.cam(tr, r, grid=True).values, atol=1e-6)
            assert g.thumbnails.recipe_ids[i][j] == r.id
            assert bool(g.thumbnails.degenerate[i][j]) == bool(vc.cam(tr, r, grid=True).attrs["degenerate"])
    _, paths, _ = _remove_buffers(g.thumbnails.get_state())
    assert ["maps"] in paths


def test_gallery_click_opens_an_explorer(tr, capsys):
    g = Gallery(tr, vary=("layer", "site"))
    opened = []
    g.on_select(opened.append)
    assert g.explorer is None and len(g.children) == 1
    send(g.thumbnails, selected={"cell": [1, 2], "n": 1})
    want = vc.Recipe(layer=1, site="F4")
    assert g.selected == want and opened == [want] and g.thumbnails.active == [1, 2]
    assert isinstance(g.explorer, Explorer) and g.children[1] is g.explorer
    assert g.explorer.recipe == want and g.explorer.grid == expected_grid(tr, want)
    send(g.thumbnails, selected={"cell": [0, 0], "n": 2})
    assert g.explorer.recipe == vc.Recipe(layer=0, site="F1") and len(g.children) == 2
    send(g.thumbnails, selected={"cell": [9, 9], "n": 3})
    assert "outside" in g.thumbnails.error and "Traceback" not in "".join(capsys.readouterr())


def test_gallery_one_field_and_static(tr):
    g = Gallery(tr, vc.Recipe(layer=1), vary={"weighting": ["gradcam", "layercam", "hirescam"]})
    assert g.thumbnails.maps_shape[:2] == [1, 3] and g.maps.dims[0] == "weighting"
    assert g.select(0, 1) == vc.Recipe(layer=1, weighting="layercam")
    assert isinstance(g.static(), matplotlib.figure.Figure)
    assert "image/png" in g._repr_mimebundle_()
    with pytest.raises(ValueError, match="one or two"):
        Gallery(tr, vary={"layer": [0, 1], "site": ["F1"], "relu": ["after", "none"]})


# -- compare --------------------------------------------------------------------------------------
def test_compare_agreement_matches_scipy(tr):
    from scipy import stats

    a, b = vc.Recipe(site="F1", layer=1), vc.Recipe(site="F2", layer=1, weighting="layercam")
    cmp = Compare(tr, a, b, k=0.25)
    ga, gb = (vc.cam(tr, r, grid=True).values for r in (a, b))
    assert cmp.grid_a == grid_bytes(ga) and cmp.grid_b == grid_bytes(gb)
    assert cmp.spearman == pytest.approx(stats.spearmanr(ga.ravel(), gb.ravel()).statistic, abs=1e-12)
    top = lambda g: set(np.argsort(-g.ravel(), kind="stable")[:4])  # noqa: E731
    assert cmp.topk_iou == pytest.approx(len(top(ga) & top(gb)) / len(top(ga) | top(gb)))
    assert cmp.k_cells == 4 and cmp.differing == ["site", "weighting"]
    rows = {f["name"]: f for f in cmp.fields}
    assert rows["site"]["differs"] and rows["site"]["a"] == '"F1"' and not rows["layer"]["differs"]


def test_compare_k_and_setters(tr):
    cmp = Compare(tr, vc.Recipe(layer=1), vc.Recipe(layer=0))
    frame = cmp.frame
    send(cmp, k=0.5)
    assert cmp.k_cells == 8 and cmp.frame == frame + 1
    send(cmp, k=3.0)
    assert "k:" in cmp.error and cmp.k == 0.5  # refused from the page: the last valid k stays
    cmp.recipe_b = vc.Recipe(site="F5", layer=2)  # degenerate: no ranking, n/a with the reason
    assert cmp.spearman is None and cmp.topk_iou is None and "constant" in cmp.notes
    assert cmp.degenerate_b and cmp.agreement["spearman"] is None
    assert isinstance(cmp.static(), matplotlib.figure.Figure)
    with pytest.raises(ValueError, match="k"):
        Compare(tr, vc.Recipe(), vc.Recipe(), k=0)


# -- the shared JavaScript, run in node ------------------------------------------------------------
NODE = shutil.which("node")


def _run_js(tmp_path, exports: str, body: str, payload: object) -> object:
    core = (assets.STATIC_DIR / "core.js").read_text()
    module = tmp_path / "core.mjs"
    module.write_text(core + f"\nexport {{ {exports} }};\n")
    script = tmp_path / "run.mjs"
    script.write_text(f"import {{ {exports} }} from {json.dumps(str(module))};\n"
                      "import fs from 'fs';\nconst input = JSON.parse(fs.readFileSync(0, 'utf8'));\n"
                      f"{body}\n")
    out = subprocess.run([NODE, str(script)], input=json.dumps(payload), capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(NODE is None, reason="node is not installed")
@pytest.mark.parametrize("mode", ["bilinear", "bicubic", "nearest"])
def test_js_upsampling_matches_torch(tmp_path, mode):
    from vitcam_nb.compute.spatial import upsample

    rng = np.random.default_rng(0)
    cases = [(4, 4, 32, 32), (3, 5, 24, 40), (14, 14, 224, 224), (8, 8, 100, 70)]
    grids = [rng.random((gh, gw)).astype(np.float32) for gh, gw, _, _ in cases]
    payload = [{"grid": g.ravel().tolist(), "shape": c} for g, c in zip(grids, cases)]
    body = ("const out = input.map(({grid, shape: [gh, gw, H, W]}) => "
            f"Array.from(upsample(Float32Array.from(grid), gh, gw, H, W, {json.dumps(mode)})));\n"
            "console.log(JSON.stringify(out));")
    result = _run_js(tmp_path, "upsample", body, payload)
    for g, (_, _, H, W), got in zip(grids, cases, result):
        want = upsample(g, (H, W), mode)
        np.testing.assert_allclose(np.asarray(got).reshape(H, W), want, atol=2e-5)


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_js_colormaps_match_matplotlib(tmp_path):
    names = ["jet", "viridis", "inferno", "gray"]
    body = "console.log(JSON.stringify(input.map((n) => Array.from(colormapLut(n)))));"
    result = _run_js(tmp_path, "colormapLut", body, names)
    for name, got in zip(names, result):
        want = matplotlib.colormaps[name].resampled(256)(np.linspace(0, 1, 256))[:, :3]
        np.testing.assert_array_equal(np.asarray(got).reshape(256, 3), np.round(want * 255))


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_js_display_range_follows_the_normalisation(tmp_path):
    body = "console.log(JSON.stringify(input.map(([v, n]) => displayRange(Float32Array.from(v), n))));"
    payload = [[[0.2, 0.5, 1.5], "minmax"], [[-1, 0.5, 2], "max"], [[-3, -1], "none"], [[0, 0], "minmax"]]
    got = _run_js(tmp_path, "displayRange", body, payload)
    np.testing.assert_allclose(got, [[0.2, 1.5], [0, 2], [-3, -1], [0, 1]], rtol=1e-6)


def test_modules_and_stylesheet_are_bundled():
    for name in ("explorer.js", "gallery.js", "compare.js"):
        code = assets.esm(name)
        assert code.count("export default") == 1 and "function paintOverlay" in code
    assert ".vc-widget" in assets.css()

