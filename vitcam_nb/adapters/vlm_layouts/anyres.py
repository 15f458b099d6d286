"""LLaVA-NeXT and LLaVA-OneVision any-resolution layouts: a base view, then the crops of the best-fit grid.

The model packs one image as: the base view's ``h x w`` patch tokens (the image squashed to one tile, raster
order), then the crops stitched into one ``(rows*h) x (cols*w)`` grid, unpadded (the feature rows/columns that
cover the processor's letterbox padding are cut, as ``unpad_image`` does), read row-major with one learned
newline token after each row. OneVision (``vision_aspect_ratio="anyres_max_N"``) then bilinearly shrinks the
unpadded grid when it holds more than about ``N`` tiles' worth of tokens (ratio > 1.1); each token is then a
blend of up to four cells, so the crops become one resampled grid over the image.

Crop boxes (:class:`~vitcam_nb.adapters.vlm_layout.Tile`) take the kept cells as covering the image exactly,
as the model does; where the letterbox is an odd number of cells the model keeps one padding cell more, so a
box edge is then off by at most half a cell.

The best-fit grid is chosen as the processor does: the pinpoint resolution that keeps the most of the image's
pixels after an aspect-preserving resize, the least wasted canvas on ties.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, Tile, VlmAnatomy, image_positions
from vitcam_nb.core.errors import ArgumentError

__all__ = [
    "LLAVA_NEXT_ANATOMY",
    "LLAVA_ONEVISION_ANATOMY",
    "anyres_layout",
    "best_fit_resolution",
    "llava_next_layout",
    "llava_onevision_layout",
]

_NOTES = ("tower output at vision_feature_layer (CLS dropped if vision_feature_select_strategy='default') -> "
          "projector per crop -> base + unpadded crops + newline tokens (pack_image_features)")
LLAVA_NEXT_ANATOMY = VlmAnatomy(
    family="llava_next", model_class="LlavaNextForConditionalGeneration",
    vision_blocks="model.vision_tower.encoder.layers", projector="model.multi_modal_projector",
    lm_layers="model.language_model.layers", image_token_key="image_token_id", notes=_NOTES)
LLAVA_ONEVISION_ANATOMY = VlmAnatomy(
    family="llava_onevision", model_class="LlavaOnevisionForConditionalGeneration",
    vision_blocks="model.vision_tower.encoder.layers", projector="model.multi_modal_projector",
    lm_layers="model.language_model.layers", image_token_key="image_token_id",
    notes=_NOTES + "; anyres_max_N may bilinearly shrink the crop grid")


def best_fit_resolution(image_size: Sequence[int], pinpoints: Iterable[Sequence[int]]) -> tuple[int, int]:
    """The (height, width) among ``pinpoints`` an image of ``image_size`` (height, width) is packed into.

    Example:
        >>> best_fit_resolution((500, 800), [(336, 672), (672, 336), (672, 672)])
        (672, 672)
    """
    h0, w0 = int(image_size[0]), int(image_size[1])
    if h0 < 1 or w0 < 1:
        raise ArgumentError(f"image_size: {tuple(image_size)!r} must be a positive (height, width)")
    best, best_key = None, None
    for ph, pw in pinpoints:
        s = min(pw / w0, ph / h0)
        kept = min(int(w0 * s) * int(h0 * s), w0 * h0)
        key = (kept, -(pw * ph - kept))  # most image pixels kept, then least canvas wasted; first wins ties
        if best_key is None or key > best_key:
            best, best_key = (int(ph), int(pw)), key
    if best is None:
        raise ArgumentError("grid_pinpoints: no resolution given")
    return best


def _unpadded_span(image_size: Sequence[int], grid: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the crop-grid cells the model keeps for an image of ``image_size``."""
    h0, w0 = int(image_size[0]), int(image_size[1])
    gh, gw = grid
    if w0 / h0 > gw / gh:  # wider than the canvas: letterbox bars top and bottom
        new = int(round(h0 * (gw / w0), 7))
        pad = (gh - new) // 2
        return pad, gh - pad, 0, gw
    new = int(round(w0 * (gh / h0), 7))
    pad = (gw - new) // 2
    return 0, gh, pad, gw - pad


def anyres_layout(input_ids: Any, image_size: Sequence[int], *, image_token_id: int, grid_pinpoints: Any,
                  tile_px: int, patch_px: int, family: str = "LLaVA-NeXT", max_tiles: int | None = None,
                  newline: bool = True) -> ImageTokenLayout:
    """The layout of one image of ``image_size`` (height, width, before processing) in one prompt's ids.

    ``tile_px``/``patch_px`` are the tower's input and patch sizes; ``max_tiles`` is OneVision's ``anyres_max_N``.
    Raises :class:`ArgumentError` when the prompt's image tokens do not number what this layout packs.

    Example:
        >>> lay = anyres_layout([9] * 60, (40, 90), image_token_id=9, grid_pinpoints=[(32, 96)], tile_px=32,
        ...                     patch_px=8)  # a 4x12 cell canvas; the image fills 9 columns, 1 is cut each side
        >>> [t.name for t in lay.tiles], lay.dropped, lay.tiles[1].box
        (['base', 'tile_r0_c0', 'tile_r0_c1', 'tile_r0_c2'], {'newline': 4}, (0.0, -0.1, 1.0, 0.3))
    """
    side = int(tile_px) // int(patch_px)
    ph, pw = best_fit_resolution(image_size, [tuple(p) for p in grid_pinpoints])
    nrow, ncol = ph // int(tile_px), pw // int(tile_px)
    top, bottom, left, right = _unpadded_span(image_size, (nrow * side, ncol * side))
    rr, cc = bottom - top, right - left
    base_r, base_c = np.divmod(np.arange(side * side), side)
    tiles = [Tile("base", (side, side), group="base")]
    tile_of, rows, cols = [np.zeros(side * side, np.int64)], [base_r], [base_c]
    out_r, out_c, resampled = rr, cc, ""
    ratio = math.sqrt(rr * cc / (max_tiles * side**2)) if max_tiles else 0.0
    if ratio > 1.1:  # OneVision's anyres_max: one resampled grid over the unpadded crops
        out_r, out_c = int(rr // ratio), int(cc // ratio)
        tiles.append(Tile("tiles", (out_r, out_c), group="tiles"))
        g_r, g_c = np.divmod(np.arange(out_r * out_c), out_c)
        tile_of.append(np.ones(g_r.size, np.int64))
        rows.append(g_r)
        cols.append(g_c)
        resampled = f", bilinearly resized to {out_r}x{out_c} (anyres_max_{max_tiles}: each token blends cells)"
    else:
        for i in range(nrow):
            for j in range(ncol):
                box = ((i * side - top) / rr, (j * side - left) / cc, ((i + 1) * side - top) / rr,
                       ((j + 1) * side - left) / cc)
                tiles.append(Tile(f"tile_r{i}_c{j}", (side, side), box, group="tiles"))
        g_r, g_c = np.divmod(np.arange(rr * cc), cc)
        g_r, g_c = g_r + top, g_c + left  # cell in the padded crop grid
        tile_of.append(1 + (g_r // side) * ncol + g_c // side)
        rows.append(g_r % side)
        cols.append(g_c % side)
    n_img = side * side + out_r * (out_c + int(newline))
    pos = image_positions(input_ids, image_token_id)
    if pos.size != n_img:
        raise ArgumentError(f"input_ids: {pos.size} image tokens (id {image_token_id}) but this {family} layout "
                            f"of a {image_size[0]}x{image_size[1]} image packs {n_img}")
    keep = np.ones(n_img, bool)
    if newline:
        keep[side * side + np.arange(1, out_r + 1) * (out_c + 1) - 1] = False
    cut = nrow * side * ncol * side - rr * cc
    desc = (f"{family} any-res: base {side}x{side} + {nrow}x{ncol} tiles of {side}x{side}, unpadded to {rr}x{cc}"
            f" ({cut} padding cells cut){resampled}, {out_r if newline else 0} newline tokens dropped; "
            f"base and tiles overlap and are mapped separately")
    dropped = {"newline": out_r} if newline else {}
    dropped_pos = {"newline": pos[~keep]} if newline else {}
    return ImageTokenLayout(pos[keep], np.concatenate(tile_of), np.concatenate(rows), np.concatenate(cols),
                            tuple(tiles), desc, dropped, dropped_pos)


def _vision(config: Any) -> tuple[int, int]:
    vc = config.vision_config
    return int(vc.image_size), int(vc.patch_size)


def llava_next_layout(config: Any, input_ids: Any, image_size: Sequence[int]) -> ImageTokenLayout:
    """LLaVA-NeXT: ``config`` a ``LlavaNextConfig``, ``input_ids`` one prompt's ids, ``image_size`` the
    processor's ``image_sizes`` row for the image (original height, width).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(vision_config=NS(image_size=336, patch_size=14), image_token_id=9,
        ...          image_grid_pinpoints=[[336, 672], [672, 336], [672, 672]])
        >>> lay = llava_next_layout(cfg, [1] + [9] * 2046 + [2], (500, 800))
        >>> print(lay.description)  # doctest: +NORMALIZE_WHITESPACE
        LLaVA-NeXT any-res: base 24x24 + 2x2 tiles of 24x24, unpadded to 30x48 (864 padding cells cut),
        30 newline tokens dropped; base and tiles overlap and are mapped separately
        >>> lay.positions.size, lay.dropped
        (2016, {'newline': 30})
    """
    tile, patch = _vision(config)
    return anyres_layout(input_ids, image_size, image_token_id=config.image_token_id,
                         grid_pinpoints=config.image_grid_pinpoints, tile_px=tile, patch_px=patch)


def llava_onevision_layout(config: Any, input_ids: Any, image_size: Sequence[int], *,
                           vision_aspect_ratio: str | None = None) -> ImageTokenLayout:
    """LLaVA-OneVision, one image in the prompt (the any-resolution path; several images per prompt are packed
    without crops by the model and are not covered here). ``vision_aspect_ratio`` defaults to the config's.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(vision_config=NS(image_size=336, patch_size=14), image_token_id=9,
        ...          image_grid_pinpoints=[[336, 672], [672, 336], [672, 672]], vision_aspect_ratio="anyres_max_1")
        >>> lay = llava_onevision_layout(cfg, [9] * 1134, (500, 800))
        >>> [t.grid for t in lay.tiles], lay.dropped
        ([(24, 24), (18, 30)], {'newline': 18})
    """
    tile, patch = _vision(config)
    var = vision_aspect_ratio or getattr(config, "vision_aspect_ratio", "anyres_max_9")
    if not str(var).startswith("anyres_max_"):
        raise ArgumentError(f"vision_aspect_ratio: {var!r} is not 'anyres_max_N'")
    return anyres_layout(input_ids, image_size, image_token_id=config.image_token_id,
                         grid_pinpoints=config.image_grid_pinpoints, tile_px=tile, patch_px=patch,
                         family="LLaVA-OneVision", max_tiles=int(str(var)[len("anyres_max_"):]))
