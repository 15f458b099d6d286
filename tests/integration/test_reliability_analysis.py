"""Issue #32, the reliability of the analyses: ``vc.ambiguity`` refuses a mask of another shape (as the metrics do),
computes design sizes exactly and refuses a design over the memory budget before allocating it; a score card names
the recipe whose scores are all NaN, and one image gives no interval (NaN, with a warning), not one of width 0."""

from __future__ import annotations

import importlib
import math
import re
import types
import warnings

import numpy as np
import pytest
import xarray as xr
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import vitcam_nb as vc
from vitcam_nb.evaluate import MetricWarning
from vitcam_nb.evaluate.ambiguity import space as space_module

ambiguity_module = importlib.import_module("vitcam_nb.evaluate.ambiguity.analysis")  # the package exports the function

REPORTED = {"site": "F1", "layer": -1, "target": "logit"}


@pytest.fixture(scope="module")
def shapes():
    """Two bundled images traced with the bundled model (64 x 64, their object masks known)."""
    model = vc.load_model("shapes-vit")
    out = []
    for i in range(2):
        image, _label, mask = vc.sample_image("shapes", i, with_mask=True)
        out.append((vc.trace(model, image, targets="top1", sites=["F1", "F6"], layers=[-1]), mask))
    return out


@pytest.fixture
def no_maps(monkeypatch):
    """Fail the test if the analysis gets as far as computing maps: a refusal must come first."""
    def refuse(*a, **k):
        raise AssertionError("maps were computed before the arguments were checked")
    monkeypatch.setattr(ambiguity_module, "recipe_maps", refuse)


@pytest.fixture
def guarded_product(monkeypatch):
    """The exact design enumerates every combination: fail (instead of running until killed) if it is asked for
    more than max_cells of them."""
    real = space_module.itertools.product

    def product(*ranges):
        assert math.prod(len(r) for r in ranges) <= 50_000, "the exact design was chosen for a huge factorial"
        return real(*ranges)
    monkeypatch.setattr(space_module, "itertools", types.SimpleNamespace(product=product))


def test_ambiguity_refuses_a_mask_of_another_shape_before_computing(shapes, no_maps):
    tr, _mask = shapes[0]
    assert tr.sizes["y"] == tr.sizes["x"] == 64
    with pytest.raises(ValueError, match=r"^mask: shape \(10, 10\) is not the traced image's \(64, 64\)"):
        vc.ambiguity(tr, REPORTED, mask=np.ones((10, 10), bool))  # 0.2 gave localises = 1.0
    with pytest.raises(ValueError, match=r"^mask: empty mask"):
        vc.ambiguity(tr, REPORTED, mask=np.zeros((64, 64), bool))
    with pytest.raises(ValueError, match=r"^mask: expected a 2-D mask"):
        vc.ambiguity(tr, REPORTED, mask=np.ones((64, 64, 3), bool))


def test_ambiguity_with_a_whole_image_mask_counts_the_maps_that_vary(shapes):
    tr, _mask = shapes[0]
    amb = vc.ambiguity(tr, REPORTED, mask=np.ones((64, 64), bool))
    # Every peak of a varying map lies in a whole-image mask; a constant map points nowhere.
    flat = amb.maps.values.reshape(len(amb.recipes), -1)
    assert amb.localises == pytest.approx(float(np.mean(np.ptp(flat, axis=1) > 0)))


def test_a_factorial_of_2_to_the_64_is_sampled_not_wrapped_to_zero(guarded_product):
    fields = {f"f{i}": range(65_536) for i in range(4)}
    cells, design = space_module.enumerate_cells(fields, 50_000, 16, 0)
    assert cells.shape == (16, 4) and (cells >= 0).all() and (cells < 65_536).all()
    assert design.startswith(f"sampled: 16 of the {2 ** 64} combinations")


def test_ambiguity_refuses_a_space_that_lists_a_value_twice(shapes, guarded_product):
    # 0.3.0 sampled a "space" of 4 fields x 65,536 values made of repeats (2**64 combinations of 8 recipes); a value
    # listed twice is now refused by name before any map (a huge design is sampled: test_a_factorial_of_2_to_the_64)
    tr, _mask = shapes[0]
    space = {"weight_tokens": ("patch", "all") * 32_768, "relu": ("after", "none") * 32_768}
    with pytest.raises(vc.RecipeError, match=r"weight_tokens lists 'patch' more than once"):
        vc.ambiguity(tr, REPORTED, space=space, n_samples=256)


def test_ambiguity_refuses_a_design_over_the_memory_budget_before_allocating(shapes, no_maps, monkeypatch):
    tr, _mask = shapes[0]
    monkeypatch.setattr(ambiguity_module, "available_bytes", lambda: 8 * 10 ** 9)
    pixels = tr.attrs["grid_h"] * tr.attrs["grid_w"]
    # A lower bound: each sampled combination holds at least its map on the token grid (float32).
    assert space_module.design_bytes({"relu": 2}, 50_000, 2_000, 10 ** 9, 200, pixels) >= 10 ** 9 * pixels * 4
    with pytest.raises(ValueError, match=r"^n_samples, max_cells: .* over the budget .*n_samples \(1000000000\)"):
        vc.ambiguity(tr, REPORTED, n_samples=10 ** 9)
    with pytest.raises(ValueError, match=r"^n_samples, max_cells: .*n_boot \(1000000000\)"):
        vc.ambiguity(tr, REPORTED, n_boot=10 ** 9)


def test_scorecard_names_a_recipe_whose_scores_are_all_nan(shapes):
    traces = [tr for tr, _ in shapes]
    dead = vc.Recipe(site="F6", layer=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        assert all(vc.cam(tr, dead).attrs["degenerate"] for tr in traces)  # the reason, checked on its own
    with pytest.warns(MetricWarning, match=rf"recipe {dead.id} \(F6, layer -1, gradcam\) is NaN for every metric "
                                           r"on all 2 image\(s\)"):
        card = vc.evaluate.scorecard(traces, [vc.Recipe(), dead], metrics=["sparseness"], progress=False)
    assert card["count"].sel(recipe=dead.id).values.tolist() == [0]
    assert np.isnan(card["mean"].sel(recipe=dead.id).values).all()
    assert card["count"].sel(recipe=vc.Recipe().id).values.tolist() == [2]


def test_scorecard_of_one_image_gives_no_interval(shapes):
    tr, _mask = shapes[0]
    with pytest.warns(MetricWarning, match="one image gives no 95 % interval"):
        card = vc.evaluate.scorecard([tr], [vc.Recipe()], metrics=["sparseness"], progress=False)
    assert int(card["count"].values[0, 0]) == 1
    assert np.isnan(card["low"].values).all() and np.isnan(card["high"].values).all()  # 0.2: low == high == mean
    assert card["mean"].values[0, 0] == pytest.approx(vc.evaluate.sparseness(vc.cam(tr, vc.Recipe())))


def test_scorecard_refuses_a_bootstrap_over_the_memory_budget_before_scoring(shapes, monkeypatch):
    scorecard_module = importlib.import_module("vitcam_nb.evaluate.scorecard.card")
    monkeypatch.setattr(scorecard_module, "available_bytes", lambda: 8 * 10 ** 9)

    def no_scores(*a, **k):
        raise AssertionError("images were scored before n_boot was checked")
    monkeypatch.setattr(scorecard_module, "image_scores", no_scores)
    # 10**9 resamples: their 2 image indices (int64) 16 GB, their means and the percentiles' copy 16 GB.
    with pytest.raises(ValueError, match=r"^n_boot: 1000000000 resamples of 2 images would hold about 32\.0 GB"):
        vc.evaluate.scorecard([tr for tr, _ in shapes], [vc.Recipe()], ["sparseness"], n_boot=10 ** 9)


FIELDS = ["site", "layer", "target", "class_", "weight_tokens", "weighting", "heads", "relu", "nonsense", "aggregation"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.just("open"),
                   st.sampled_from(["F1", "F6", "logit", "patch", "gradcam", "after", "channels", "top1", ""]),
                   st.lists(st.integers(-2, 2), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(),
                                                                              max_size=1))
MASKS = st.one_of(st.none(), st.just("object"), st.just("object"), st.just("text"), st.integers(), st.builds(
    lambda h, w, fill, dt: np.full((h, w), fill, dt), st.sampled_from([0, 1, 10, 64]), st.sampled_from([1, 64]),
    st.sampled_from([0, 1, 2]), st.sampled_from([bool, np.uint8, np.float32])), st.lists(st.booleans(), max_size=3))
def mostly(usual: st.SearchStrategy, *others: object) -> st.SearchStrategy:
    """``usual`` in about four draws of five, else one of ``others``: most examples reach the analysis itself."""
    return st.tuples(st.integers(0, 4), usual, st.sampled_from(others)).map(lambda t: t[2] if t[0] == 4 else t[1])


COUNTS = mostly(st.integers(1, 64), 0, -1, True, False, 1.5, float("nan"), None, "8", 10 ** 9, 10 ** 18, 2 ** 70)
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])


def _named(err: Exception) -> None:
    """A refusal of the kit's own kind: a ValueError / TypeError (or subclass) whose message names the argument."""
    assert type(err).__module__.split(".")[0] in ("builtins", "vitcam_nb"), repr(err)
    assert re.match(r"^[a-z_]+(, [a-z_]+)*: ", str(err)), repr(err)


@FUZZ
@given(reported=mostly(st.one_of(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=3),
                                st.dictionaries(st.sampled_from(FIELDS[:8]), VALUES, max_size=2)), None, "site=F1", 3),
       space=mostly(st.none(), 3, "text", {"relu": []}, {"relu": "after"}, {"nonsense": [1]}, {"layer": [-1, 99]},
                    {"heads": [{}]}, {"target": ["logit", "prob", "nope"]}, {"weight_tokens": ["patch", None]}),
       mask=MASKS, n_samples=COUNTS)
def test_fuzzed_ambiguity_arguments_give_an_answer_or_a_kit_error(shapes, reported, space, mask, n_samples):
    tr, object_mask = shapes[0]
    if isinstance(reported, dict):  # keep the open space small: the fuzz is about the arguments, not the size
        reported = {**REPORTED, "weighting": "gradcam", "relu": "after", **reported}
    mask = object_mask if isinstance(mask, str) and mask == "object" else mask
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            amb = vc.ambiguity(tr, reported, space=space, mask=mask, n_samples=n_samples, n_boot=5)
    except (ValueError, TypeError) as err:  # the kit's errors (RecipeError, TraceError ...) subclass these
        event(f"refused: {str(err)[:40]}")
        _named(err)
        return
    event("answered")
    assert len(amb.recipes) == amb.maps.sizes["recipe"] >= 1
    assert amb.localises is None or 0.0 <= amb.localises <= 1.0


@FUZZ
@given(which=mostly(st.just("list"), "one", "empty", "junk", "string"),
       recipes=mostly(st.just("two"), "dup", "empty", "strings", "none"),
       metrics=mostly(st.sampled_from([None, ("sparseness",)]), ("no such metric",), "sparseness", (),
                      ("pointing_game",), (3,)),
       masks=mostly(st.sampled_from([None, "right"]), "small", "none-list", "text"),
       n_boot=mostly(st.integers(1, 64), 0, -1, True, 1.5, None, "8", 2 ** 70), target=mostly(st.just("recipe"),
                                                                                               "label", "x", 3))
def test_fuzzed_scorecard_arguments_give_a_card_or_a_kit_error(shapes, which, recipes, metrics, masks, n_boot, target):
    traces = {"list": [tr for tr, _ in shapes], "one": shapes[0][0], "empty": [], "junk": [1, 2],
              "string": "traces"}[which]
    recipes = {"two": [vc.Recipe(), vc.Recipe(site="F6", layer=-1)], "dup": [vc.Recipe(), vc.Recipe()],
               "empty": [], "strings": ["gradcam"], "none": None}[recipes]
    n = len(traces) if isinstance(traces, list) else 1
    masks = {None: None, "right": [m for _, m in shapes][:n], "small": [np.ones((3, 3), bool)] * n,
             "none-list": [], "text": "text"}[masks]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            card = vc.evaluate.scorecard(traces, recipes, metrics, masks=masks, n_boot=n_boot, target=target,
                                         progress=False)
    except (ValueError, TypeError) as err:
        event(f"refused: {str(err)[:40]}")
        _named(err)
        return
    event("answered")
    assert isinstance(card, xr.Dataset)
    finite = card["count"].values >= 2
    assert (card["low"].values[finite] <= card["high"].values[finite]).all()
    assert np.isnan(card["low"].values[~finite]).all()
