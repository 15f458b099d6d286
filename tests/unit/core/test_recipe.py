"""Acceptance tests of the Recipe taxonomy (issue #3): values, validation, identity, checklist, describe.

The recipe table of docs/architecture.md ("Recipes and formulas") is restated here independently; every value must
be accepted where it makes sense, every meaningless combination refused with a RecipeError (a ValueError) whose message
starts with the field name and lists what is allowed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb import presets

DEFAULTS = dict(site="F1", layer=-1, target="logit", class_="top1", weight_tokens="patch", reshape="raster",
                upsample="bilinear", weighting="gradcam", heads="channels", attn_rows="cls", layer_fusion="none",
                relu="after", normalize="minmax")
TABLE = {
    "site": ["F1", "F2", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid"],
    "target": ["logit", "prob", "logprob"],
    "weight_tokens": ["patch", "all", "cls"],
    "reshape": ["raster"],
    "upsample": ["bilinear", "bicubic", "nearest", "none"],
    "weighting": ["gradcam", "hirescam", "gradcam_elementwise", "gradcampp", "xgradcam", "layercam", "eigencam",
                  "eigengradcam", "gradient"],
    "heads": ["mean_then_relu", "relu_then_mean", "channels", "max"],
    "attn_rows": ["cls", "mean", "patch_mean"],
    "layer_fusion": ["none", "mean", "sum", "max", "rollout", "grad_rollout"],
    "relu": ["after", "none"],
    "normalize": ["minmax", "max", "none"],
}
CATEGORIES = ("feature representation", "gradient target", "token handling", "aggregation",
              "spatial reconstruction")
DEFAULT_ID = "36db00aafece"   # sha256 of the canonical JSON of Recipe(); a cross-machine stability check


# --------------------------------------------------------------------------------------------------
# Defaults and every value of the table


def test_defaults_match_the_design_table():
    r = vc.Recipe()
    # text_tokens (site xattn) and k (gscorecam) came after 0.1.0; at their defaults they stay out of the JSON so
    # ids are unchanged.
    assert {f.name: getattr(r, f.name) for f in dataclasses.fields(r)} == {**DEFAULTS, "text_tokens": "all", "k": None}
    assert r.to_dict() == DEFAULTS
    assert vc.Recipe(site="xattn", text_tokens="dog").to_dict()["text_tokens"] == "dog"


def _valid_context(field: str, value) -> dict:
    """The least change of the defaults that makes ``field=value`` meaningful."""
    ctx = {field: value}
    if field == "weight_tokens" and value != "patch":
        ctx["weighting"] = "gradcampp"
    if field == "heads" and value != "channels":
        ctx["site"] = "F3"
    if field == "attn_rows" and value != "cls":
        ctx["site"] = "F2"
    if field == "layer_fusion" and value != "none":
        ctx["layer"] = "all"
        if value in ("rollout", "grad_rollout"):
            ctx["site"] = "F2"
    return ctx


@pytest.mark.parametrize("field, value", [(f, v) for f, vs in TABLE.items() for v in vs])
def test_every_table_value_is_accepted(field, value):
    r = vc.Recipe(**_valid_context(field, value))
    assert getattr(r, field) == value
    assert vc.Recipe.from_json(r.to_json()) == r


@pytest.mark.parametrize("kw", [
    {"layer": 0}, {"layer": 11}, {"layer": -12}, {"layer": (0, 3), "layer_fusion": "mean"},
    {"layer": (-1,), "layer_fusion": "max"}, {"layer": "all", "layer_fusion": "sum"},
    {"class_": 0}, {"class_": 999}, {"class_": "top5"}, {"class_": "top12"},
    {"site": "F2", "heads": 0}, {"site": "F3", "heads": 11}, {"site": "F2", "heads": "max", "attn_rows": "mean"},
    {"weighting": "xgradcam", "weight_tokens": "cls"}, {"weighting": "gradcam", "weight_tokens": "all"},
    {"site": "F2", "weighting": "eigencam"}, {"site": "F3", "weighting": "eigengradcam"},
    {"site": "F2", "layer": "all", "layer_fusion": "grad_rollout", "target": "prob", "class_": 3},
    {"site": "F2", "layer": (0, 1), "layer_fusion": "rollout", "attn_rows": "patch_mean"},
    {"site": "F2", "layer": "all", "layer_fusion": "rollout", "relu": "none", "normalize": "max"},
    {"site": "F3", "layer": "all", "layer_fusion": "mean", "heads": "relu_then_mean", "target": "logprob"},
])
def test_meaningful_combinations_accepted(kw):
    r = vc.Recipe(**kw)
    for k, v in kw.items():
        assert getattr(r, k) == v


def test_layer_list_becomes_tuple():
    r = vc.Recipe(layer=[0, 2], layer_fusion="mean")
    assert r.layer == (0, 2) and r == vc.Recipe(layer=(0, 2), layer_fusion="mean")
    assert hash(r) == hash(vc.Recipe(layer=(0, 2), layer_fusion="mean"))


# --------------------------------------------------------------------------------------------------
# Refusals


BAD_VALUES = [
    ("site", "F7"), ("site", "f1"), ("site", 1), ("site", None),
    ("layer", 1.5), ("layer", "last"), ("layer", True), ("layer", None), ("layer", "1"),
    ("target", "probability"), ("target", None), ("target", "Logit"),
    ("class_", -1), ("class_", "top0"), ("class_", "top"), ("class_", "cat"), ("class_", 1.0), ("class_", True),
    ("class_", None),
    ("weight_tokens", "prefix"), ("weight_tokens", None),
    ("reshape", "col_major"), ("reshape", None),
    ("upsample", "linear"), ("upsample", True),
    ("weighting", "gradcam++"), ("weighting", "GradCAM"), ("weighting", None),
    ("heads", -1), ("heads", "mean"), ("heads", True), ("heads", 1.5),
    ("attn_rows", "all"), ("attn_rows", 0),
    ("layer_fusion", "prod"), ("layer_fusion", None),
    ("relu", "before"), ("relu", True), ("relu", False),
    ("normalize", "l2"), ("normalize", None), ("normalize", "MinMax"),
]


@pytest.mark.parametrize("field, value", BAD_VALUES)
def test_bad_value_refused_naming_field_and_allowed(field, value):
    ctx = _valid_context(field, DEFAULTS[field])
    ctx[field] = value
    with pytest.raises(vc.RecipeError) as e:
        vc.Recipe(**ctx)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert msg.startswith(f"{field}:"), msg
    if field == "heads" and type(value) is int:
        assert "head index" in msg
    elif field in TABLE:
        assert all(v in msg for v in TABLE[field]), f"{field} must list its allowed values: {msg}"
    elif field == "class_":
        assert "top" in msg and "index" in msg
    else:
        assert "int" in msg and "all" in msg


@pytest.mark.parametrize("field, value", [("layer", ()), ("layer", (0, 0)), ("layer", (0, "1")),
                                          ("layer", (0, 1.0))])
def test_bad_layer_tuples(field, value):
    with pytest.raises(vc.RecipeError, match=f"^{field}"):
        vc.Recipe(layer=value, layer_fusion="mean")


MEANINGLESS = [
    ({"layer": (0, 1)}, "layer", ["mean", "sum", "max", "rollout", "grad_rollout"]),
    ({"layer": "all"}, "layer", ["mean", "rollout"]),
    ({"heads": "max"}, "heads", ["F2", "F3"]),
    ({"site": "F4", "heads": 0}, "heads", ["F2", "F3"]),
    ({"site": "F1", "attn_rows": "mean"}, "attn_rows", ["F2"]),
    ({"site": "F3", "attn_rows": "patch_mean"}, "attn_rows", ["F2"]),
    *[({"weighting": w, "weight_tokens": "all"}, "weight_tokens", ["gradcam", "gradcampp", "xgradcam"])
      for w in ("hirescam", "gradcam_elementwise", "layercam", "eigencam", "eigengradcam", "gradient")],
    ({"site": "F3", "weighting": "eigencam", "heads": "mean_then_relu"}, "heads", ["channels"]),
    ({"site": "F2", "weighting": "eigengradcam", "heads": 1}, "heads", ["channels"]),
    ({"site": "F1", "layer": "all", "layer_fusion": "rollout"}, "site", ["F2"]),
    ({"site": "F3", "layer": "all", "layer_fusion": "grad_rollout"}, "site", ["F2"]),
    ({"site": "F2", "layer": "all", "layer_fusion": "rollout", "weighting": "hirescam"}, "weighting", ["gradcam"]),
    ({"site": "F2", "layer": "all", "layer_fusion": "grad_rollout", "heads": "max"}, ("weighting", "heads"),
     ["channels"]),
    ({"site": "F2", "layer": "all", "layer_fusion": "rollout", "target": "prob"}, "target", ["logit"]),
    ({"site": "F2", "layer": "all", "layer_fusion": "rollout", "class_": 3}, ("target", "class_"), ["top1"]),
]


@pytest.mark.parametrize("kw, field, allowed", MEANINGLESS)
def test_meaningless_combinations_refused(kw, field, allowed):
    with pytest.raises(vc.RecipeError) as e:
        vc.Recipe(**kw)
    msg = str(e.value)
    fields = field if isinstance(field, tuple) else (field,)
    assert msg.split(":")[0] in fields, msg
    for v in allowed:
        assert v in msg, f"{v!r} missing from {msg!r}"


def test_unknown_fields():
    with pytest.raises(TypeError, match="colour"):
        vc.Recipe(colour="red")
    for call in (lambda: vc.Recipe.from_dict({"colour": "red"}), lambda: vc.Recipe.from_json('{"colour": 1}'),
                 lambda: vc.Recipe().replace(colour="red")):
        with pytest.raises(vc.RecipeError) as e:
            call()
        assert str(e.value).startswith("colour") and "site" in str(e.value)


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '"F1"', "{", None, 3])
def test_from_json_refuses_garbage(text):
    with pytest.raises(vc.RecipeError):
        vc.Recipe.from_json(text)


def test_from_json_invalid_value_names_field():
    with pytest.raises(vc.RecipeError, match="^weighting"):
        vc.Recipe.from_json('{"weighting": "nope"}')


def test_replace_revalidates():
    with pytest.raises(vc.RecipeError, match="^heads"):
        vc.Recipe(site="F3", heads="max").replace(site="F4")
    assert vc.Recipe(site="F3", heads="max").replace(heads="channels", site="F4").site == "F4"


# --------------------------------------------------------------------------------------------------
# Identity: frozen, hashable, canonical JSON, stable id


def test_frozen_and_hashable():
    r = vc.Recipe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.site = "F4"
    assert len({vc.Recipe(), vc.Recipe(site="F1"), vc.Recipe(site="F4")}) == 2
    assert {vc.Recipe(): 1}[vc.Recipe(layer=-1)] == 1


def test_canonical_json_and_id_computed_independently():
    r = vc.Recipe()
    canonical = json.dumps(DEFAULTS, sort_keys=True, separators=(",", ":"))
    assert r.to_json() == canonical
    assert r.id == hashlib.sha256(canonical.encode()).hexdigest()[:12] == DEFAULT_ID
    r2 = vc.Recipe(site="F2", layer=(0, 2), layer_fusion="grad_rollout", class_=5)
    d = {**DEFAULTS, "site": "F2", "layer": [0, 2], "layer_fusion": "grad_rollout", "class_": 5}
    canonical2 = json.dumps(d, sort_keys=True, separators=(",", ":"))
    assert r2.to_json() == canonical2
    assert r2.id == hashlib.sha256(canonical2.encode()).hexdigest()[:12]
    assert vc.Recipe.from_json(r2.to_json()) == r2 and vc.Recipe.from_json(r2.to_json()).layer == (0, 2)


def test_ids_differ_and_are_hex():
    recipes = {vc.Recipe(**_valid_context(f, v)) for f, vs in TABLE.items() for v in vs}
    ids = {r.id for r in recipes}
    assert len(ids) == len(recipes)
    assert all(len(i) == 12 and int(i, 16) >= 0 for i in ids)
    # from_json with keys in another order and whitespace is the same recipe
    shuffled = json.dumps(dict(reversed(list(DEFAULTS.items()))), indent=2)
    assert vc.Recipe.from_json(shuffled).id == DEFAULT_ID
    assert vc.Recipe.from_json("{}") == vc.Recipe()


# --------------------------------------------------------------------------------------------------
# Checklist and describe


@pytest.fixture(scope="module")
def tr():
    from vitcam_testing import make_input, make_model

    return vc.trace(make_model("vit"), make_input("vit"), targets="top3")


def test_checklist_categories_without_trace():
    c = vc.Recipe().checklist()
    assert isinstance(c, vc.Checklist) and isinstance(c, dict)
    for cat in CATEGORIES:
        assert cat in c and c[cat], cat
    md = c.to_markdown()
    assert md.splitlines()[0].startswith("| category")
    assert all(cat in md for cat in CATEGORIES)
    json.loads(c.to_json())


@pytest.mark.parametrize("site", ["F1", "F2", "F3", "F4", "F5", "F6"])
@pytest.mark.parametrize("layer", [0, -1])
def test_checklist_names_the_hooked_module(tr, site, layer):
    c = vc.Recipe(site=site, layer=layer).checklist(tr)
    hook = tr.attrs[f"hook_{site}"]
    template, _, io = hook.partition(":")
    fr = c["feature representation"]
    absolute = layer % tr.attrs["num_layers"]
    assert fr["module"] in (template, template.replace("{layer}", str(absolute)))
    assert fr["input or output"] == io
    assert site in fr["site"]
    assert str(absolute) in fr["layer"] or str(layer) in fr["layer"]
    assert "model and input" in c and tr.attrs["weights_sha256"] in c["model and input"]["weights sha256"]


def test_checklist_states_every_choice(tr):
    r = vc.Recipe(site="F3", layer=(0, 1), layer_fusion="max", heads="relu_then_mean", target="logprob",
                  class_=4, weighting="xgradcam", weight_tokens="all", upsample="nearest", relu="none",
                  normalize="max")
    c = r.checklist(tr)
    text = json.dumps(c)
    for needle in ("F3", "log", "class 4", "xgradcam", "all tokens", "relu_then_mean", "max", "nearest",
                   "no ReLU", "raster", "4 x 4", r.id):
        assert needle in text, needle
    assert "derived" in c["gradient target"]["derivation"]
    assert c["token handling"]["prefix tokens present"].startswith("1")


@pytest.mark.parametrize("r, needles", [
    (vc.Recipe(), ["F1", "block", "logit", "top1", "gradcam", "bilinear", "min-max"]),
    (vc.Recipe(site="F4", layer=1, target="prob", class_=2, weighting="layercam"),
     ["F4", "1", "probability", "class 2", "layercam"]),
    (presets.attention_rollout(), ["F2", "rollout", "no gradient"]),
    (presets.chefer_attention_gradcam(), ["F2", "CLS", "mean_then_relu"]),
])
def test_describe_mentions_site_layer_target_weighting(tr, r, needles):
    for text in (r.describe(), r.describe(tr)):
        assert text.startswith("Heatmaps were computed") and r.id in text
        for n in needles:
            assert n in text, (n, text)
    assert tr.attrs["hook_" + r.site].split(".")[0] in r.describe(tr)   # the module path ("blocks")


def test_presets_are_valid_and_cited():
    assert set(presets.names()) >= {"pytorch_grad_cam_vit", "gradcam", "hirescam", "gradcam_elementwise",
                                    "gradcampp", "xgradcam", "layercam", "eigencam", "eigengradcam",
                                    "chefer_attention_gradcam", "attention_rollout", "gradient_rollout",
                                    "legrad_style"}
    for name in presets.names():
        r = presets.get(name)
        assert isinstance(r, vc.Recipe)
        assert presets.citation(r), name
        assert r.checklist()["recipe"]["preset"] != "none"
    assert presets.pytorch_grad_cam_vit() == vc.Recipe()
    assert presets.gradcam(layer=3, site="F4") == vc.Recipe(layer=3, site="F4")
    assert presets.chefer_attention_gradcam() == vc.Recipe(site="F2", heads="mean_then_relu")
    assert presets.attention_rollout() == vc.Recipe(site="F2", layer="all", layer_fusion="rollout")
    with pytest.raises(vc.RecipeError, match="^name"):
        presets.get("nope")


def test_numpy_integers_are_accepted_and_stored_as_python_ints():
    r = vc.Recipe(layer=np.int64(1), class_=np.int32(2))
    assert r == vc.Recipe(layer=1, class_=2) and r.id == vc.Recipe(layer=1, class_=2).id
    assert type(r.layer) is int and type(r.class_) is int
    t = vc.Recipe(layer=(np.int64(0), 1), layer_fusion="mean")
    assert t.layer == (0, 1) and all(type(v) is int for v in t.layer)
    assert vc.Recipe(site="F3", heads=np.int16(1)).heads == 1
