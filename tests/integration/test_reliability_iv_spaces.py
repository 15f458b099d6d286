"""Issue 52 (Reliability IV), finding 7 and the figure LOWs: a typo in a recipe space is refused by name, with the
closest valid value, before any work (before: the combinations holding it were skipped as invalid ones and the
call went on with the rest); ``run_figure`` refuses flags and counts of the wrong type before any work.
"""

from __future__ import annotations

import pytest

import vitcam_nb as vc
from vitcam_nb.audit_figure import audit_recipes, run_figure
from vitcam_nb.compute.map_recipes import as_recipes
from vitcam_nb.core.recipe_space import check_space
from vitcam_nb.models import sample_image

MODEL = vc.load_model("shapes-vit")
IMAGES = [sample_image("shapes", i) for i in range(2)]


def _calls() -> tuple[list[int], object]:
    calls: list[int] = []
    return calls, MODEL.register_forward_pre_hook(lambda _m, args: calls.append(1))


@pytest.mark.parametrize("space, wrong, meant", [
    ({"site": ["F1", "f4"], "weighting": ["gradcam", "layercam"]}, "site 'f4'", "F4"),
    ({"site": ["F1", "F4"], "weighting": ["gradcam", "layercm"]}, "weighting 'layercm'", "layercam"),
    ({"site": ["F3"], "heads": ["max", "mean-then-relu"]}, "heads 'mean-then-relu'", "mean_then_relu"),
    ({"layr": [0, 1]}, "'layr' is not a recipe field", "layer"),
])
def test_map_many_refuses_a_typo_in_its_space_before_any_work(tmp_path, space, wrong, meant):
    path = tmp_path / "maps.zarr"
    calls, hook = _calls()
    try:
        with pytest.raises(vc.RecipeError, match=f"^recipes_or_space: {wrong}.*did you mean '{meant}'"):
            vc.map_many(MODEL, IMAGES, space, path, progress=False)
    finally:
        hook.remove()
    assert calls == [] and not path.exists() and list(tmp_path.iterdir()) == []


def test_values_of_the_field_that_no_recipe_takes_are_refused_too():
    for space, field in [({"layer": [0, "last"]}, "layer"), ({"class_": ["top1", "top0"]}, "class_"),
                         ({"heads": [-1]}, "heads"), ({"weighting": ["gscorecam"], "k": [0]}, "k")]:
        with pytest.raises(vc.RecipeError, match=f"^space: {field} "):
            check_space(space, "space")


def test_a_space_of_valid_values_still_skips_invalid_combinations():
    # heads applies to F2/F3 only: F1 x max is no recipe and is skipped, as before; every value is used somewhere
    recipes = as_recipes({"site": ["F1", "F3"], "heads": ["channels", "max"]})
    assert sorted((r.site, r.heads) for r in recipes) == [("F1", "channels"), ("F3", "channels"), ("F3", "max")]
    assert len(as_recipes({"site": ["F1", "F4"], "weighting": ["gradcam", "layercam"]})) == 4


def test_ambiguity_refuses_a_typo_in_its_space():
    tr = vc.trace(MODEL, IMAGES[0], targets="top1")
    with pytest.raises(vc.RecipeError, match="^space: site 'f4' is not a value of the field; did you mean 'F4'"):
        vc.ambiguity(tr, {"layer": -1, "target": "logit"}, space={"site": ["F1", "f4"]})


def test_the_figure_refuses_a_typo_in_its_axes_instead_of_listing_it_as_skipped(tmp_path):
    with pytest.raises(vc.RecipeError, match="^axes: site 'f4' .*did you mean 'F4'"):
        audit_recipes({"site": ["F1", "f4"], "weighting": ["gradcam"]})
    out = tmp_path / "fig"
    with pytest.raises(vc.RecipeError, match="^axes: weighting 'layercm'"):
        run_figure(out, model="shapes-vit", images=1, photo=False, axes={"weighting": ["layercm"]}, progress=False)
    assert not out.exists()


@pytest.mark.parametrize("kwargs, arg", [({"progress": "no"}, "progress"), ({"photo": "yes"}, "photo"),
                                         ({"examples": "x"}, "examples"), ({"examples": -1}, "examples"),
                                         ({"examples": True}, "examples")])
def test_run_figure_refuses_flags_and_counts_of_the_wrong_type_before_any_work(tmp_path, kwargs, arg):
    out = tmp_path / "fig"
    calls, hook = _calls()
    try:
        with pytest.raises(vc.VitcamError, match=f"^{arg}: "):
            run_figure(out, model="shapes-vit", images=1, **{"photo": False, **kwargs})
    finally:
        hook.remove()
    assert calls == [] and not out.exists()
