"""Property-based tests (hypothesis) of recipes and ``vc.cam`` on one fixed trace (issue #3).

Random valid recipes: finite output of the right shape, values in [0, 1] with min-max normalisation,
identical output on a second call, degenerate maps are zeros with a reason and a warning, equal recipes
have equal ids and JSON. Random malformed field values: a RecipeError (a ValueError) naming the field.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import vitcam_nb as vc
from vitcam_nb.core.recipe import (
    ATTN_ROWS,
    HEAD_RULES,
    INTEGRATED_ROLLOUTS,
    NORMALIZES,
    RELUS,
    TARGETS,
    UPSAMPLES,
    WEIGHT_TOKENS,
    pooled_weightings,
    weighting_names,
)
from vitcam_nb.core.recipe import (
    LAYER_FUSIONS as ALL_FUSIONS,
)
from vitcam_nb.core.recipe import (
    SITES as RECIPE_SITES,
)
from vitcam_nb.core.schema import EXTRA_SITES, OPTIONAL_SITES
from vitcam_nb.core.weighting import WEIGHTINGS as WEIGHTING_TABLE

# Weightings computed from the trace alone; those read from vc.score's model outputs (scorecam, ablationcam,
# gscorecam) need the model and are tested in tests/unit/capture/test_scoring.py and test_scored_parity.py.
POOLED_WEIGHTINGS = pooled_weightings()
# The published methods (method=True) read several sites each: tests/unit/compute/test_published.py.
WEIGHTINGS = tuple(w for w in weighting_names()
                   if not WEIGHTING_TABLE.get(w).scores and not WEIGHTING_TABLE.get(w).method)
# Likewise the rollouts weighted by vc.score's integrated gradients (tests/unit/compute/test_presets_published.py).
LAYER_FUSIONS = tuple(f for f in ALL_FUSIONS if f not in INTEGRATED_ROLLOUTS)

NUM_LAYERS, NUM_HEADS, TOP_K = 3, 4, 3
# Block sites of a ViT; 'xattn' (cross-attention of vision-language models) is tested in tests/unit/model/test_blip.py.
# The optional sites (q, k, v, q_out, k_out, attn_scores) feed the published methods (tests/unit/compute/
# test_published.py).
SITES = tuple(s for s in RECIPE_SITES if s not in EXTRA_SITES and s not in OPTIONAL_SITES)


def _trace():
    from vitcam_testing import make_input, make_model

    return vc.trace(make_model("vit"), make_input("vit"), targets=f"top{TOP_K}", sites=list(SITES))


TRACE = _trace()
H, W = int(TRACE.attrs["img_height"]), int(TRACE.attrs["img_width"])
GH, GW = int(TRACE.attrs["grid_h"]), int(TRACE.attrs["grid_w"])
TRACED_CLASSES = [int(c) for c in TRACE.target_class.values if c >= 0]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

single_layer = st.integers(-NUM_LAYERS, NUM_LAYERS - 1)
# unique_by the absolute block: (0, -NUM_LAYERS) names one block twice, which cam() refuses.
many_layers = st.one_of(st.just("all"), st.lists(single_layer, min_size=1, max_size=3,
                                                 unique_by=lambda v: v % NUM_LAYERS).map(tuple))


@st.composite
def recipes(draw):
    """Valid recipes for TRACE, drawn field by field so that few are rejected."""
    fusion = draw(st.sampled_from(LAYER_FUSIONS))
    kw: dict = {"layer_fusion": fusion,
                "layer": draw(single_layer) if fusion == "none" else draw(st.one_of(single_layer, many_layers)),
                "upsample": draw(st.sampled_from(UPSAMPLES)), "relu": draw(st.sampled_from(RELUS)),
                "normalize": draw(st.sampled_from(NORMALIZES))}
    if fusion in ("rollout", "grad_rollout"):
        kw["site"] = "F2"
        kw["attn_rows"] = draw(st.sampled_from(ATTN_ROWS))
        if fusion == "grad_rollout":
            kw["target"] = draw(st.sampled_from(TARGETS))
            kw["class_"] = draw(st.one_of(st.sampled_from([f"top{k}" for k in range(1, TOP_K + 1)]),
                                          st.sampled_from(TRACED_CLASSES)))
    else:
        site = kw["site"] = draw(st.sampled_from(SITES))
        weighting = kw["weighting"] = draw(st.sampled_from(WEIGHTINGS))
        kw["target"] = draw(st.sampled_from(TARGETS))
        kw["class_"] = draw(st.one_of(st.sampled_from([f"top{k}" for k in range(1, TOP_K + 1)]),
                                      st.sampled_from(TRACED_CLASSES)))
        if weighting in POOLED_WEIGHTINGS:
            kw["weight_tokens"] = draw(st.sampled_from(WEIGHT_TOKENS))
        if site in ("F2", "F3") and weighting not in ("eigencam", "eigengradcam"):
            kw["heads"] = draw(st.one_of(st.sampled_from(HEAD_RULES), st.integers(0, NUM_HEADS - 1)))
        if site == "F2":
            kw["attn_rows"] = draw(st.sampled_from(ATTN_ROWS))
    try:
        return vc.Recipe(**kw)
    except vc.RecipeError:
        assume(False)


def _cam(recipe, **kw):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        m = vc.cam(TRACE, recipe, **kw)
    return m, [w for w in rec if issubclass(w.category, vc.DegenerateMapWarning)]


@SETTINGS
@given(recipes())
def test_cam_properties(r):
    m, ws = _cam(r)
    v = m.values
    assert v.dtype == np.float32 and np.all(np.isfinite(v))
    if r.upsample == "none":
        assert m.dims == ("patch_row", "patch_col") and v.shape == (GH, GW)
    else:
        assert m.dims == ("y", "x") and v.shape == (H, W)
    if r.normalize == "minmax":
        assert v.min() >= 0 and v.max() <= 1
    if m.attrs["degenerate"]:
        assert ws and np.all(v == 0)
    else:
        assert not ws
        if r.normalize != "none":
            assert v.max() == pytest.approx(1, abs=1e-6)
    assert m.attrs["recipe_id"] == r.id and vc.Recipe.from_json(m.attrs["recipe"]) == r
    assert m.attrs["trace_id"] == TRACE.attrs["trace_id"]
    # a second call gives the very same map
    m2, _ = _cam(r)
    assert np.array_equal(v, m2.values) and m2.attrs == m.attrs
    # the grid map: the right shape, in [0, 1], the same degeneracy
    g, _ = _cam(r, grid=True)
    assert g.shape == (GH, GW) and np.all(np.isfinite(g.values))
    if r.normalize == "minmax":
        assert g.values.min() >= 0 and g.values.max() <= 1
    assert bool(g.attrs["degenerate"]) == bool(m.attrs["degenerate"]) or r.layer_fusion != "none"


@SETTINGS
@given(recipes())
def test_recipe_identity(r):
    copy = vc.Recipe(**{f: getattr(r, f) for f in r.to_dict()})
    assert copy == r and hash(copy) == hash(r) and copy.id == r.id and copy.to_json() == r.to_json()
    back = vc.Recipe.from_json(r.to_json())
    assert back == r and back.id == r.id and type(back.layer) is type(r.layer)
    assert vc.Recipe.from_dict(r.to_dict()) == r
    assert len(r.id) == 12 and int(r.id, 16) >= 0
    assert r.replace() == r


@SETTINGS
@given(recipes(), recipes())
def test_distinct_recipes_distinct_ids(a, b):
    assert (a == b) == (a.id == b.id) == (a.to_json() == b.to_json())


ENUMS = {"site": SITES, "target": TARGETS, "weight_tokens": WEIGHT_TOKENS, "reshape": ("raster",),
         "upsample": UPSAMPLES, "weighting": WEIGHTINGS, "attn_rows": ATTN_ROWS, "layer_fusion": LAYER_FUSIONS,
         "relu": RELUS, "normalize": NORMALIZES}
junk = st.one_of(st.text(max_size=12), st.none(), st.booleans(), st.floats(allow_nan=True),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


@st.composite
def malformed(draw):
    field = draw(st.sampled_from([*ENUMS, "heads", "class_", "layer"]))
    if field in ENUMS:
        value = draw(junk.filter(lambda v: not (isinstance(v, str) and v in ENUMS[field])))
    elif field == "heads":
        value = draw(st.one_of(st.integers(max_value=-1), junk.filter(
            lambda v: not (isinstance(v, str) and v in HEAD_RULES))))
    elif field == "class_":
        value = draw(st.one_of(st.integers(max_value=-1), st.text(max_size=6), st.floats(), st.booleans(),
                               st.none()).filter(lambda v: not (isinstance(v, str) and v[:3] == "top"
                                                                and v[3:].isdigit() and v[3] != "0")))
    else:
        value = draw(st.one_of(st.floats(), st.booleans(), st.none(), st.text(max_size=5).filter(lambda v: v != "all"),
                               st.just(()), st.tuples(st.integers(), st.floats()),
                               st.integers().map(lambda i: (i, i))))
    return field, value


@SETTINGS
@given(malformed())
def test_malformed_values_refused_naming_the_field(fv):
    field, value = fv
    kw = {field: value}
    if field == "layer":
        kw["layer_fusion"] = "mean"   # so that only the value itself is wrong
    with pytest.raises(vc.RecipeError) as e:
        vc.Recipe(**kw)
    assert isinstance(e.value, ValueError)
    assert str(e.value).startswith(f"{field}:"), str(e.value)
    # the same through JSON where the value is JSON-representable
    try:
        import json

        text = json.dumps({field: value, **({"layer_fusion": "mean"} if field == "layer" else {})})
    except (TypeError, ValueError):
        return
    with pytest.raises(vc.RecipeError):
        vc.Recipe.from_json(text)


def _contexts():
    """Every value of the recipe table of docs/architecture.md in the least change of the defaults that makes it
    meaningful."""
    out = []
    for field, values in {**ENUMS, "heads": (*HEAD_RULES, 0, NUM_HEADS - 1)}.items():
        for value in values:
            kw = {field: value}
            if field == "weight_tokens":
                kw["weighting"] = "xgradcam"
            if field == "heads" or field == "attn_rows":
                kw["site"] = "F2" if field == "attn_rows" else "F3"
            if field == "layer_fusion" and value != "none":
                kw["layer"] = "all"
                kw["site"] = "F2" if value in ("rollout", "grad_rollout") else "F1"
            out.append(kw)
    out += [{"site": "F2", "heads": h} for h in (*HEAD_RULES, 1)]
    out += [{"layer": v} for v in range(-NUM_LAYERS, NUM_LAYERS - 1)]   # last-block layers may be degenerate
    out += [{"class_": c} for c in (*TRACED_CLASSES, "top2", "top3")]
    return out


@pytest.mark.parametrize("kw", _contexts(), ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_every_value_computes(kw):
    r = vc.Recipe(**kw)
    m, ws = _cam(r)
    assert np.all(np.isfinite(m.values))
    if not m.attrs["degenerate"]:
        assert not ws and m.values.max() > 0
        if r.normalize != "none":
            assert m.values.max() == pytest.approx(1, abs=1e-6)
