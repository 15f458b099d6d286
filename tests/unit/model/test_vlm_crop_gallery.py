"""vc.gallery on a trace whose tower ran on crops (issue 55): a tiny LLaVA-NeXT (base view + 2x2 crops) and a tiny
Idefics3 (2x2 tiles + global view). Each cell holds one map per crop, equal to a Grad-CAM written here with NumPy
from each crop's stored arrays and bitwise to vc.cam of the cell's recipe; vc.plot.views (and grid) draw one row per
cell, one panel per crop over that crop's own pixels, titled in words, NaN masked, with a colour bar; the arrays
drawn are the gallery's."""

from __future__ import annotations

import warnings

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import vitcam_nb as vc  # noqa: E402

pytest.importorskip("transformers")

import test_vlm_idefics as idefics  # noqa: E402
from anyres_cases import make, pixels, target  # noqa: E402

TILES = ["base", "tile_r0_c0", "tile_r0_c1", "tile_r1_c0", "tile_r1_c1"]


def minmax(v):
    span = v.max() - v.min()
    return (v - v.min()) / span if span > 0 else np.zeros_like(v)


def crop_gradcam(one, site, layer, k):
    """Grad-CAM on crop ``one``'s patch grid (min-max on the crop), weights from the patch tokens' gradients."""
    patch = one["token_kind"].values == "patch"
    A = one["act"].sel(site=site, layer=layer).values[patch]
    G = one["grad"].sel(site=site, layer=layer).values[k][patch]
    cells = np.zeros((one["patch_row"].values[patch].max() + 1, one["patch_col"].values[patch].max() + 1))
    cells[one["patch_row"].values[patch], one["patch_col"].values[patch]] = minmax(np.maximum(A @ G.mean(0), 0))
    return cells


@pytest.fixture(scope="module")
def next_trace():
    return vc.trace(make("next"), pixels(), targets=target("next"), sites=["F1", "F4", "lm_resid"])


@pytest.fixture(scope="module")
def idefics_trace():
    return vc.trace(idefics.make("idefics3"), idefics.make_x(), sites=["F1", "F4"],
                    targets=vc.targets.answer(input_ids=idefics.PROMPT, answer_ids=idefics.ANSWER))


@pytest.fixture(autouse=True)
def _close():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


@pytest.mark.parametrize("which", ["next", "idefics"])
def test_each_cell_is_one_gradcam_per_crop(which, next_trace, idefics_trace):
    tr = next_trace if which == "next" else idefics_trace
    base = vc.Recipe(site="F1", class_=1, upsample="none")
    warnings.simplefilter("ignore", vc.DegenerateMapWarning)  # pytest restores the filters after the test
    g = vc.gallery(tr, base, vary={"layer": "all", "site": ["F1", "F4"]})
    layers = [int(v) for v in g["layer"].values]
    assert g.dims == ("layer", "site", "crop", "patch_row", "patch_col") and g.sizes["crop"] == tr.sizes["crop"]
    for i, layer in enumerate(layers):
        for j, site in enumerate(["F1", "F4"]):
            for c in range(tr.sizes["crop"]):
                ref = crop_gradcam(tr.isel(crop=c), site, layer, 1)
                np.testing.assert_allclose(g.values[i, j, c], ref, atol=1e-5, err_msg=f"{site} {layer} crop {c}")
            rec = base.replace(site=site, layer=layer)
            m = vc.cam(tr, rec)
            np.testing.assert_array_equal(g.values[i, j], m.values)
            assert g["recipe_id"].values[i, j] == m.attrs["recipe_id"]
            np.testing.assert_array_equal(g["crop_degenerate"].values[i, j], m["crop_degenerate"].values)
    np.testing.assert_array_equal(g["crop_tile"].values, tr["crop_tile"].values)
    assert "crops" in g.attrs["checklist"] and g.attrs["vary"] == "layer,site"


def test_a_layer_the_lm_never_reads_is_one_warning_and_says_so_per_crop(next_trace):
    with pytest.warns(vc.DegenerateMapWarning, match="5 of 15 crop maps in the gallery are degenerate"):
        g = vc.gallery(next_trace, vc.Recipe(site="F1", class_=0), vary={"layer": "all"})
    assert [bool(r) for r in g["crop_degenerate"].values[2]] == [True] * 5  # block 2: above vision_feature_layer
    assert not g.values[2].any() and g.values[:2].any()


def test_lm_sites_are_refused_by_name(next_trace):
    with pytest.raises(vc.RecipeError, match="site 'lm_resid' is a language-model site with no crop dim"):
        vc.gallery(next_trace, vc.Recipe(site="F1"), vary={"site": ["F1", "lm_resid"]})


def test_views_draws_the_gallery_one_row_per_cell_one_panel_per_crop(next_trace):
    g = vc.gallery(next_trace, vc.Recipe(site="F1", class_=2), vary={"layer": [0, 1]})
    g.values[1, 3, :4, :] = np.nan  # cells no token covers: masked, never drawn as a value
    fig = vc.plot.views(next_trace, g)
    axes = fig.axes[:-1]
    assert len(axes) == 2 * 5
    assert [ax.get_title() for ax in axes[:5]] == [f"crop {k}: {t}" for k, t in enumerate(TILES)]
    assert [axes[5 * r].get_ylabel() for r in range(2)] == ["block 0", "block 1"]
    for r in range(2):
        for k in range(5):
            under, drawn = axes[5 * r + k].get_images()
            np.testing.assert_array_equal(under.get_array(), next_trace["image"].values[k])
            arr = drawn.get_array()
            np.testing.assert_array_equal(np.ma.getmaskarray(arr), np.isnan(g.values[r, k]))
            np.testing.assert_array_equal(arr.filled(-1), np.where(np.isnan(g.values[r, k]), -1, g.values[r, k]))
    assert fig.axes[-1].get_ylabel() == "map value (each crop min-max on its own)"
    text = fig._suptitle.get_text()
    assert "varied: layer" in text and "blank: no token covers these cells" in text


def test_grid_hands_a_crops_gallery_to_views(next_trace):
    g = vc.gallery(next_trace, vc.Recipe(site="F1", class_=0), vary={"layer": [0]})
    fig = vc.plot.grid(next_trace, g)
    assert len(fig.axes) == 5 + 1
    with pytest.raises(vc.ArgumentError, match="mask: a gallery of crop maps"):
        vc.plot.grid(next_trace, g, mask=np.ones((60, 70), bool))
