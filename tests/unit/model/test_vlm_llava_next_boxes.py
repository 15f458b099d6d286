"""The tower crops' boxes of LLaVA-NeXT and LLaVA-OneVision are exact to the pixel (issue 55): each family's own
image processor cuts a 60x70 image whose every pixel is marked with its row and column (nearest resampling, so a
crop pixel is a copy of one image pixel); each crop pixel's centre, mapped through its crop's box, lands on the
image pixel it copies (within the nearest resize's one pixel), and every padding pixel lands outside the image.
The boxes of the model's cell-rounded unpadding (still the LM layout's tiles, which say so) are off by up to 5.6 px
here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xarray as xr

pytest.importorskip("transformers")

from anyres_cases import PINPOINTS, SIZE, TILE, make, pixels, target  # noqa: E402

import vitcam_nb as vc  # noqa: E402
from vitcam_nb.adapters.vlm_layouts.anyres import anyres_crops, llava_next_layout  # noqa: E402
from vitcam_nb.compute.vlm_crops import stitch_crops  # noqa: E402

SIDES = ("top", "left", "bottom", "right")


def marked(size=SIZE) -> np.ndarray:
    """Red: row + 1, green: column + 1, blue: 200 (the processor's padding is 0 in every channel)."""
    h, w = size
    yy, xx = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([yy + 1, xx + 1, np.full_like(yy, 200)], -1).astype(np.uint8)


def processed(family: str, size=SIZE) -> np.ndarray:
    from transformers import LlavaNextImageProcessor, LlavaOnevisionImageProcessor
    from transformers.image_utils import PILImageResampling

    cls = LlavaNextImageProcessor if family == "next" else LlavaOnevisionImageProcessor
    kw = dict(crop_size={"height": TILE, "width": TILE}) if family == "next" else {}
    proc = cls(size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS, do_normalize=False,
               do_rescale=False, resample=PILImageResampling.NEAREST, **kw)
    enc = proc(images=marked(size), return_tensors="pt")
    assert enc["image_sizes"].tolist() == [list(size)]
    return np.rint(enc["pixel_values"][0].numpy()).astype(np.int64)  # (crops, 3, TILE, TILE)


@pytest.mark.parametrize("family", ["next", "onevision"])
@pytest.mark.parametrize("size", [SIZE, (70, 60), (45, 64)])
def test_every_crop_pixel_lands_where_the_processor_took_it(family, size):
    px = processed(family, size)
    tiles = anyres_crops(size, grid_pinpoints=PINPOINTS, tile_px=TILE, patch_px=8)
    assert len(tiles) == len(px) or (len(px) > len(tiles) and not px[len(tiles):].any())
    h, w = size
    centre = (np.arange(TILE) + 0.5) / TILE
    worst = 0.0
    for k, tile in enumerate(tiles[1:], start=1):
        top, left, bottom, right = tile.box
        at_row = (top + centre * (bottom - top)) * h  # image row (in pixels) of each crop row's centre
        at_col = (left + centre * (right - left)) * w
        image = px[k, 2] == 200
        rows, cols = px[k, 0] - 1, px[k, 1] - 1
        inside = ((at_row[:, None] > 0) & (at_row[:, None] < h)) & ((at_col[None, :] > 0) & (at_col[None, :] < w))
        np.testing.assert_array_equal(image, inside, err_msg=f"crop {k}: image pixels vs the box's inside")
        err_r = np.abs(np.broadcast_to(at_row[:, None], image.shape)[image] - (rows[image] + 0.5))
        err_c = np.abs(np.broadcast_to(at_col[None, :], image.shape)[image] - (cols[image] + 0.5))
        worst = max(worst, float(err_r.max()), float(err_c.max()))
    assert worst <= 1.0, f"{worst:.2f} px"


def test_the_trace_and_stitch_use_the_exact_boxes():
    """The trace's crop_box_* coordinates are these boxes; stitching the processor's crops back by them gives every
    image pixel's own row and column (nearest resize: within a pixel), where the model's cell-rounded boxes (the
    LM layout's) are off by up to 5.6 px."""
    tr = vc.trace(make("next"), pixels(), targets=target("next"), sites=["F1"])
    boxes = np.stack([tr[f"crop_box_{s}"].values for s in SIDES], 1)
    np.testing.assert_allclose(boxes, [t.box for t in anyres_crops(SIZE, grid_pinpoints=PINPOINTS, tile_px=TILE,
                                                                  patch_px=8)], rtol=0, atol=1e-12)
    px = processed("next")
    h, w = SIZE
    yy, xx = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    coords = {c: ("crop", tr[c].values) for c in tr.coords if c.startswith("crop_")}
    for ch, want in ((0, yy), (1, xx)):
        out = stitch_crops(xr.DataArray(px[:5, ch].astype(float) - 1, dims=("crop", "y", "x"), coords=coords), SIZE)
        assert np.abs(out["tiles"].values - want).max() <= 1.0
    cfg = make("next").config
    lay = llava_next_layout(cfg, [63] * (16 + 6 * 9), SIZE)
    model_boxes = np.array([t.box for t in lay.tiles[1:]])
    assert np.abs(model_boxes - boxes[1:]).max() * h > 5  # the model's top edge: -1/6 of 60 px, not -4/55
    said = "tile tokens placed as the model unpads them (up to half a cell off the processor's padding)"
    assert said in tr.attrs["image_token_layout"]
    assert said in vc.cam(tr, vc.Recipe(site="F1", layer=1, class_=0)).attrs["checklist"]
    docs = " ".join((Path(__file__).parents[3] / "docs" / "vlm.md").read_text().split())
    assert ("the tower's crops are placed exactly (boxes from the processor's resize and centred padding); the "
            "LM-side tiles place each image token as the model unpads them") in docs
