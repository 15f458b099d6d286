"""TAM (:mod:`vitcam_nb.compute.tam`) over a multi-tile image-token layout (LLaVA-NeXT/OneVision's base view and
crops, Idefics3/SmolVLM's tiles and global view): the rank Gaussian filter runs per tile, never across a seam.

Steps 1-3 of the formula (:func:`~vitcam_nb.compute.tam_formula.tam_scores`: the activations, the estimated causal
inference and the joint min-max with the context's text scores) read every image token of every tile as one set,
as the LM reads them. Step 4, the 3x3 rank Gaussian filter, then runs on each tile's own grid: the rectangle of
cells its tokens hold (an any-resolution crop cut by the unpadding holds fewer rows or columns than its grid), with
the borders reflected inside the tile, so no window mixes tokens of two tiles (neighbours in the token grid of one
tile are neighbours on the image; cells of two tiles need not be, and a global view overlaps the tiles). A tile
whose held rectangle is one cell thin has no 3x3 window to reflect and keeps its unfiltered values (said in the
map's notes). The filtered per-token values are then normalised as one set and placed per tile group exactly as
the other multi-tile LM maps (:func:`~vitcam_nb.compute.vlm_tiles.place`): one map per group, never averaged.

Example:
    >>> from vitcam_nb.adapters.vlm_layout import ImageTokenLayout
    >>> lay = ImageTokenLayout.raster(range(9), (3, 3))
    >>> filter_tiles(lay, np.full(9, 0.5))[0].tolist() == [0.5] * 9
    True
"""

from __future__ import annotations

import numpy as np

from vitcam_nb.adapters.vlm_layout import ImageTokenLayout
from vitcam_nb.compute.tam_formula import FILTER_SIZE, rank_gaussian_filter
from vitcam_nb.core.errors import TraceError

__all__ = ["SEAM_WORDS", "filter_tiles"]

#: What the checklist says of the filter on a multi-tile layout.
SEAM_WORDS = ("the rank Gaussian filter (3x3, reflected borders) runs per tile on the rectangle of cells its tokens "
              "hold, never across a tile seam (steps 1-3 read all tiles' tokens as one set); the filtered values "
              "are normalised as one set, then each tile's grid is placed in its box, one map per tile group, "
              "groups never averaged")


def filter_tiles(layout: ImageTokenLayout, scores: np.ndarray, size: int = FILTER_SIZE
                 ) -> tuple[np.ndarray, list[str]]:
    """Per-token ``scores`` (n,) filtered tile by tile (the module docstring), float64, and a note per tile left
    unfiltered. A tile whose tokens do not fill their rectangle once each is refused (:class:`TraceError`).

    Example:
        >>> from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, Tile
        >>> tiles = (Tile("a", (1, 2), (0, 0, 1, 0.5), "t"), Tile("b", (1, 2), (0, 0.5, 1, 1), "t"))
        >>> lay = ImageTokenLayout(np.arange(4), np.array([0, 0, 1, 1]), np.zeros(4, int), np.array([0, 1, 0, 1]),
        ...                        tiles, "two one-row tiles")
        >>> filter_tiles(lay, np.array([0.1, 0.2, 0.3, 0.4]))[1][0]
        'tile a: its tokens hold 1x2 cells, too thin for the 3x3 filter; left unfiltered'
    """
    scores = np.asarray(scores, np.float64)
    out = scores.copy()
    notes: list[str] = []
    for k, tile in enumerate(layout.tiles):
        sel = np.flatnonzero(layout.tile_of == k)
        if not sel.size:
            continue
        rows, cols = layout.rows[sel], layout.cols[sel]
        r0, c0 = int(rows.min()), int(cols.min())
        h, w = int(rows.max()) - r0 + 1, int(cols.max()) - c0 + 1
        if sel.size != h * w or np.unique((rows - r0) * w + (cols - c0)).size != sel.size:
            raise TraceError(f"trace: the {sel.size} image tokens of tile {tile.name!r} do not fill their {h}x{w} "
                             "rectangle of cells once each; TAM's filter needs a full grid per tile")
        if min(h, w) <= size // 2:
            notes.append(f"tile {tile.name}: its tokens hold {h}x{w} cells, too thin for the {size}x{size} filter; "
                         "left unfiltered")
            continue
        grid = np.zeros((h, w), np.float64)
        grid[rows - r0, cols - c0] = scores[sel]
        out[sel] = rank_gaussian_filter(grid, size)[rows - r0, cols - c0]
    return out, notes
