"""Issue #17, silent nonsense refused: maps name the absolute blocks they used (the recipe id stays the hash
of the recipe as written), overlays check the map's trace id, gallery ``vary`` values are checked, and widget
display traits refuse values no display can show."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import traitlets
from vitcam_testing import make_model

import vitcam_nb as vc

MODEL = make_model("vit")  # 3 blocks
TR = vc.trace(MODEL, np.random.default_rng(8).integers(0, 255, (32, 32, 3), dtype=np.uint8), targets="top2")


def test_maps_name_the_absolute_blocks_while_ids_hash_the_recipe_as_written():
    last, two = vc.cam(TR, vc.Recipe(layer=-1)), vc.cam(TR, vc.Recipe(layer=2))
    np.testing.assert_array_equal(last.values, two.values)
    assert last.attrs["blocks"] == two.attrs["blocks"] == "2" and last.attrs["blocks_of"] == "3"
    assert last.attrs["recipe_id"] == vc.Recipe(layer=-1).id != two.attrs["recipe_id"]
    sub = vc.trace(MODEL, TR["image"].values, targets="top2", layers=[0, 2])
    rollout = vc.Recipe(site="F2", layer="all", layer_fusion="rollout")
    assert vc.cam(sub, rollout).attrs["blocks"] == "0,2"
    assert vc.cam(vc.trace(MODEL, TR["image"].values, targets="top2"), rollout).attrs["blocks"] == "0,1,2"


def test_an_overlay_of_another_traces_map_is_refused():
    import matplotlib

    matplotlib.use("Agg")
    other = vc.trace(MODEL, 255 - TR["image"].values, targets="top2")
    with pytest.raises(ValueError, match=r"^cam_map: computed from trace .* not from this trace"):
        vc.plot.overlay(TR, vc.cam(other, vc.Recipe()))
    vc.plot.overlay(TR, vc.cam(TR, vc.Recipe()))


@pytest.mark.parametrize("vary,match", [({"layer": [0, 0]}, r"^vary: layer repeats 0"), (None, r"^vary: expected"),
                                        ({}, r"^vary: expected"), (3, r"^vary: expected")])
def test_bad_gallery_vary_is_refused_naming_vary(vary, match):
    with pytest.raises(vc.RecipeError, match=match):
        vc.gallery(TR, vc.Recipe(), vary=vary)


def test_a_numpy_range_varies_like_a_list():
    a = vc.gallery(TR, vc.Recipe(), vary={"layer": np.arange(3)})
    b = vc.gallery(TR, vc.Recipe(), vary={"layer": [0, 1, 2]})
    np.testing.assert_array_equal(a.values, b.values)


@pytest.mark.parametrize("name,value", [("opacity", 7.5), ("opacity", float("nan")), ("opacity", -0.1),
                                        ("size", -100), ("size", 0)])
def test_explorer_display_traits_refuse_impossible_values(name, value):
    ex = vc.Explorer(TR)
    with pytest.raises(traitlets.TraitError, match=f"^{name}: expected"):
        setattr(ex, name, value)
    ex.opacity, ex.size = 1.0, 1


def test_gallery_thumbnails_refuse_a_negative_size():
    with pytest.raises(traitlets.TraitError, match=r"^thumb: expected a size of at least 1 pixel, got -5"):
        vc.Gallery(TR, vc.Recipe(), vary="layer", thumb=-5)


def test_a_prob_map_of_a_one_logit_model_says_the_softmax_is_constant():
    one = make_model("vit", num_classes=1)
    tr = vc.trace(one, TR["image"].values, targets="top1")
    with pytest.warns(vc.DegenerateMapWarning):
        m = vc.cam(tr, vc.Recipe(target="prob"))
    assert m.attrs["degenerate"].startswith("target 'prob': a softmax over one score is constant")
    assert not m.values.any()


def test_the_demo_command_names_a_non_image_and_an_out_path_that_is_a_file(tmp_path, capsys):
    from vitcam_nb.cli import main

    bad = tmp_path / "notimg.png"
    bad.write_text("hello")
    assert main(["demo", "--image", str(bad), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitcam-nb demo: image: ") and "could not be read as an image" in err
    out_file = tmp_path / "out.txt"
    out_file.write_text("mine")
    assert main(["demo", "--out", str(out_file), "--quiet"]) == 2
    assert "out: " in capsys.readouterr().err and out_file.read_text() == "mine"


def test_gallery_and_compare_on_a_store_point_to_image_trace_and_the_explorer(tmp_path):
    store = vc.open_traces(vc.trace_many(MODEL, [TR["image"].values], tmp_path / "s.zarr", targets="top1",
                                         progress=False))
    for make in (lambda: vc.Gallery(store, vc.Recipe(), vary="layer"),
                 lambda: vc.Compare(store, vc.Recipe(), vc.Recipe(layer=0))):
        with pytest.raises(TypeError, match=r"^trace: .* got a trace_many store; pass vitcam_nb.image_trace"):
            make()
    vc.Explorer(store)


def test_a_prob_map_of_a_saturated_softmax_says_so():
    model = make_model("vit", num_classes=3)
    with torch.no_grad():  # class 0's logit exceeds the others by ~1e3: its probability is exactly 1 in float32
        model.head.weight.zero_()
        model.head.bias.copy_(torch.tensor([1000.0, 0.0, 0.0]))
        model.head.weight[0].fill_(1e-3)  # the logit still depends on the features
    tr = vc.trace(model, TR["image"].values, targets=[0])
    z = tr["logits"].values.astype(np.float32)
    assert np.float32(1) / np.exp(z - z.max()).sum() == np.float32(1)  # saturated, by NumPy
    for target in ("prob", "logprob"):
        with pytest.warns(vc.DegenerateMapWarning):
            m = vc.cam(tr, vc.Recipe(target=target, class_=0))
        assert m.attrs["degenerate"].startswith(f"target '{target}': the softmax is saturated")
    assert not vc.cam(tr, vc.Recipe(target="logit", class_=0)).attrs.get("degenerate")
