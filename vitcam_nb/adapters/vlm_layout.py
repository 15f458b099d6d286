"""Where a generative VLM's image tokens sit in its sequence, and where each one lands in the image.

A VLM's image tokens are not a raster of the image in general: LLaVA-NeXT/OneVision tile the image and add a
newline token per row, Qwen2-VL merges 2x2 patches, Idefics3/SmolVLM pixel-shuffle, PaliGemma puts the image
before the prompt. :class:`ImageTokenLayout` is the one object that says, for one prompt, which sequence
positions are image tokens, which tile and grid cell each of them covers, and which tokens were dropped (and
why), so a map over image tokens becomes a map over the image with its layout stated in the checklist.

Example:
    >>> lay = ImageTokenLayout.raster(positions=range(5, 9), grid=(2, 2))
    >>> lay.grid_values([1.0, 2.0, 3.0, 4.0])["image"].tolist()
    [[1.0, 2.0], [3.0, 4.0]]
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from vitcam_nb.core.errors import ArgumentError

__all__ = ["ImageTokenLayout", "Tile", "VlmAnatomy", "image_positions", "layout_coords"]


@dataclass(frozen=True)
class Tile:
    """One grid of image tokens: its name, its (rows, cols) and the part of the image it covers.

    ``box`` is (top, left, bottom, right) as fractions of the original image (0..1), after any padding the
    processor added is undone; the base view of an any-resolution model covers (0, 0, 1, 1). A crop whose grid
    reaches into the processor's padding has a box beyond 0..1 there (those cells hold no token). ``group`` names
    the tiles that together cover the image without overlap (an any-resolution model's crops); tiles of
    different groups overlap (the base view and the crops) and are never averaged together: see
    :meth:`ImageTokenLayout.on_image`.

    Example:
        >>> Tile("tile_r0_c1", (24, 24), (0.0, 0.5, 1.0, 1.0), group="tiles").group_name
        'tiles'
    """

    name: str
    grid: tuple[int, int]
    box: tuple[float, float, float, float] = (0.0, 0.0, 1.0, 1.0)
    group: str = ""

    @property
    def group_name(self) -> str:
        """The group this tile belongs to (its own name when ``group`` is empty)."""
        return self.group or self.name


@dataclass(frozen=True)
class ImageTokenLayout:
    """The image tokens of one prompt: ``positions[i]`` is the sequence position of kept image token ``i``,
    which covers cell (``rows[i]``, ``cols[i]``) of tile ``tiles[tile_of[i]]``. ``dropped`` counts image-side
    tokens that map to no cell (e.g. ``{"newline": 24}``) and ``dropped_positions`` where they sit,
    ``description`` is the checklist's sentence.

    Example:
        >>> lay = ImageTokenLayout.raster([0, 1, 2, 3, 4, 5], (2, 3))
        >>> lay.rows.tolist(), lay.cols.tolist()
        ([0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2])
        >>> lay.on_image([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], (2, 6))["image"].tolist()[0]
        [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    """

    positions: np.ndarray
    tile_of: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    tiles: tuple[Tile, ...]
    description: str
    dropped: Mapping[str, int] = field(default_factory=dict)
    dropped_positions: Mapping[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def raster(cls, positions: Iterable[int], grid: tuple[int, int], *, description: str = "",
               dropped: Mapping[str, int] | None = None) -> ImageTokenLayout:
        """One tile covering the image, tokens in raster order (row-major), e.g. LLaVA-1.5 or PaliGemma."""
        pos = np.asarray(list(positions), dtype=np.int64)
        rows, cols = int(grid[0]), int(grid[1])
        if pos.size != rows * cols:
            raise ArgumentError(f"positions: {pos.size} image tokens do not fill a {rows}x{cols} grid")
        idx = np.arange(pos.size)
        text = description or f"raster: {rows}x{cols} image tokens in row-major order"
        return cls(pos, np.zeros(pos.size, np.int64), idx // cols, idx % cols, (Tile("image", (rows, cols)),),
                   text, dict(dropped or {}))

    def grid_values(self, values: Iterable[float] | np.ndarray) -> dict[str, np.ndarray]:
        """Per-token values (..., n) as one (..., rows, cols) array per tile, keyed by tile name."""
        v = np.asarray(values)
        if not np.issubdtype(v.dtype, np.floating):  # cells without a token are NaN: integers cannot hold it
            v = v.astype(np.float64)
        if v.shape[-1] != self.positions.size:
            raise ArgumentError(f"values: last axis {v.shape[-1]} != {self.positions.size} image tokens")
        out = {}
        for k, tile in enumerate(self.tiles):
            sel = self.tile_of == k
            grid = np.full(v.shape[:-1] + tile.grid, np.nan, dtype=v.dtype)
            grid[..., self.rows[sel], self.cols[sel]] = v[..., sel]
            out[tile.name] = grid
        return out

    def on_image(self, values: Iterable[float] | np.ndarray, size: tuple[int, int]) -> dict[str, np.ndarray]:
        """Per-token values (..., n) placed on the original image, one (..., H, W) map per tile group.

        Each tile's grid is placed in its ``box`` (padding undone) by nearest cell: pixel (y, x) takes the value
        of the cell whose box-relative extent holds the pixel's centre. Tiles of one group do not overlap, so a
        group's map is their exact stitching; groups overlap (an any-resolution model's base view and its crops
        both cover the whole image) and are returned separately rather than averaged, since any combination
        (mean, max, base-only) would be a choice the model never made. Pixels no tile of a group covers are NaN.
        """
        h, w = int(size[0]), int(size[1])
        if h < 1 or w < 1:
            raise ArgumentError(f"size: {size!r} must be two positive ints (height, width)")
        grids = self.grid_values(values)
        first = next(iter(grids.values()))
        fy, fx = (np.arange(h) + 0.5) / h, (np.arange(w) + 0.5) / w
        out: dict[str, np.ndarray] = {}
        for tile in self.tiles:
            g = tile.group_name
            canvas = out.setdefault(g, np.full(first.shape[:-2] + (h, w), np.nan, dtype=first.dtype))
            top, left, bottom, right = tile.box
            ry = np.floor((fy - top) / (bottom - top) * tile.grid[0]).astype(np.int64)
            rx = np.floor((fx - left) / (right - left) * tile.grid[1]).astype(np.int64)
            iy, ix = np.nonzero((ry >= 0) & (ry < tile.grid[0]))[0], np.nonzero((rx >= 0) & (rx < tile.grid[1]))[0]
            if iy.size and ix.size:
                vals = grids[tile.name][..., ry[iy][:, None], rx[ix][None, :]]
                sub = canvas[..., iy[:, None], ix[None, :]]
                keep = ~np.isnan(vals)
                sub[keep] = vals[keep]
                canvas[..., iy[:, None], ix[None, :]] = sub
        return out


@dataclass(frozen=True)
class VlmAnatomy:
    """Where a transformers VLM class keeps its parts, as dotted module paths from the ``...ForConditionalGeneration``
    object: the vision tower's blocks, the projector (its output is one vector per image token, or per merged
    token), the LM's decoder layers, and the config key holding the image placeholder token id. ``notes`` says
    what sits between them (a merge, a pooling) so the adapter glue does not assume a raster.

    Example:
        >>> VlmAnatomy("x", "XForConditionalGeneration", "model.vision_tower.encoder.layers",
        ...            "model.multi_modal_projector", "model.language_model.layers", "image_token_id").projector
        'model.multi_modal_projector'
    """

    family: str
    model_class: str
    vision_blocks: str
    projector: str
    lm_layers: str
    image_token_key: str
    notes: str = ""


def image_positions(input_ids: Iterable[int] | np.ndarray, image_token_id: int) -> np.ndarray:
    """The sequence positions of the image placeholder tokens in one prompt's ids (1-D), in order.

    Example:
        >>> image_positions([1, 9, 9, 2, 9], 9).tolist()
        [1, 2, 4]
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 1:
        raise ArgumentError(f"input_ids: one prompt's ids (1-D) expected, got shape {ids.shape}")
    return np.nonzero(ids == int(image_token_id))[0].astype(np.int64)


def layout_coords(lay: ImageTokenLayout) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    """The ``image_token`` coordinates of a trace's LM sites (position in the sequence, tile, row and column of each
    image token) and the layout attributes each LM site's variables carry.

    Example:
        >>> coords, attrs = layout_coords(ImageTokenLayout.raster([3, 4], (1, 2)))
        >>> coords["image_token_pos"][1].tolist(), attrs["layout_tiles"]
        ([3, 4], 'image:1x2')
    """
    pos = lay.positions
    coords = {
        "image_token": ("image_token", np.arange(pos.size, dtype=np.int64)),
        "image_token_pos": ("image_token", pos.astype(np.int64)),
        "image_token_tile": ("image_token", lay.tile_of.astype(np.int64)),
        "image_token_row": ("image_token", lay.rows.astype(np.int64)),
        "image_token_col": ("image_token", lay.cols.astype(np.int64)),
    }
    attrs = {"layout": lay.description, "layout_tiles": ";".join(
        f"{t.name}:{t.grid[0]}x{t.grid[1]}" for t in lay.tiles),
        "layout_dropped": ";".join(f"{k}:{v}" for k, v in lay.dropped.items()),
        # every tile's grid, box on the image and group: what places a multi-tile map (compute.vlm_tiles)
        "layout_tile_boxes": json.dumps([{"name": t.name, "grid": [int(v) for v in t.grid], "box": [
            float(v) for v in t.box], "group": t.group_name} for t in lay.tiles])}
    return coords, attrs
