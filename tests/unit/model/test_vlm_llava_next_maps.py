"""Tower maps of LLaVA-NeXT / LLaVA-OneVision traces (issue 55): one map per crop, each equal to a hand-written
per-crop Grad-CAM and to the single-image form on that crop; the tower layer LLaVA never reads gives the
zero-gradient verdict on every crop; the stitching onto the original image, with known values and against the
family's own image processor (where each crop's pixels come from)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import xarray as xr
from vitcam_testing import assert_rel_close

import vitcam_nb as vc

pytest.importorskip("transformers")

from anyres_cases import PINPOINTS, SIZE, TOWER, build, target  # noqa: E402

from vitcam_nb.compute.vlm_crops import stitch_crops  # noqa: E402


@pytest.fixture(scope="module", params=["next", "onevision"])
def case(request):
    return build(request.param, TOWER[:2] + ("F6", "lm_resid"))


def gradcam(A: np.ndarray, G: np.ndarray) -> np.ndarray:
    """Selvaraju et al.: alpha_k = mean_t G[t, k]; relu(sum_k alpha_k A[t, k]) on the 4x4 raster; min-max."""
    m = np.maximum(A @ G.mean(axis=0), 0).reshape(4, 4)
    return (m - m.min()) / (m.max() - m.min())


@pytest.mark.parametrize("token", [0, 2])
def test_gradcam_per_crop_equals_reference(case, token):
    first = 1 if case.kind == "next" else 0  # CLIP's class token; SigLIP has none
    m = vc.cam(case.trace, vc.Recipe(site="F1", layer=1, class_=token, upsample="none"))
    assert m.dims == ("crop", "patch_row", "patch_col") and m.attrs["degenerate"] == ""
    assert m["crop_tile"].values.tolist()[0] == "base"
    A, G = case.acts[(1, "F1")], case.grads[(1, "F1")][token]
    for k in range(5):
        assert_rel_close(m.values[k], gradcam(A[k, first:], G[k, first:]), f"{case.kind} crop {k} token {token}")


@pytest.mark.parametrize("recipe", [vc.Recipe(site="F1", layer=0, class_=1),
                                    vc.Recipe(site="F2", layer=(0, 1), class_=3, weighting="layercam",
                                              heads="mean_then_relu", layer_fusion="mean", attn_rows="mean"),
                                    vc.Recipe(site="F6", layer=-2, class_=3, target="logprob", relu="none")])
def test_each_crop_is_the_single_image_form_on_that_crop(case, recipe):
    m = vc.cam(case.trace, recipe)
    assert m.dims == ("crop", "y", "x")
    for k in range(5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", vc.DegenerateMapWarning)
            one = vc.cam(case.trace.isel(crop=k), recipe)
        np.testing.assert_array_equal(m.values[k], one.values, err_msg=f"crop {k}")
        assert m["crop_degenerate"].values[k] == one.attrs["degenerate"]


def test_unread_tower_layer_gives_the_zero_gradient_verdict_on_every_crop():
    tr = build("next", ("F1", "F6")).trace  # vision_feature_layer=-2: layer 2 is never read
    assert tr.attrs["tower_layers_unused"] == "2"
    with pytest.warns(vc.DegenerateMapWarning, match="zero gradient"):
        m = vc.cam(tr, vc.Recipe(site="F1", layer=-1, class_=0))
    assert m.attrs["degenerate_cause"] == "zero gradient" and not np.any(m.values)
    assert all("zero" in r for r in m["crop_degenerate"].values)
    assert all(f"crop {k} ({t})" in m.attrs["degenerate"] for k, t in enumerate(m["crop_tile"].values))


def test_checklist_states_the_layout_and_the_crops(case):
    m = vc.cam(case.trace, vc.Recipe(site="F1", layer=1, class_=0))
    c = json.loads(m.attrs["checklist"])
    assert "any-res: base 4x4 + 2x2 tiles of 4x4, unpadded to 6x8" in c["token handling"]["image-token layout"]
    crops = c["spatial reconstruction"]["crops"]
    assert "the tower ran on 5 crops of one image, in this order: 0 base, 1 tile_r0_c0" in crops
    assert "never averaged" in crops
    assert vc.Recipe(site="F1", layer=1).checklist(case.trace)["spatial reconstruction"]["crops"] == crops


def test_lm_sites_are_not_the_crops_form(case):
    from vitcam_nb.core.kinds import form_for

    assert form_for(case.trace, vc.Recipe(site="lm_resid")).name == "vlm"
    assert form_for(case.trace, vc.Recipe(site="F1")).name == "vlm_crops"


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_saved_trace_gives_the_same_crop_maps(case, tmp_path, suffix):
    back = vc.load(vc.save(case.trace, tmp_path / f"anyres{suffix}"))
    r = vc.Recipe(site="F1", layer=1, class_=0)
    a, b = vc.cam(case.trace, r), vc.cam(back, r)
    np.testing.assert_array_equal(b.values, a.values)
    assert b.attrs["checklist"] == a.attrs["checklist"]
    assert back["crop_tile"].values.tolist() == case.trace["crop_tile"].values.tolist()


# --------------------------------------------------------------------------------------------------
# stitching


def test_stitch_with_known_values(case):
    """Cell (r, c) of crop k holds 100 k + 4 r + c. The processor resizes the 60x70 image to 55x64 (the short side
    rounded up) and pads it 4 px on top (5 below) in the 64x64 canvas of 2x2 crops of 32 px, 4x4 cells of 8 px:
    image row y's centre lies at canvas row 4 + (y + 0.5) * 55 / 60, column x's at (x + 0.5) * 64 / 70. So image
    row 0 lies in cell row 0 of the top crops (canvas 4.46), row 59 in cell row 3 of the bottom ones (canvas
    58.5), rows 0..30 in the top crops (canvas < 32), columns 0..34 in the left ones; every cell of every crop
    holds some image pixel. The base view covers the whole image."""
    m = vc.cam(case.trace, vc.Recipe(site="F1", layer=1, class_=0, upsample="none"))
    k, r, c = np.meshgrid(np.arange(5), np.arange(4), np.arange(4), indexing="ij")
    known = m.copy(data=(100 * k + 4 * r + c).astype(np.float32))
    out = stitch_crops(known)
    assert sorted(out) == ["base", "tiles"] and out["tiles"].shape == SIZE
    tiles, base = out["tiles"].values, out["base"].values
    assert tiles[0, 0] == 100 * 1 + 4 * 0 + 0 and tiles[59, 69] == 100 * 4 + 4 * 3 + 3
    assert tiles[0, 69] == 100 * 2 + 4 * 0 + 3 and tiles[59, 0] == 100 * 3 + 4 * 3 + 0
    crop = tiles // 100
    np.testing.assert_array_equal(crop[:31, :35], 1)
    np.testing.assert_array_equal(crop[:31, 35:], 2)
    np.testing.assert_array_equal(crop[31:, :35], 3)
    np.testing.assert_array_equal(crop[31:, 35:], 4)
    canvas_row = 4 + (np.arange(60) + 0.5) * 55 / 60
    canvas_col = (np.arange(70) + 0.5) * 64 / 70
    want = (100 * (1 + 2 * (canvas_row[:, None] >= 32) + (canvas_col[None, :] >= 32))
            + 4 * ((canvas_row[:, None] % 32) // 8) + (canvas_col[None, :] % 32) // 8)
    np.testing.assert_array_equal(tiles, want)
    assert {int(v) for v in np.unique(tiles)} == {100 * k + 4 * r + c for k in range(1, 5) for r in range(4)
                                                   for c in range(4)}
    # the base view: 4 cell rows over 60 px (15 each), 4 columns over 70 (17.5 each; a pixel takes the cell
    # holding its centre x + 0.5)
    np.testing.assert_array_equal(base[::15, 0], [0, 4, 8, 12])
    np.testing.assert_array_equal(base[0, [0, 16, 17, 34, 35, 51, 52, 69]], [0, 0, 1, 1, 2, 2, 3, 3])
    assert out["tiles"].attrs["stitched_crops"] == "1,2,3,4" and out["base"].attrs["tile_group"] == "base"


def test_stitch_puts_each_crops_pixels_back_where_the_processor_took_them():
    """The family's own image processor cuts a 60x70 image whose red channel is the column fraction and green
    the row fraction; each crop's pixels, stitched back by the crop boxes, give those fractions again, to within
    the processor's resampling (a pixel) and the model's unpadding (half a cell of 8 canvas px vertically)."""
    from transformers import LlavaNextImageProcessor

    proc = LlavaNextImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                   image_grid_pinpoints=PINPOINTS, do_normalize=False)
    h, w = SIZE
    yy, xx = np.meshgrid(np.arange(h) / (h - 1), np.arange(w) / (w - 1), indexing="ij")
    img = np.round(np.stack([xx, yy, np.zeros_like(xx)], -1) * 255).astype(np.uint8)
    enc = proc(images=img, return_tensors="pt")
    assert enc["image_sizes"].tolist() == [list(SIZE)]
    tr = build("next", ("F1",)).trace
    px = enc["pixel_values"][0].numpy()  # (5, 3, 32, 32), crops in the order the model runs them
    # the image fills the 64 px canvas's width: one canvas px is 70/64 image px, half a cell 4 canvas px; the base
    # view squashes 70 px into 32 (half a pixel: 35/32 image px). Measured here: 1.15 px across (base), 4.6 px
    # down (tiles); boxes ignoring the padding are off by the whole image
    for ch, want, tol in ((0, xx, (35 / 32 + 1.0) / w), (1, yy, (4 * w / 64 + 1.0) / h)):
        cam = xr.DataArray(px[:, ch], dims=("crop", "y", "x"),
                           coords={c: ("crop", tr[c].values) for c in tr.coords if c.startswith("crop_")})
        out = stitch_crops(cam, SIZE)
        for group, got in out.items():
            err = np.abs(got.values - want)
            assert not np.isnan(err).any() and err.max() <= tol, f"{group} channel {ch}: {err.max():.3f} > {tol:.3f}"


def test_stitch_refuses_what_it_cannot_place(case):
    m = vc.cam(case.trace, vc.Recipe(site="F1", layer=1, class_=0))
    with pytest.raises(vc.ArgumentTypeError, match="cam: expected the per-crop map"):
        stitch_crops(m.isel(crop=0))
    with pytest.raises(vc.ArgumentError, match="size: the map does not state the original image size"):
        stitch_crops(m.assign_attrs(crop_source_size=""))
    with pytest.raises(vc.ArgumentError, match="size: expected"):
        stitch_crops(m, (0, 5))
    with pytest.raises(vc.ArgumentError, match="cam: has no coordinates"):
        stitch_crops(m.drop_vars("crop_box_top"))


def test_float16_trace_gives_close_crop_maps(case):
    half = vc.trace(case.model, case.x, targets=target(case.kind),
                    sites=["F1"], dtype="float16")
    assert half["grad"].dtype == np.float16 and half["grad"].dims[0] == "crop"
    r = vc.Recipe(site="F1", layer=1, class_=0)
    np.testing.assert_allclose(vc.cam(half, r).values, vc.cam(case.trace, r).values, atol=2e-2)
