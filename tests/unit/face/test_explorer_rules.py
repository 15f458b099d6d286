"""One Explorer, several traces of one image (issue #34: the gradient trace and a backward-rule trace): a switch
of trace shows exactly ``vc.cam`` of the other trace with the recipe kept, its controls, methods paragraph and
checklist are the new trace's (the rule named), a switch the new trace cannot give is refused and everything stays
at what is shown, and traces of two different inputs are refused before any map is computed. The page's picker is
exercised in a browser by tests/ui/test_explorer_rules.py."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import xarray as xr

import vitcam_nb as vc
from vitcam_nb.core.errors import RecipeError, TraceError
from vitcam_nb.widgets import Explorer
from vitcam_nb.widgets import explorer as explorer_module
from vitcam_nb.widgets.traces import named_traces, trace_choices

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.core.errors.DegenerateMapWarning")

START = vc.Recipe(site="F1", layer=0)


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("vit")


@pytest.fixture(scope="module")
def pair(model, model_input):
    x = model_input("vit")
    # The rule trace holds a site the gradient trace lacks: the controls must follow the trace shown.
    tr = vc.trace(model, x, targets="top1", sites=["F1", "F6"])
    rel = vc.trace(model, x, targets="top1", sites=["F1", "F6", "resid_pre"], rule="cp_lrp")
    return tr, rel


def send(widget, **state):
    """Deliver state as the front-end does: JSON over the wire, then ``set_state``."""
    widget.set_state(json.loads(json.dumps(state)))


def sites(ex: Explorer) -> list:
    return [v for v, _ in next(f for f in ex.options["fields"] if f["name"] == "site")["values"]]


def assert_shows(ex: Explorer, trace: xr.Dataset, recipe: vc.Recipe) -> None:
    """The page's map, recipe id, methods and checklist are exactly those of ``vc.cam(trace, recipe)``."""
    full = vc.cam(trace, recipe)
    assert ex.trace is trace and ex.recipe == recipe and ex.recipe_id == recipe.id
    np.testing.assert_array_equal(ex.map, vc.cam(trace, recipe, grid=True).values.astype(np.float32))
    np.testing.assert_array_equal(ex.cam().values, full.values)
    assert ex.methods == full.attrs["methods"] and ex.checklist == json.loads(full.attrs["checklist"])
    assert ex.error == ""


def test_switching_trace_shows_exactly_cam_of_the_other_trace(pair):
    tr, rel = pair
    ex = Explorer({"gradient": tr, "cp_lrp": rel}, START)
    assert ex.trace_choices == [["gradient", "backward rule gradient"], ["cp_lrp", "backward rule cp_lrp"]]
    assert ex.trace_name == ex.trace_shown == "gradient" and list(ex.traces) == ["gradient", "cp_lrp"]
    assert_shows(ex, tr, START)
    assert "backward rule" not in ex.methods and sites(ex) == ["F1", "F6"]

    frame = ex.frame
    send(ex, trace_request={"id": 1, "name": "cp_lrp"})  # the page's picker
    assert ex.trace_shown == "cp_lrp" and ex.frame > frame
    assert_shows(ex, rel, START)
    assert "backward rule cp_lrp: conservative propagation" in ex.methods  # the methods name the rule
    assert ex.checklist["gradient target"]["backward rule"].startswith("cp_lrp:")
    assert sites(ex) == ["F1", "F6", "resid_pre"]
    # The two traces' maps differ (the test would notice a switch that changed nothing).
    assert not np.array_equal(vc.cam(tr, START, grid=True).values, vc.cam(rel, START, grid=True).values)

    ex.recipe = vc.presets.cp_lrp()  # a rule preset on its own trace
    assert_shows(ex, rel, vc.presets.cp_lrp())
    ex.recipe = START
    ex.trace_name = "gradient"  # the Python setter
    assert_shows(ex, tr, START)
    assert ex.trace_shown == "gradient" and sites(ex) == ["F1", "F6"]


def test_a_list_is_named_by_rule_and_a_refused_switch_changes_nothing(pair, capsys):
    tr, rel = pair
    ex = Explorer([rel, tr], vc.presets.cp_lrp())
    assert ex.trace_shown == "cp_lrp" and list(ex.traces) == ["cp_lrp", "gradient"]
    before = {k: getattr(ex, k) for k in ("grid", "recipe_json", "methods", "checklist", "options", "trace_shown")}
    send(ex, trace_request={"id": 1, "name": "gradient"})  # the gradient trace cannot give a rule preset
    assert "cp_lrp" in ex.error and "'gradient'" in ex.error
    assert {k: getattr(ex, k) for k in before} == before and ex.trace is rel
    with pytest.raises(RecipeError, match="backward rule 'cp_lrp'"):
        ex.trace_name = "gradient"
    assert ex.trace_shown == "cp_lrp" and ex.grid == before["grid"]
    send(ex, trace_request={"id": 2, "name": "lrp"})  # a name the Explorer does not hold: a message, no traceback
    assert "expected one of ['cp_lrp', 'gradient']" in ex.error and ex.trace_shown == "cp_lrp"
    with pytest.raises(TraceError, match="trace_name: expected one of"):
        ex.trace_name = "lrp"
    # On the gradient trace, the rule preset is refused and the controls stay at the recipe shown.
    ex.recipe = START
    ex.trace_name = "gradient"
    send(ex, request={"id": 3, "recipe": vc.presets.cp_lrp().to_dict(), "changed": ["weighting", "site"]})
    assert "backward rule 'cp_lrp'" in ex.error
    assert ex.error.endswith("; this Explorer's trace 'cp_lrp' gives it: switch trace with the trace picker")
    assert vc.Recipe.from_json(ex.recipe_json) == START and ex.trace_shown == "gradient"
    for rid, changed in ((4, ["site"]), (5, 5)):  # refused on every trace (or malformed): no trace named
        send(ex, request={"id": rid, "recipe": {"site": "F9"}, "changed": changed})
        assert ex.error and "trace picker" not in ex.error and ex.trace_shown == "gradient"
    assert "Traceback" not in "".join(capsys.readouterr())


def test_traces_of_different_images_are_refused_before_any_map(model, model_input, pair, monkeypatch):
    tr, _ = pair
    other = vc.trace(model, model_input("vit", seed=1), targets="top1", sites=["F1"], rule="cp_lrp")
    a, b = tr.attrs["input_sha256"], other.attrs["input_sha256"]
    assert a != b

    def no_map(*_args, **_kwargs):
        raise AssertionError("a map was computed before the traces were checked")

    monkeypatch.setattr(explorer_module, "compute_grid", no_map)
    with pytest.raises(TraceError, match="of one input") as info:
        Explorer({"gradient": tr, "cp_lrp": other})
    assert f"'gradient' has input hash {a[:12]}" in str(info.value) and f"'cp_lrp' has {b[:12]}" in str(info.value)


@pytest.mark.parametrize(("traces", "error", "message"), [
    ({}, TypeError, "at least one trace"),  # TypeError: what Explorer({...}) raised before it held several traces
    ([], TypeError, "at least one trace"),
    ({"": None}, TypeError, "non-empty strings"),
    ({"a": "tr.nc"}, TypeError, "trace 'a': several traces .* got str"),
    ({"a": xr.Dataset(coords={"image": [0, 1]})}, TypeError, "got a many-image store"),
    ({"a": xr.Dataset()}, TraceError, "trace 'a': has no input_sha256"),
])
def test_bad_trace_sets_are_refused_by_name(traces, error, message):
    with pytest.raises(error, match=message):
        named_traces(traces)


def test_two_traces_of_one_rule_in_a_list_need_names(pair):
    tr, rel = pair
    with pytest.raises(TraceError, match="two traces of backward rule 'gradient'"):
        Explorer([tr, tr])
    assert trace_choices(named_traces({"plain": tr, "lrp": rel})) == [
        ["plain", "plain · backward rule gradient"], ["lrp", "lrp · backward rule cp_lrp"]]


def test_a_single_trace_has_no_trace_picker(pair):
    tr, _ = pair
    ex = Explorer(tr, START)
    assert ex.trace_choices == [] and ex.trace_shown == "" and ex.traces == {}
    assert_shows(ex, tr, START)
    with pytest.raises(TypeError, match="trace_name: this Explorer shows one trace"):
        ex.trace_name = "gradient"
    send(ex, trace_request={"id": 1, "name": "gradient"})
    assert "expected one of []" in ex.error and ex.trace is tr


# -- the one-file export (its trace picker runs in a browser in tests/ui/test_explorer_rules.py) ------------------
def page_meta(html: str) -> dict:
    return json.loads(re.search(r"<script type='application/json' id='vc-meta'>(.*?)</script>", html).group(1))


def test_an_export_of_two_traces_holds_a_table_for_each_starting_at_the_trace_shown(pair):
    tr, rel = pair
    axes = {"site": ["F1"], "layer": [0], "weighting": ["gradcam", "layercam"], "target": ["logit"]}
    ex = Explorer({"gradient": tr, "cp_lrp": rel}, START)
    single = page_meta(Explorer(tr, START).to_html(axes=axes, progress=False))
    assert "trace_choices" not in single and "trace_parts" not in single  # one trace: the page of before
    ex.trace_name = "cp_lrp"
    html = ex.to_html(axes=axes, progress=False)
    meta = page_meta(html)
    assert meta["trace_shown"] == "cp_lrp" and [n for n, _ in meta["trace_choices"]] == ["cp_lrp", "gradient"]
    assert meta["trace_id"] == rel.attrs["trace_id"] and meta["trace_parts"][0]["trace_id"] == tr.attrs["trace_id"]
    assert "id='vc-maps-1'" in html and "id='vc-texts-1'" in html and "id='vc-maps-2'" not in html
    assert meta["count"] == meta["trace_parts"][0]["count"] == 2


def test_an_export_of_traces_of_different_images_is_refused_before_any_map(model, model_input, pair, tmp_path,
                                                                         monkeypatch):
    from vitcam_nb.widgets import standalone

    tr, _ = pair
    other = vc.trace(model, model_input("vit", seed=1), targets="top1", sites=["F1"])
    monkeypatch.setattr(standalone, "build_bundle", lambda *a, **k: pytest.fail("a map was computed"))
    with pytest.raises(TraceError, match="of one input"):
        vc.export_html({"a": tr, "b": other}, tmp_path / "two.html", progress=False)
    assert not (tmp_path / "two.html").exists()
