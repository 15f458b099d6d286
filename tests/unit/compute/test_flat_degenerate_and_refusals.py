"""``vc.cam`` on hand-made traces (issue #3) where there is no map to give: degenerate variants (zero
gradients, a map the ReLU empties) give zeros and a DegenerateMapWarning, and bad traces and recipes are
refused naming the field, never with an IndexError or KeyError."""

from __future__ import annotations

import numpy as np
import pytest
from cam_reference import SEED, P, close, handmade, minmax, ref_raw, relu
from cam_reference import cam_warns as _cam_warns

import vitcam_nb as vc

# --------------------------------------------------------------------------------------------------
# Degenerate variants


@pytest.mark.parametrize("fields", [
    {"site": "F3", "layer": 1}, {"site": "F3", "layer": 1, "weighting": "layercam"},
    {"site": "F3", "layer": 1, "weighting": "eigengradcam"}, {"site": "F3", "layer": 1, "heads": "max"},
    {"site": "F2", "layer": 1, "attn_rows": "patch_mean"},
])
def test_zero_gradient_is_degenerate(fields):
    tr = handmade(SEED, zero_patch_grad=(1, fields["site"]))
    for normalize in ("minmax", "max", "none"):
        m, ws = _cam_warns(tr, vc.Recipe(normalize=normalize, **fields))
        assert ws, "a DegenerateMapWarning is expected"
        assert m.attrs["degenerate"] and "zero" in m.attrs["degenerate"]
        assert np.all(np.isfinite(m.values)) and np.all(m.values == 0)


def test_zero_patch_gradient_but_cls_weights_is_fine():
    tr = handmade(SEED, zero_patch_grad=(1, "F3"))
    m, ws = _cam_warns(tr, vc.Recipe(site="F3", layer=1, weight_tokens="cls"))
    assert not ws and m.attrs["degenerate"] == "" and m.values.max() == 1
    m, ws = _cam_warns(tr, vc.Recipe(site="F3", layer=1, weighting="eigencam"))  # gradient-free
    assert not ws and m.attrs["degenerate"] == ""
    m, ws = _cam_warns(handmade(SEED, zero_patch_grad=(1, "F2")), vc.Recipe(site="F2", layer=1))  # CLS row is fine
    assert not ws and m.attrs["degenerate"] == ""


def test_constant_map_after_relu_is_degenerate(hm):
    # flip the sign of layer 1's activations where the hirescam map is positive -> all <= 0 -> ReLU kills it
    tr = hm.copy(deep=True)
    act = tr["act"].values
    act[1, 0] = -np.abs(act[1, 0])
    grad = tr["grad"].values
    grad[:, 1, 0] = np.abs(grad[:, 1, 0])
    tr = tr.assign(act=(tr["act"].dims, act), grad=(tr["grad"].dims, grad))
    m, ws = _cam_warns(tr, vc.Recipe(weighting="hirescam", layer=1))
    assert ws and m.attrs["degenerate"] and np.all(m.values == 0)
    m, ws = _cam_warns(tr, vc.Recipe(weighting="hirescam", layer=1, relu="none"))   # the signed map is fine
    assert not ws and m.values.max() == 1


def test_fusion_with_one_degenerate_layer(arr):
    tr = handmade(SEED, zero_patch_grad=(1, "F1"))
    m, ws = _cam_warns(tr, vc.Recipe(weighting="hirescam", layer="all", layer_fusion="mean"))
    assert not ws and m.attrs["degenerate"] == ""
    assert "layer 1" in m.attrs["degenerate_layers"]
    want = minmax(relu(ref_raw(arr, layer=0, weighting="hirescam")))   # layer 1 contributes zeros
    close(vc.cam(tr, vc.Recipe(weighting="hirescam", layer="all", layer_fusion="mean"), grid=True).values, want)


def test_all_layers_degenerate_fusion():
    tr = handmade(SEED, zero_patch_grad=(1, "F1"))
    grad = tr["grad"].values.copy()
    grad[:, :, 0, 1:] = 0
    tr = tr.assign(grad=(tr["grad"].dims, grad))
    m, ws = _cam_warns(tr, vc.Recipe(weighting="hirescam", layer="all", layer_fusion="sum"))
    assert ws and m.attrs["degenerate"] and np.all(m.values == 0)


# --------------------------------------------------------------------------------------------------
# Refusals: the field is named, never IndexError / KeyError


def test_bad_trace_inputs(hm):
    with pytest.raises(TypeError, match="trace"):
        vc.cam({"act": 1}, vc.Recipe())
    with pytest.raises(TypeError, match="recipe"):
        vc.cam(hm, "F1")
    with pytest.raises(TypeError, match="grid"):
        vc.cam(hm, vc.Recipe(), grid="yes")
    with pytest.raises(ValueError, match="schema_version"):
        vc.cam(hm.assign_attrs(schema_version=2), vc.Recipe())
    no_version = hm.copy()
    del no_version.attrs["schema_version"]
    with pytest.raises(ValueError, match="schema_version"):
        vc.cam(no_version, vc.Recipe())


@pytest.mark.parametrize("fields, field", [
    ({"layer": 2}, "layer"), ({"layer": -3}, "layer"), ({"layer": (0, 5), "layer_fusion": "mean"}, "layer"),
    ({"site": "F4"}, "site"), ({"site": "resid_pre"}, "site"),
    ({"site": "F3", "heads": 2}, "heads"), ({"site": "F2", "heads": 5}, "heads"),
    ({"class_": 2}, "class_"), ({"class_": 99}, "class_"), ({"class_": "top9"}, "class_"),
])
def test_bad_recipe_for_this_trace(hm, fields, field):
    with pytest.raises(vc.RecipeError) as e:
        vc.cam(hm, vc.Recipe(**fields))
    assert str(e.value).startswith(field)


def test_layer_not_traced():
    tr = handmade(SEED).isel(layer=[1])
    vc.cam(tr, vc.Recipe(layer=-1))
    with pytest.raises(vc.RecipeError, match="layer.*not traced"):
        vc.cam(tr, vc.Recipe(layer=0))


def test_site_not_traced(hm):
    tr = hm.drop_vars(["attn", "attn_grad"])
    with pytest.raises(vc.RecipeError, match="^site"):
        vc.cam(tr, vc.Recipe(site="F2"))
    with pytest.raises(vc.RecipeError, match="^site"):
        vc.cam(tr, vc.presets.attention_rollout())
    tr = hm.drop_vars(["act", "grad"]).drop_dims(["site", "channel"])
    vc.cam(tr, vc.Recipe(site="F2"))
    with pytest.raises(vc.RecipeError, match="^site"):
        vc.cam(tr, vc.Recipe(site="F1"))


def test_keyword_fields_and_unknown_field(hm):
    a = vc.cam(hm, site="F3", weighting="layercam")
    b = vc.cam(hm, vc.Recipe(site="F3", weighting="layercam"))
    np.testing.assert_array_equal(a.values, b.values)
    c = vc.cam(hm, vc.Recipe(), site="F3", weighting="layercam")
    np.testing.assert_array_equal(a.values, c.values)
    with pytest.raises((TypeError, ValueError), match="colour"):
        vc.cam(hm, colour="red")
    with pytest.raises((TypeError, ValueError), match="colour"):
        vc.cam(hm, vc.Recipe(), colour="red")


def test_attn_rows_cls_without_cls_token(hm):
    tr = hm.assign_coords(token_kind=("token", np.array(["reg"] + ["patch"] * P)))
    tr = tr.assign_coords(query_kind=("query", tr.token_kind.values), key_kind=("key", tr.token_kind.values))
    with pytest.raises(vc.RecipeError, match="^attn_rows"):
        vc.cam(tr, vc.Recipe(site="F2"))
    with pytest.raises(vc.RecipeError, match="^weight_tokens"):
        vc.cam(tr, vc.Recipe(weight_tokens="cls"))
    vc.cam(tr, vc.Recipe(site="F2", attn_rows="patch_mean"))
