"""``vc.evaluate.position_probe`` on multi-tile and crops traces (issue 55, item 4: "position_probe works on these
traces so the raster assumption is measured, not assumed"), against the NumPy normal-equations fit of
test_vlm_position_probe on the stored arrays:

* LM-side sites of a multi-tile layout: each image token's position is its cell's centre on the image through its
  tile's box (``frame="image"``, where the multi-tile map draws it) or within its tile (``frame="tile"``),
  computed here by hand from the layout table; on the tiny LLaVA re-laid as test_vlm_multitile's synthetic layout
  and on a real LLaVA-NeXT trace;
* tower sites of a crops trace (LLaVA-NeXT): probed per crop, crop k's value the probe of crop k's patch tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import vitcam_nb as vc

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compute"))
from anyres_cases import make as make_anyres  # noqa: E402
from anyres_cases import pixels, target  # noqa: E402
from test_vlm_llava import ANSWER, PROMPT, make_llava, make_x  # noqa: E402
from test_vlm_multitile import CELLS, TILES  # noqa: E402
from test_vlm_position_probe import reference_r2  # noqa: E402

FOLDS, ALPHA, SEED = 4, 0.5, 3


@pytest.fixture(scope="module")
def tiled():
    tr = vc.trace(make_llava(), make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                  sites=["projector", "lm_resid"])
    tr = tr.assign_coords(image_token_tile=("image_token", CELLS[:, 0]), image_token_row=("image_token", CELLS[:, 1]),
                          image_token_col=("image_token", CELLS[:, 2]))
    boxes = json.dumps([{"name": n, "grid": list(g), "box": list(b), "group": grp} for n, g, b, grp in TILES])
    for site in ("projector", "lm_resid"):
        tr[site].attrs["layout_tile_boxes"] = boxes
    return tr


@pytest.fixture(scope="module")
def anyres():
    return vc.trace(make_anyres("next"), pixels(), targets=target("next"), sites=["F1", "F6", "projector", "lm_resid"])


def centres(tiles, cells, frame):
    """Each token's cell centre: within its tile's grid, or on the image through the tile's box, by hand."""
    out = []
    for t, r, c in cells:
        _, (gh, gw), (top, left, bottom, right), _ = tiles[t]
        fy, fx = (r + 0.5) / gh, (c + 0.5) / gw
        out.append((fy, fx) if frame == "tile" else (top + fy * (bottom - top), left + fx * (right - left)))
    return np.array(out, np.float64)


@pytest.mark.parametrize("frame", ["image", "tile"])
def test_lm_sites_of_a_multi_tile_layout_are_probed_at_the_cell_centres(tiled, frame):
    r2 = vc.evaluate.position_probe(tiled, folds=FOLDS, alpha=ALPHA, seed=SEED, frame=frame)
    y = centres(TILES, CELLS, frame)
    np.testing.assert_allclose(float(r2.sel(site="projector", layer=0)),
                               reference_r2(tiled["projector"].values.astype(np.float64), y, FOLDS, ALPHA, SEED),
                               rtol=1e-6, atol=1e-9)
    for layer in (0, 1):
        x = tiled["lm_resid"].values[layer].astype(np.float64)
        np.testing.assert_allclose(float(r2.sel(site="lm_resid", layer=layer)),
                                   reference_r2(x, y, FOLDS, ALPHA, SEED), rtol=1e-6, atol=1e-9)
    assert r2.attrs["frame"] == frame and "3 tiles (base, left, right)" in r2.attrs["lm_sites"]
    # the frames differ: the image frame is not the tile frame rescaled (tiles at different boxes)
    other = centres(TILES, CELLS, "tile" if frame == "image" else "image")
    assert not np.allclose(np.corrcoef(y[:, 1], other[:, 1])[0, 1], 1.0)


def test_a_one_tile_layout_gives_the_same_r2_in_either_frame():
    tr = vc.trace(make_llava(), make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                  sites=["lm_resid"])
    a = vc.evaluate.position_probe(tr, folds=FOLDS, alpha=ALPHA, seed=SEED, frame="image")
    b = vc.evaluate.position_probe(tr, folds=FOLDS, alpha=ALPHA, seed=SEED, frame="tile")
    np.testing.assert_array_equal(a.values, b.values)


def test_crops_trace_tower_sites_per_crop_and_lm_sites_on_the_image(anyres):
    r2 = vc.evaluate.position_probe(anyres, folds=FOLDS, alpha=ALPHA, seed=SEED)
    n_crop = anyres.sizes["crop"]
    assert r2.dims == ("crop", "site", "layer") and r2.sizes["crop"] == n_crop == 5
    assert list(r2["crop_tile"].values) == list(anyres["crop_tile"].values)
    for k in range(n_crop):
        one = anyres.isel(crop=k)
        patch = one["token_kind"].values == "patch"
        y = np.stack([one["patch_row"].values[patch], one["patch_col"].values[patch]], -1).astype(np.float64)
        for site in ("F1", "F6"):
            for layer in [int(v) for v in anyres["act"]["layer"].values]:
                x = one["act"].sel(site=site, layer=layer).values[patch].astype(np.float64)
                np.testing.assert_allclose(float(r2.sel(crop=k, site=site, layer=layer)),
                                           reference_r2(x, y, FOLDS, ALPHA, SEED), rtol=1e-6, atol=1e-9)
    # the LM side: the real layout's tiles (base 4x4 over the image, the unpadded crops), each token's centre on
    # the image through its tile's box, by hand from the stored layout table
    table = json.loads(anyres["lm_resid"].attrs["layout_tile_boxes"])
    tiles = [(d["name"], tuple(d["grid"]), tuple(d["box"]), d["group"]) for d in table]
    cells = np.stack([anyres[f"image_token_{k}"].values for k in ("tile", "row", "col")], -1)
    y = centres(tiles, cells, "image")
    base = cells[:, 0] == 0
    np.testing.assert_allclose(y[base], (cells[base, 1:] + 0.5) / 4)  # the base view spans the whole image
    assert (y >= 0).all() and (y <= 1).all()
    for layer in (0, 1):
        expected = reference_r2(anyres["lm_resid"].values[layer].astype(np.float64), y, FOLDS, ALPHA, SEED)
        np.testing.assert_allclose(r2.sel(site="lm_resid", layer=layer).values, np.full(n_crop, expected),
                                   rtol=1e-6, atol=1e-9)
    # stored in the trace (aligned on its tower sites and blocks), each crop's trace holds its own crop's R^2
    tr = anyres.copy()
    tr["position_r2"] = r2
    np.testing.assert_array_equal(tr.isel(crop=2)["position_r2"].values, r2.sel(site=["F1", "F6"]).values[2])


def test_a_bad_frame_is_refused_by_name(tiled):
    with pytest.raises(vc.ArgumentError, match="frame"):
        vc.evaluate.position_probe(tiled, frame="grid")
