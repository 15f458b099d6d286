"""Multi-tile image-token layouts at the generative-VLM sites (``projector``, ``lm_resid``, ``lm_attn``): per-token
values of every tile placed on the image, one map per tile group.

A tiled VLM (Idefics3/SmolVLM's tiles and global view, LLaVA-NeXT's base view and crops) hands the LM the tokens of
every tile as one set, so every weighting and aggregation runs over all image tokens together (Grad-CAM's channel
weights are the mean gradient over every image token of every tile; ReLU and normalisation see them all). Only then
is each token's value placed by the layout stored with the trace (coords ``image_token_tile/row/col``, attr
``layout_tile_boxes``): each tile's grid in its box of the image, one map per tile group (tiles of one group
cover the image without overlap and are stitched; groups overlap, e.g. the global view and the tiles, and are never
averaged). With ``upsample="none"`` the per-tile grids; with ``"nearest"`` each pixel takes the cell whose box
holds its centre (:meth:`~vitcam_nb.adapters.vlm_layout.ImageTokenLayout.on_image`); with ``"bilinear"`` or
``"bicubic"`` each tile's grid (its cells that hold a token) is upsampled over its pixels alone, so no value
crosses a tile seam. Pixels no tile of a group covers are NaN.

Example:
    >>> tiles = [Tile("a", (1, 2), (0.0, 0.0, 1.0, 0.5), "tiles"), Tile("b", (1, 2), (0.0, 0.5, 1.0, 1.0), "tiles")]
    >>> lay = ImageTokenLayout(np.arange(4), np.array([0, 0, 1, 1]), np.zeros(4, int), np.array([0, 1, 0, 1]),
    ...                        tuple(tiles), "two tiles side by side")
    >>> place(lay, np.array([1.0, 2.0, 3.0, 4.0]), (1, 4), "nearest")[1]["tiles"].tolist()
    [[1.0, 2.0, 3.0, 4.0]]
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, Tile
from vitcam_nb.compute.maps import map_array
from vitcam_nb.compute.spatial import upsample
from vitcam_nb.core.errors import TraceError

__all__ = ["TILES_ATTR", "is_tiled", "place", "placed_map", "stacked", "trace_layout"]

#: the attr of each LM-side site's variables holding the layout's tiles as JSON (name, grid, box, group), written by
#: :meth:`vitcam_nb.adapters.hf_vlm.HfVlmAdapter.assemble_extra`
TILES_ATTR = "layout_tile_boxes"


def is_tiled(trace: xr.Dataset) -> bool:
    """Whether the trace's image tokens cover more than one tile.

    Example:
        >>> is_tiled(xr.Dataset(coords={"image_token_tile": ("image_token", [0, 0, 1])}))
        True
    """
    return np.unique(trace["image_token_tile"].values).size > 1


def trace_layout(trace: xr.Dataset, site: str) -> ImageTokenLayout:
    """The image-token layout of an answer trace, rebuilt from its coords and the site's :data:`TILES_ATTR`.

    Example:
        >>> tr = xr.Dataset({"lm_resid": ("image_token", [0.0, 0.0], {TILES_ATTR: json.dumps([
        ...     {"name": "a", "grid": [1, 1], "box": [0, 0, 1, 0.5], "group": "tiles"},
        ...     {"name": "b", "grid": [1, 1], "box": [0, 0.5, 1, 1], "group": "tiles"}])})},
        ...     coords={"image_token_pos": ("image_token", [3, 4]), "image_token_tile": ("image_token", [0, 1]),
        ...             "image_token_row": ("image_token", [0, 0]), "image_token_col": ("image_token", [0, 0])})
        >>> [t.box[1] for t in trace_layout(tr, "lm_resid").tiles]
        [0, 0.5]
    """
    text = trace[site].attrs.get(TILES_ATTR)
    if not text:
        raise TraceError(f"trace: its image tokens cover several tiles but {site!r} stores no tile boxes "
                         f"({TILES_ATTR}); trace it again with this version of vitcam_nb")
    tiles = tuple(Tile(d["name"], tuple(d["grid"]), tuple(d["box"]), d["group"]) for d in json.loads(text))
    tile_of = trace["image_token_tile"].values.astype(np.int64)
    if tile_of.min() < 0 or tile_of.max() >= len(tiles):
        raise TraceError(f"trace: image_token_tile names tiles 0..{tile_of.max()} but {len(tiles)} are stored")
    return ImageTokenLayout(trace["image_token_pos"].values, tile_of, trace["image_token_row"].values,
                            trace["image_token_col"].values, tiles, str(trace[site].attrs.get("layout", "")))


def _span(lo: float, hi: float, n: int) -> np.ndarray:
    """Pixels (of ``n``) whose centre lies in [lo, hi) of the image (fractions)."""
    centre = (np.arange(n) + 0.5) / n
    return np.flatnonzero((centre >= lo) & (centre < hi))


def _tile_pixels(tile: Tile, grid: np.ndarray, size: tuple[int, int], mode: str) -> tuple:
    """(pixel rows, pixel cols, values) of one tile upsampled with ``mode`` over the pixels of its token cells."""
    held = ~np.isnan(grid)
    rows, cols = np.flatnonzero(held.any(axis=1)), np.flatnonzero(held.any(axis=0))
    if not rows.size:
        return None
    r0, r1, c0, c1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    top, left, bottom, right = tile.box
    fy, fx = (bottom - top) / tile.grid[0], (right - left) / tile.grid[1]
    iy = _span(top + r0 * fy, top + r1 * fy, size[0])
    ix = _span(left + c0 * fx, left + c1 * fx, size[1])
    if not iy.size or not ix.size:
        return None
    return iy, ix, upsample(grid[r0:r1, c0:c1], (iy.size, ix.size), mode)


def place(layout: ImageTokenLayout, values: np.ndarray, size: tuple[int, int], mode: str
          ) -> tuple[list[str], dict[str, np.ndarray]]:
    """Per-token ``values`` (n,) of ``layout`` as (tile names, {name: grid}) with ``mode="none"``, else (group
    names, {group: (H, W) map on the image}) placed as the module says.

    Example:
        >>> lay = ImageTokenLayout.raster(range(2), (1, 2))
        >>> place(lay, np.array([0.0, 1.0]), (1, 4), "bilinear")[1]["image"].tolist()
        [[0.0, 0.25, 0.75, 1.0]]
    """
    grids = layout.grid_values(np.asarray(values, np.float32))
    if mode == "none":
        return [t.name for t in layout.tiles], grids
    if mode == "nearest":
        out = layout.on_image(values, size)
        return list(out), {g: m.astype(np.float32) for g, m in out.items()}
    out: dict[str, np.ndarray] = {}
    for tile in layout.tiles:
        canvas = out.setdefault(tile.group_name, np.full(size, np.nan, np.float32))
        got = _tile_pixels(tile, grids[tile.name], size, mode)
        if got is not None:
            canvas[np.ix_(got[0], got[1])] = got[2]
    return list(out), out


def stacked(names: list[str], maps: dict[str, np.ndarray], layout: ImageTokenLayout, mode: str
            ) -> tuple[np.ndarray, tuple[str, ...], dict[str, Any]]:
    """The placed maps as one array with a leading dim: ``view`` (one per tile group) on the image, or ``tile``
    (grids padded with NaN to the largest, with each tile's group) with ``upsample="none"``.

    Example:
        >>> lay = ImageTokenLayout.raster(range(2), (1, 2))
        >>> stacked(*place(lay, np.array([0.0, 1.0]), (1, 2), "none"), lay, "none")[0].tolist()
        [[[0.0, 1.0]]]
    """
    if mode != "none":
        return np.stack([maps[n] for n in names]), ("view",), {"view": ("view", names)}
    gh = max(m.shape[-2] for m in maps.values())
    gw = max(m.shape[-1] for m in maps.values())
    out = np.full((len(names), gh, gw), np.nan, np.float32)
    for k, n in enumerate(names):
        out[k, :maps[n].shape[0], :maps[n].shape[1]] = maps[n]
    return out, ("tile",), {"tile": ("tile", names), "tile_group": ("tile", [t.group_name for t in layout.tiles])}


def placed_map(values: np.ndarray, dim: tuple[str, ...], coords: dict, recipe: Any, trace: xr.Dataset,
               checklist: str, methods: str, reason: str, partial: list[str]) -> xr.DataArray:
    """The map DataArray of a VLM-side form: ``values`` (y, x) with the recipe, ids and report in its attrs, or, over
    a multi-tile layout (``dim`` non-empty), one map per tile group (or per tile) along ``dim`` with the report of
    the whole.

    Example:
        >>> from vitcam_nb.core.recipe import Recipe
        >>> m = placed_map(np.zeros((2, 4, 4)), ("view",), {"view": ["base", "tiles"]}, Recipe(site="lm_resid"),
        ...                xr.Dataset(attrs={"trace_id": "t"}), "{}", "", "", [])
        >>> m.dims, m["view"].values.tolist()
        (('view', 'y', 'x'), ['base', 'tiles'])
    """
    out = map_array(values if not dim else values[0], recipe, str(trace.attrs.get("trace_id", "")), checklist,
                    methods, reason, partial)
    if not dim:
        return out
    return xr.DataArray(values.astype(np.float32, copy=False), dims=(*dim, *out.dims), coords=coords, name=out.name,
                        attrs=out.attrs)
