"""A misspelt word in a recipe line names the word that was meant (difflib), as key=value."""

from __future__ import annotations

import difflib

import pytest

import vitcam_nb as vc
from vitcam_nb.core.recipe import weighting_names


def test_a_misspelt_bare_weighting_is_answered_with_did_you_mean_gradcam():
    with pytest.raises(vc.RecipeError) as caught:
        vc.Recipe.parse("F1@3 logit gradkam")
    text = str(caught.value)
    assert "cannot read 'gradkam' (did you mean weighting=gradcam or " in text  # gradcam first among equals
    # every name offered is one difflib itself finds close, and each is a weighting
    offered = text.split("(did you mean ")[1].split("?)")[0].split(" or ")
    close = difflib.get_close_matches("gradkam", weighting_names(), n=3, cutoff=0.75)
    assert sorted(offered) == sorted(f"weighting={w}" for w in close)
    assert vc.Recipe.parse("F1@3 logit " + offered[0].split("=")[1]) == vc.Recipe(site="F1", layer=3)


def test_a_misspelt_key_and_value_are_answered_and_an_unrelated_word_is_not():
    with pytest.raises(vc.RecipeError, match=r"unknown key 'wieghting' \(did you mean 'weighting'\?\)"):
        vc.Recipe.parse("F1@3 wieghting=gradcam")
    with pytest.raises(vc.RecipeError, match=r"weighting='layrcam' is not allowed \(did you mean 'layercam'\?\)"):
        vc.Recipe.parse("F1@3 weighting=layrcam")
    with pytest.raises(vc.RecipeError, match=r"cannot read 'logti' \(did you mean target=logit\?\)"):
        vc.Recipe.parse("F1@3 logti")
    with pytest.raises(vc.RecipeError) as caught:
        vc.Recipe.parse("F1@3 banana")
    assert "did you mean" not in str(caught.value)
