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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from vitcam_nb.core.errors import ArgumentError

__all__ = ["ImageTokenLayout", "Tile"]


@dataclass(frozen=True)
class Tile:
    """One grid of image tokens: its name, its (rows, cols) and the part of the image it covers.

    ``box`` is (top, left, bottom, right) as fractions of the original image (0..1), after any padding the
    processor added is undone; the base view of an any-resolution model covers (0, 0, 1, 1).
    """

    name: str
    grid: tuple[int, int]
    box: tuple[float, float, float, float] = (0.0, 0.0, 1.0, 1.0)


@dataclass(frozen=True)
class ImageTokenLayout:
    """The image tokens of one prompt: ``positions[i]`` is the sequence position of kept image token ``i``,
    which covers cell (``rows[i]``, ``cols[i]``) of tile ``tiles[tile_of[i]]``. ``dropped`` counts image-side
    tokens that map to no cell (e.g. ``{"newline": 24}``), ``description`` is the checklist's sentence."""

    positions: np.ndarray
    tile_of: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    tiles: tuple[Tile, ...]
    description: str
    dropped: Mapping[str, int] = field(default_factory=dict)

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
        v = np.asarray(values, dtype=np.float64) if not isinstance(values, np.ndarray) else values
        if v.shape[-1] != self.positions.size:
            raise ArgumentError(f"values: last axis {v.shape[-1]} != {self.positions.size} image tokens")
        out = {}
        for k, tile in enumerate(self.tiles):
            sel = self.tile_of == k
            grid = np.full(v.shape[:-1] + tile.grid, np.nan, dtype=v.dtype)
            grid[..., self.rows[sel], self.cols[sel]] = v[..., sel]
            out[tile.name] = grid
        return out
