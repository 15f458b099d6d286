"""Recipes as text (``Recipe.to_string`` / ``Recipe.parse``) and one canonical id per map (``Recipe.resolve``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vitcam_testing import make_model

import vitcam_nb as vc
from vitcam_nb.core import recipe as R
from vitcam_nb.core.recipe_text import KEYS

FIELDS = {
    "site": st.sampled_from(R.SITES),
    "layer": st.one_of(st.integers(-12, 11), st.just("all"), st.sampled_from(["2.-1", "0.0", "1.3"]),
                       st.lists(st.integers(-6, 5), min_size=1, max_size=3, unique=True).map(tuple)),
    "target": st.sampled_from(R.TARGETS),
    "class_": st.one_of(st.integers(0, 999), st.integers(1, 9).map(lambda i: f"top{i}")),
    "weight_tokens": st.sampled_from(R.WEIGHT_TOKENS),
    "upsample": st.sampled_from(R.UPSAMPLES),
    "weighting": st.sampled_from(R.weighting_names()),
    "heads": st.one_of(st.sampled_from(R.HEAD_RULES), st.integers(0, 15)),
    "attn_rows": st.sampled_from(R.ATTN_ROWS),
    "layer_fusion": st.sampled_from(R.LAYER_FUSIONS),
    "relu": st.sampled_from(R.RELUS),
    "normalize": st.sampled_from(R.NORMALIZES),
    "text_tokens": st.one_of(st.sampled_from(["all", "cls", "dog", "a dog", 'say "hi"', "3", "x=y"]),
                             st.integers(0, 30)),
    "k": st.one_of(st.none(), st.integers(1, 500)),
}


@st.composite
def recipes(draw):
    fields = {name: draw(strategy) for name, strategy in FIELDS.items() if draw(st.booleans())}
    try:
        return vc.Recipe(**fields)
    except vc.RecipeError:
        return vc.Recipe()


@settings(max_examples=400, deadline=None)
@given(recipes())
def test_every_recipe_round_trips_through_its_text(recipe):
    text = recipe.to_string()
    assert vc.Recipe.parse(text) == recipe
    assert vc.Recipe.parse(text).id == recipe.id
    assert "\n" not in text and text.startswith(f"{recipe.site}@")


def test_the_canonical_form_states_every_field_in_a_fixed_order():
    text = vc.Recipe(site="F1", layer=11).to_string()
    assert text == ("F1@11 target=logit class=top1 tokens=patch reshape=raster upsample=bilinear weighting=gradcam "
                    "heads=channels rows=cls fusion=none relu=after normalize=minmax")
    keys = [part.split("=")[0] for part in text.split()[1:]]
    assert keys == [k for k in KEYS if k not in ("text", "k")]
    xattn = vc.Recipe(site="xattn", layer=8, text_tokens="a dog").to_string()
    assert xattn.startswith("xattn@8 ") and xattn.endswith('text="a dog"')
    assert vc.Recipe(weighting="gscorecam", k=300).to_string().endswith("k=300")
    assert vc.Recipe(layer=(3,), layer_fusion="mean").to_string().startswith("F1@3, ")
    assert vc.Recipe.parse("F1@3, fusion=mean").layer == (3,)


@pytest.mark.parametrize("text,fields", [
    ("F1@-1", {}),
    ("F1@11 logit gradcam", {"layer": 11}),
    ("F2@all prob layercam fusion=mean rows=mean", {"site": "F2", "layer": "all", "target": "prob",
                                                     "weighting": "layercam", "layer_fusion": "mean",
                                                     "attn_rows": "mean"}),
    ("F4@2 top3 nearest normalize=max", {"site": "F4", "layer": 2, "class_": "top3", "upsample": "nearest",
                               "normalize": "max"}),
    ("F2@1 heads=2 relu=none class=7", {"site": "F2", "layer": 1, "heads": 2, "relu": "none", "class_": 7}),
    ("F1@2.-1 hirescam", {"layer": "2.-1", "weighting": "hirescam"}),
    ("F2@0,3,5 fusion=rollout", {"site": "F2", "layer": (0, 3, 5), "layer_fusion": "rollout"}),
])
def test_hand_written_lines_take_defaults_and_bare_values(text, fields):
    assert vc.Recipe.parse(text) == vc.Recipe(**fields)


@pytest.mark.parametrize("text,match", [
    ("", "expected a line"),
    ("gradcam F1@1", "SITE@LAYER"),
    ("F1", "SITE@LAYER"),
    ("F1@1 none", "could be"),
    ("F4@2 max", "could be"),
    ("F1@1 colour=red", "unknown key 'colour'"),
    ("F1@1 gradcam weighting=layercam", "given twice"),
    ("F1@1 banana", "cannot read 'banana'"),
    ("F9@1", "site"),
    ('xattn@1 text="unterminated', "cannot read|quoted"),
])
def test_unreadable_text_is_refused_naming_the_part(text, match):
    with pytest.raises(vc.RecipeError, match=match):
        vc.Recipe.parse(text)


MODEL = make_model("vit")  # 3 blocks
TR = vc.trace(MODEL, np.random.default_rng(3).integers(0, 255, (32, 32, 3), dtype=np.uint8), targets="top2")


def test_equivalent_spellings_get_one_canonical_id_and_the_same_map():
    a, b = vc.Recipe(layer=-1), vc.Recipe(layer=2)
    assert a.id != b.id  # the 0.1 id hashes the recipe as written
    top1 = b.replace(class_=int(np.argmax(TR["logits"].values)))  # top1: the class this trace ranks first
    assert a.resolve(TR) == top1 and a.canonical_id(TR) == b.canonical_id(TR) == top1.id
    np.testing.assert_array_equal(vc.cam(TR, a).values, vc.cam(TR, b).values)
    fused = vc.Recipe(layer=(-3, -1), layer_fusion="mean")
    assert fused.resolve(TR).layer == (0, 2)
    # "all" is the trace's blocks (issue 52: a trace of blocks 0, 2, 4 is another map than one of 0..5)
    assert vc.Recipe(site="F2", layer="all", layer_fusion="rollout").resolve(TR).layer == (0, 1, 2)


def test_resolve_refuses_a_layer_the_trace_does_not_have():
    with pytest.raises(vc.RecipeError, match="layer: 3 is out of range for a model with 3 blocks"):
        vc.Recipe(layer=3).resolve(TR)
    with pytest.raises(vc.RecipeError):
        vc.Recipe(layer="1.0").resolve(TR)


def test_resolve_on_a_hierarchical_trace_gives_global_blocks():
    import timm

    swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 2), num_heads=(2, 4),
                             embed_dim=16, img_size=56, window_size=7).eval()
    tr = vc.trace(swin, np.random.default_rng(4).integers(0, 255, (56, 56, 3), dtype=np.uint8), targets="top1",
                  sites=["F1"])
    assert vc.Recipe(layer="1.-1").resolve(tr).layer == 2 == vc.Recipe(layer=-1).resolve(tr).layer
    top1 = int(np.argmax(tr["logits"].values))
    assert vc.Recipe(layer="1.-1").canonical_id(tr) == vc.Recipe(layer=2, class_=top1).id
    assert vc.Recipe(layer="0.0").canonical_id(tr) == vc.Recipe(layer=0, class_=top1).id
