"""``ImageTokenLayout.on_image``: tiles placed in their boxes on the original image, by hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, Tile, image_positions
from vitcam_nb.core.errors import ArgumentError


def _layout(tiles, cells):
    t, r, c = (np.array(v, dtype=np.int64) for v in zip(*cells))
    return ImageTokenLayout(np.arange(len(cells)), t, r, c, tuple(tiles), "test")


def test_two_side_by_side_tiles_stitch_and_base_stays_separate():
    tiles = [Tile("base", (1, 1), group="base"),
             Tile("L", (1, 2), (0.0, 0.0, 1.0, 0.5), group="tiles"), Tile("R", (1, 2), (0.0, 0.5, 1.0, 1.0), "tiles")]
    lay = _layout(tiles, [(0, 0, 0), (1, 0, 0), (1, 0, 1), (2, 0, 0), (2, 0, 1)])
    maps = lay.on_image([9.0, 1.0, 2.0, 3.0, 4.0], (2, 8))
    assert set(maps) == {"base", "tiles"}
    assert np.array_equal(maps["base"], np.full((2, 8), 9.0))
    # 8 columns: each tile covers 4, each of its 2 cells covers 2 columns
    assert np.array_equal(maps["tiles"], np.array([[1, 1, 2, 2, 3, 3, 4, 4]] * 2, dtype=float))


def test_a_tile_reaching_into_padding_keeps_only_the_image_part():
    # a 4-row tile whose box starts half a tile above the image: its top 2 rows lie in the padding
    tiles = [Tile("t", (4, 1), (-0.5, 0.0, 1.5, 1.0))]
    lay = _layout(tiles, [(0, 1, 0), (0, 2, 0)])  # the model kept rows 1 and 2 only
    got = lay.on_image([5.0, 6.0], (4, 1))["t"]
    # image row centres f = 0.125, 0.375, 0.625, 0.875 -> tile row floor((f + 0.5) / 2 * 4) = 1, 1, 2, 2
    assert np.array_equal(got[:, 0], [5.0, 5.0, 6.0, 6.0])


def test_batched_values_and_missing_cells():
    lay = ImageTokenLayout.raster(range(3, 6), (1, 3))
    got = lay.on_image(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), (1, 6))["image"]
    assert got.shape == (2, 1, 6) and np.array_equal(got[1], [[4, 4, 5, 5, 6, 6]])
    sparse = _layout([Tile("t", (1, 2))], [(0, 0, 1)])
    assert np.isnan(sparse.on_image([7.0], (1, 2))["t"][0, 0])
    with pytest.raises(ArgumentError, match="size"):
        lay.on_image([1.0, 2.0, 3.0], (0, 4))


def test_integer_values_become_floats_so_missing_cells_are_nan():
    sparse = _layout([Tile("t", (1, 2))], [(0, 0, 1)])
    assert np.isnan(sparse.grid_values(np.array([3]))["t"][0, 0])
    assert sparse.on_image(np.array([3]), (1, 2))["t"].tolist() == [[pytest.approx(np.nan, nan_ok=True), 3.0]]


def test_image_positions():
    assert image_positions(np.array([1, 7, 7, 2, 7]), 7).tolist() == [1, 2, 4]
    with pytest.raises(ArgumentError, match="input_ids"):
        image_positions(np.zeros((2, 3)), 7)
