"""vc.plot.views on the map shapes of VLMs whose image reaches the model in pieces (issue 55): a tiny LLaVA-NeXT
trace (5 crops: base + 2x2 tiles) and a tiny Idefics3 trace (4 tiles + global view), random weights built in code.
Each panel is checked against the values it must show: crop k's map over crop k's own pixels, titled with its tile
name; a view map on the original image only when one is known (else drawn alone, and the figure says so); NaN cells
masked; overlay() refuses a several-panel map by name and draws one selected crop on that crop's pixels."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import xarray as xr  # noqa: E402

import vitcam_nb as vc  # noqa: E402

pytest.importorskip("transformers")

from anyres_cases import SIZE, make, pixels, target  # noqa: E402

from vitcam_nb.compute.vlm_crops import stitch_crops  # noqa: E402

TILES = ["base", "tile_r0_c0", "tile_r0_c1", "tile_r1_c0", "tile_r1_c1"]


@pytest.fixture(scope="module")
def trace():
    return vc.trace(make("next"), pixels(), targets=target("next"), sites=["F1", "lm_resid"])


@pytest.fixture(autouse=True)
def _close():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def panels(fig) -> list:
    """The figure's panels: every axes but the colour bar's (the last one added)."""
    return fig.axes[:-1]


def test_crop_map_is_one_panel_per_crop_on_its_own_pixels(trace):
    m = vc.cam(trace, vc.Recipe(site="F1", layer=0, class_=1))
    fig = vc.plot.views(trace, m)
    axes = panels(fig)
    assert [ax.get_title() for ax in axes] == [f"crop {k}: {t}" for k, t in enumerate(TILES)]
    for k, ax in enumerate(axes):
        under, drawn = ax.get_images()
        np.testing.assert_array_equal(under.get_array(), trace["image"].values[k])
        np.testing.assert_array_equal(np.asarray(drawn.get_array()), m.values[k])
    assert fig.axes[-1].get_ylabel() == "map value (each crop min-max on its own)"
    assert "answer token" in fig._suptitle.get_text()


def test_view_map_is_drawn_alone_without_the_original_image(trace):
    m = vc.cam(trace, vc.Recipe(site="lm_resid", layer=-1, class_=0))
    assert m.dims == ("view", "y", "x")
    fig = vc.plot.views(trace, m)
    axes = panels(fig)
    assert [ax.get_title() for ax in axes] == ["view: base", "view: tiles"]
    for k, ax in enumerate(axes):
        (drawn,) = ax.get_images()  # no image under it: the trace holds only the crops
        np.testing.assert_array_equal(np.asarray(drawn.get_array()), m.values[k])
    assert "not the original image" in fig._suptitle.get_text()


def test_view_map_over_a_given_original_image(trace):
    m = vc.cam(trace, vc.Recipe(site="lm_resid", layer=-1, class_=0))
    original = np.random.default_rng(0).integers(0, 255, (*SIZE, 3), dtype=np.uint8)
    fig = vc.plot.views(trace, m, image=original)
    for ax in panels(fig):
        under, drawn = ax.get_images()
        np.testing.assert_array_equal(under.get_array(), original)
        # the map (32x32 cells here) spans the original image's 60x70 pixels
        assert drawn.get_extent() == [-0.5, SIZE[1] - 0.5, SIZE[0] - 0.5, -0.5]
    assert "not the original image" not in fig._suptitle.get_text()
    with pytest.raises(vc.ArgumentError, match="image"):
        vc.plot.views(trace, m, image=np.zeros(5))


def test_stitched_crops_are_one_panel_per_group(trace):
    m = vc.cam(trace, vc.Recipe(site="F1", layer=0, class_=1))
    stitched = stitch_crops(m)
    fig = vc.plot.views(trace, stitched)
    axes = panels(fig)
    assert [ax.get_title() for ax in axes] == ["view: base", "view: tiles"]
    for ax, group in zip(axes, ("base", "tiles"), strict=True):
        (drawn,) = ax.get_images()
        np.testing.assert_array_equal(np.asarray(drawn.get_array()), stitched[group].values)
        assert drawn.get_extent() == [-0.5, SIZE[1] - 0.5, SIZE[0] - 0.5, -0.5]
    assert fig.axes[-1].get_ylabel() == "map value (each crop min-max on its own)"


def test_tile_grids_mask_their_nan_cells(trace):
    m = vc.cam(trace, vc.Recipe(site="lm_resid", layer=-1, class_=0, upsample="none"))
    assert m.dims[0] == "tile" and np.isnan(m.values).any()  # unpadding cut rows off the crop grid
    fig = vc.plot.views(trace, m)
    axes = panels(fig)
    assert axes[0].get_title() == "tile base (base)"
    for k, ax in enumerate(axes):
        (drawn,) = ax.get_images()
        arr = drawn.get_array()
        np.testing.assert_array_equal(np.ma.getmaskarray(arr), np.isnan(m.values[k]))
        assert drawn.get_cmap().get_bad().tolist() == [0.85, 0.85, 0.85, 1.0]
    assert "grey: no token covers these cells" in fig._suptitle.get_text()


def test_overlay_refuses_several_panels_by_name_and_draws_one_crop(trace):
    m = vc.cam(trace, vc.Recipe(site="F1", layer=0, class_=1))
    with pytest.raises(vc.ArgumentError, match=r"vc\.plot\.views"):
        vc.plot.overlay(trace, m)
    with pytest.raises(vc.ArgumentError, match=r"vc\.plot\.views"):
        vc.plot.overlay(trace, stitch_crops(m)["tiles"])  # no one image under a stitched map of a crops trace
    fig = vc.plot.overlay(trace, m.isel(crop=2))
    under, drawn = fig.axes[0].get_images()
    np.testing.assert_array_equal(under.get_array(), trace["image"].values[2])
    np.testing.assert_array_equal(np.asarray(drawn.get_array()), m.values[2])


def test_views_refuses_what_it_cannot_draw(trace):
    m = vc.cam(trace, vc.Recipe(site="F1", layer=0, class_=1))
    with pytest.raises(vc.ArgumentError, match="overlay"):
        vc.plot.views(trace, m.isel(crop=0))
    with pytest.raises(vc.ArgumentError, match="crop dim"):
        vc.plot.views(trace.isel(crop=0), m)
    with pytest.raises(vc.ArgumentTypeError, match="cam_map"):
        vc.plot.views(trace, m.values)
    other = m.copy()
    other.attrs["trace_id"] = "f" * 40
    with pytest.raises(vc.ArgumentError, match="not from this trace"):
        vc.plot.views(trace, other)
    with pytest.raises(vc.ArgumentError, match="differ in size"):
        vc.plot.views(trace, {"a": xr.DataArray(np.zeros((2, 2))), "b": xr.DataArray(np.zeros((3, 2)))})


def test_idefics3_views_without_a_stated_size_keep_the_maps_own_pixels():
    from test_vlm_idefics import ANSWER, PROMPT, make_x
    from test_vlm_idefics import make as make_idefics

    tr = vc.trace(make_idefics("idefics3"), make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                  sites=["F1", "lm_resid"])
    m = vc.cam(tr, vc.Recipe(site="lm_resid", layer=-1, class_=0))
    fig = vc.plot.views(tr, m)
    names = [str(v) for v in m["view"].values]
    assert [ax.get_title() for ax in panels(fig)] == [f"view: {n}" for n in names]
    h, w = m.shape[1:]
    for k, ax in enumerate(panels(fig)):
        (drawn,) = ax.get_images()
        np.testing.assert_array_equal(np.asarray(drawn.get_array()), m.values[k])
        assert drawn.get_extent() == [-0.5, w - 0.5, h - 0.5, -0.5]
    crops = vc.cam(tr, vc.Recipe(site="F1", layer=0, class_=0))
    fig = vc.plot.views(tr, crops)
    tiles = [str(t) for t in tr["crop_tile"].values]
    assert [ax.get_title() for ax in panels(fig)] == [f"crop {k}: {t}" for k, t in enumerate(tiles)]
