"""vc.gallery at the LM-side sites of generative VLM answers (issue 55): on a tiny LLaVA (one grid) each cell is a
(y, x) map; on a tiny LLaVA-NeXT (base view + 2x2 crops) each cell keeps one map per view (base, tiles), never
averaged. Each cell equals a Grad-CAM written here with NumPy from the trace's stored arrays (all image tokens as one
set, each tile's cells placed by nearest cell in its box) and bitwise vc.cam of the cell's recipe; vc.plot.views
draws a view gallery one row per cell, one panel per view, the arrays drawn being the gallery's."""

from __future__ import annotations

import warnings

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import vitcam_nb as vc  # noqa: E402

pytest.importorskip("transformers")

from anyres_cases import make, pixels, target  # noqa: E402
from test_vlm_llava import ANSWER, GRID, PROMPT, make_llava, make_x  # noqa: E402
from vlm_reference import gradcam, lm_views  # noqa: E402


def views_reference(tr, layer, k, size=(32, 32)):
    return lm_views(tr, layer, k, size)


@pytest.fixture(scope="module")
def next_trace():
    return vc.trace(make("next"), pixels(), targets=target("next"), sites=["F1", "lm_resid", "lm_attn"])


@pytest.fixture(autouse=True)
def _close():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def test_a_multi_tile_gallery_keeps_one_map_per_view(next_trace):
    base = vc.Recipe(site="lm_resid", upsample="nearest")
    g = vc.gallery(next_trace, base, vary={"layer": "all", "class_": [0, 2]})
    assert g.dims == ("layer", "class_", "view", "y", "x") and list(g["view"].values) == ["base", "tiles"]
    for i, layer in enumerate(g["layer"].values):
        for j, k in enumerate(g["class_"].values):
            ref = views_reference(next_trace, int(layer), int(k))
            for v, view in enumerate(["base", "tiles"]):
                np.testing.assert_allclose(g.values[i, j, v], ref[view], atol=1e-5, err_msg=f"{layer} {k} {view}")
            m = vc.cam(next_trace, base.replace(layer=int(layer), class_=int(k)))
            np.testing.assert_array_equal(g.values[i, j], m.values)
            assert g["recipe_id"].values[i, j] == m.attrs["recipe_id"]


def test_sites_vary_over_the_lm_sites_the_trace_holds(next_trace):
    g = vc.gallery(next_trace, vc.Recipe(site="lm_resid", class_=1, layer=1), vary={"site": "all"})
    assert list(g["site"].values) == ["lm_resid", "lm_attn"]
    for s, site in enumerate(g["site"].values):
        np.testing.assert_array_equal(g.values[s], vc.cam(next_trace, vc.Recipe(site=site, class_=1, layer=1)).values)
    with pytest.raises(vc.RecipeError, match="site 'F1' is a tower site"):
        vc.gallery(next_trace, vc.Recipe(site="lm_resid"), vary={"site": ["lm_resid", "F1"]})
    with pytest.raises(vc.RecipeError, match="not a valid recipe"):
        vc.gallery(next_trace, vc.Recipe(site="lm_resid"), vary={"layer": [0, 5]})


def test_one_grid_gallery_is_y_x_per_cell_and_drawn_by_grid():
    tr = vc.trace(make_llava(), make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                  sites=["lm_resid"])
    base = vc.Recipe(site="lm_resid", class_=0, upsample="none")
    g = vc.gallery(tr, base, vary={"layer": "all"})
    assert g.dims == ("layer", "patch_row", "patch_col")
    for layer in (0, 1):
        ref = gradcam(tr["lm_resid"].values[layer], tr["lm_resid_grad"].values[0, layer]).reshape(GRID, GRID)
        np.testing.assert_allclose(g.values[layer], ref, atol=1e-5)
    fig = vc.plot.grid(tr, vc.gallery(tr, base.replace(upsample="bilinear"), vary={"layer": "all"}))
    assert len(fig.axes) == 3 + 1  # the input, two layers, the colour bar


def test_views_draws_a_view_gallery_alone_and_says_so(next_trace):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        g = vc.gallery(next_trace, vc.Recipe(site="lm_resid", class_=0), vary={"layer": [0, 1]})
    g.values[0, 1, :3, :] = np.nan
    fig = vc.plot.views(next_trace, g)
    axes = fig.axes[:-1]
    assert [ax.get_title() for ax in axes[:2]] == ["view: base", "view: tiles"]
    assert [axes[2 * r].get_ylabel() for r in range(2)] == ["block 0", "block 1"]
    for r in range(2):
        for v in range(2):
            (drawn,) = axes[2 * r + v].get_images()  # no image under: the trace stores only the crops
            arr = drawn.get_array()
            np.testing.assert_array_equal(np.ma.getmaskarray(arr), np.isnan(g.values[r, v]))
            np.testing.assert_array_equal(arr.filled(-1), np.where(np.isnan(g.values[r, v]), -1, g.values[r, v]))
    text = fig._suptitle.get_text()
    assert "one panel per view drawn alone" in text and "grey: no token covers these cells" in text
    original = np.zeros((60, 70, 3), np.uint8)
    fig = vc.plot.views(next_trace, g, image=original)
    under, _ = fig.axes[0].get_images()
    np.testing.assert_array_equal(under.get_array(), original)
    assert under.get_extent() == [-0.5, 69.5, 59.5, -0.5]


def test_a_tile_gallery_draws_each_tile_on_its_token_grid(next_trace):
    base = vc.Recipe(site="lm_resid", class_=2, upsample="none")
    g = vc.gallery(next_trace, base, vary={"layer": [0, 1]})
    assert g.dims == ("layer", "tile", "patch_row", "patch_col") and g.sizes["tile"] == 5
    np.testing.assert_array_equal(g.values[1], vc.cam(next_trace, base.replace(layer=1)).values)
    fig = vc.plot.views(next_trace, g)
    assert fig.axes[0].get_title() == "tile base (base)" and fig.axes[1].get_title() == "tile tile_r0_c0 (tiles)"
    np.testing.assert_array_equal(fig.axes[6].get_images()[0].get_array().filled(-1),
                                  np.where(np.isnan(g.values[1, 1]), -1, g.values[1, 1]))
