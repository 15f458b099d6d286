"""Issue 52 (Reliability IV), battery2 wave 3: inputs refused by name before any work, or read as documented.

- ``vc.ambiguity``: a space that lists a value twice (also ``map_many``'s space, through ``check_space``),
  ``max_cells=0`` and a seed that is no int were accepted.
- ``Checklist.from_json``: a ``recipe.json`` item that is no text (``5``) was accepted, every item left unchecked.
- Images outside the documented range: floats beyond 0..1 and integers beyond 0..255 are rescaled from their
  min..max with a warning, and the rule is kept (``pixel_rule``); an image of one value outside the range has no
  min..max and became all zeros without a word: it is refused naming ``image``, by ``map_many`` before any pass.
- Canonical ids without prefix tokens: ``weight_tokens="all"`` and ``"patch"`` are one map and now one id.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import ArgumentError, RecipeError, TraceError
from vitcam_nb.core.recipe_space import check_space
from vitcam_nb.models import sample_image
from vitcam_nb.preprocess import InputCropWarning

MODEL = vc.load_model("shapes-vit")
IMAGE = sample_image("shapes", 0)
OTHER = sample_image("shapes", 1)
TR = vc.trace(MODEL, IMAGE, targets="top1")


# -- ambiguity arguments -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("space, named", [({"site": ["F1", "F1"]}, "'F1'"), ({"layer": [5, 5]}, "5"),
                                          ({"relu": ["after", "none", "after"]}, "'after'")])
def test_a_space_listing_a_value_twice_is_refused_by_name(space, named):
    with pytest.raises(RecipeError, match=rf"space: {next(iter(space))} lists {named} more than once"):
        vc.ambiguity(TR, space=space, n_boot=10, n_samples=8)
    with pytest.raises(RecipeError, match="recipes_or_space: .* more than once"):
        check_space(space, "recipes_or_space")


def test_values_that_are_different_layers_are_no_duplicate():
    check_space({"layer": [1, -1, (0, 1), (1, 0)], "site": ["F1", "F4"]}, "space")  # nothing raised


@pytest.mark.parametrize("kwargs, name", [({"max_cells": 0}, "max_cells"), ({"seed": "x"}, "seed"),
                                          ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"), ({"seed": True}, "seed")])
def test_ambiguity_refuses_a_bad_count_or_seed_by_name(kwargs, name):
    with pytest.raises(ArgumentError, match=rf"^{name}: "):
        vc.ambiguity(TR, reported={"site": "F1", "layer": -1}, **kwargs)


def test_a_numpy_seed_is_taken_as_its_int():
    a = vc.ambiguity(TR, reported={"site": "F1", "layer": -1, "target": "logit"}, seed=np.int64(3), n_boot=10)
    b = vc.ambiguity(TR, reported={"site": "F1", "layer": -1, "target": "logit"}, seed=3, n_boot=10)
    assert a.maps.values.tobytes() == b.maps.values.tobytes()


# -- Checklist.from_json -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [5, None, ["{}"], 1.5])
def test_a_recipe_json_item_that_is_no_text_is_refused(value):
    with pytest.raises(ArgumentError, match="text: item 'recipe/json' must be "):
        Checklist.from_json({"recipe": {"json": value}})


def test_a_checklist_with_its_recipe_json_still_reads_back():
    checklist = Recipe(site="F4").checklist()
    assert Checklist.from_json(checklist.to_json()) == checklist
    assert json.loads(checklist["recipe"]["json"])["site"] == "F4"


# -- images outside the documented range -------------------------------------------------------------------------------
def test_a_float_image_beyond_one_is_rescaled_from_its_min_max_and_the_rule_is_kept():
    big = IMAGE.astype(np.float32) * 300  # values up to 76,500
    with pytest.warns(UserWarning, match="rescaled linearly from their min..max"):
        tr = vc.trace(MODEL, big, targets="top1")
    lo, hi = float(big.min()), float(big.max())
    expected = np.round((big.astype(np.float64) - lo) / (hi - lo) * 255.0).astype(np.uint8)  # the documented rule
    assert np.array_equal(tr["image"].values, expected)
    assert "outside the 0..1 of floats" in json.loads(tr.attrs["preprocessing"])["pixel_rule"]


@pytest.mark.parametrize("image", [np.full((64, 64, 3), -5, np.int64), np.full((64, 64, 3), 300.0, np.float32),
                                   torch.full((3, 64, 64), 1000, dtype=torch.int32)])
def test_a_constant_image_outside_the_range_is_refused_by_name(image):
    with pytest.raises(TraceError, match=r"^image: .* the one value .* no min..max to rescale from"):
        vc.trace(MODEL, image, targets="top1")


def test_map_many_refuses_a_constant_out_of_range_image_before_any_pass(tmp_path):
    calls = []
    hook = MODEL.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(TraceError, match="^image"):
            vc.map_many(MODEL, [IMAGE, np.full((64, 64, 3), -5, np.int64)], [Recipe()], tmp_path / "m.zarr",
                        progress=False)
    finally:
        hook.remove()
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_a_constant_image_inside_the_range_is_still_taken():
    tr = vc.trace(MODEL, np.full((64, 64, 3), 7, np.int64), targets="top1")
    assert int(tr["image"].values.min()) == int(tr["image"].values.max()) == 7


# -- canonical ids without prefix tokens -------------------------------------------------------------------------------
def _no_cls_trace() -> object:
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                          embed_dim=32, num_heads=2, num_classes=4, class_token=False, global_pool="avg").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InputCropWarning)  # the tiny model's crop is no part of the claim
        return vc.trace(m, IMAGE[:32, :32], targets="top1")


@pytest.mark.parametrize("weighting", ["gradcam", "gradcampp", "xgradcam"])
def test_weight_tokens_all_is_patch_without_prefix_tokens(weighting):
    tr = _no_cls_trace()
    patch, every = Recipe(weighting=weighting), Recipe(weighting=weighting, weight_tokens="all")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert vc.cam(tr, patch).values.tobytes() == vc.cam(tr, every).values.tobytes()
    assert every.resolve(tr).weight_tokens == "patch"
    assert patch.canonical_id(tr) == every.canonical_id(tr)
    # with a class token the two pool different tokens: two maps, two ids
    assert patch.canonical_id(TR) != every.canonical_id(TR)
    assert vc.cam(TR, patch).values.tobytes() != vc.cam(TR, every).values.tobytes()


# -- LOWs: recipe text -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["F1@5 tokens=patch\ntarget=prob", "F1@5\rtarget=prob", "F1@5\u2028target=prob"])
def test_recipe_text_of_two_lines_is_refused(text):
    with pytest.raises(RecipeError, match="^recipe text: one recipe is one line"):
        Recipe.parse(text)


@pytest.mark.parametrize("text", ["F1@-0", "F1@-00", "F1@0,-0"])
def test_minus_zero_is_no_layer_spelling(text):
    with pytest.raises(RecipeError, match="is block 0 .* -1 for the last"):
        Recipe.parse(text)


def test_a_trailing_newline_and_plain_layers_still_parse():
    assert Recipe.parse("F1@-1 target=prob\n") == Recipe(layer=-1, target="prob")
    assert Recipe.parse("F1@0").layer == 0 and Recipe.parse("F1@-10").layer == -10


def test_checklist_json_with_a_key_twice_is_refused():
    with pytest.raises(ArgumentError, match="key 'a' appears twice in one object"):
        Checklist.from_json('{"a": {"b": 1}, "a": {"b": 2}}')
    with pytest.raises(ArgumentError, match="key 'b' appears twice"):
        Checklist.from_json('{"a": {"b": 1, "b": 2}}')
    assert Checklist.from_json('{"a": {"b": 1}, "c": {"b": 2}}') == {"a": {"b": 1}, "c": {"b": 2}}
