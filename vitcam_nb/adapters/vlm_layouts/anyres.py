"""LLaVA-NeXT and LLaVA-OneVision any-resolution layouts: a base view, then the crops of the best-fit grid.

The model packs one image as: the base view's ``h x w`` patch tokens (the image squashed to one tile, raster
order), then the crops stitched into one ``(rows*h) x (cols*w)`` grid, unpadded (the feature rows/columns that
cover the processor's letterbox padding are cut, as ``unpad_image`` does), read row-major with one learned
newline token after each row. OneVision (``vision_aspect_ratio="anyres_max_N"``) then bilinearly shrinks the
unpadded grid when it holds more than about ``N`` tiles' worth of tokens (ratio > 1.1); each token is then a
blend of up to four cells, so the crops become one resampled grid over the image.

Two kinds of boxes (:class:`~vitcam_nb.adapters.vlm_layout.Tile`, fractions of the original image):

* the crops the TOWER ran on (:func:`anyres_crops`, the ``crop_box_*`` of a trace, which
  :func:`~vitcam_nb.compute.vlm_crops.stitch_crops` places tower maps by) are exact to the pixel: they follow the
  processor's own geometry (``get_patch_output_size``: an aspect-preserving resize of the image to fit the
  best-fit resolution, the short side rounded up; ``_get_padding_size``: centred padding, the odd pixel at the
  bottom/right), so crop pixel ``(y, x)`` lands where the processor took it from;
* the LM layout's tiles (:func:`anyres_layout`) place the image TOKENS as the model unpads them: the kept cells
  taken to cover the image exactly (``unpad_image`` rounds the letterbox to whole cells), so a tile's box edge is
  off the processor's padding by up to half a cell (4.6 px of the 60x70 test image, under 7 px of a 336 px
  tile's 14 px cells); the layout's description (the checklist's "image-token layout") says so.

The best-fit grid is chosen as the processor does: the pinpoint resolution that keeps the most of the image's
pixels after an aspect-preserving resize, the least wasted canvas on ties.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, Tile, VlmAnatomy, image_positions
from vitcam_nb.core.errors import ArgumentError

__all__ = [
    "LLAVA_NEXT_ANATOMY",
    "LLAVA_ONEVISION_ANATOMY",
    "anyres_crops",
    "anyres_layout",
    "best_fit_resolution",
    "llava_next_layout",
    "llava_onevision_layout",
    "processor_canvas",
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


def _square_box(image_size: Sequence[int]) -> tuple[float, float, float, float]:
    """The box of an image padded to a centred square (OneVision's multi-image base view)."""
    h0, w0 = int(image_size[0]), int(image_size[1])
    side = max(h0, w0)
    dy, dx = (side - h0) // 2 / h0, (side - w0) // 2 / w0
    return (-dy, -dx, side / h0 - dy, side / w0 - dx)


def _pack_one(image_size: Sequence[int], side: int, pinpoints: list, tile_px: int, max_tiles: int | None,
              newline: bool, crops: bool, family: str) -> tuple[list, list, list, list, np.ndarray, str]:
    """One image's (tiles, tile_of, rows, cols, keep-mask over its tokens, description)."""
    base_r, base_c = np.divmod(np.arange(side * side), side)
    if not crops:  # OneVision, several images in one prompt: the padded-square base view and one newline
        tiles = [Tile("base", (side, side), _square_box(image_size), group="base")]
        keep = np.r_[np.ones(side * side, bool), np.zeros(int(newline), bool)]
        text = (f"{family} multi-image: base {side}x{side} only (image padded to a square, no crops), "
                f"{int(newline)} newline tokens dropped")
        return tiles, [np.zeros(side * side, np.int64)], [base_r], [base_c], keep, text
    ph, pw = best_fit_resolution(image_size, pinpoints)
    nrow, ncol = ph // int(tile_px), pw // int(tile_px)
    top, bottom, left, right = _unpadded_span(image_size, (nrow * side, ncol * side))
    rr, cc = bottom - top, right - left
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
    keep = np.ones(side * side + out_r * (out_c + int(newline)), bool)
    if newline:
        keep[side * side + np.arange(1, out_r + 1) * (out_c + 1) - 1] = False
    cut = nrow * side * ncol * side - rr * cc
    text = (f"{family} any-res: base {side}x{side} + {nrow}x{ncol} tiles of {side}x{side}, unpadded to {rr}x{cc}"
            f" ({cut} padding cells cut){resampled}, {out_r if newline else 0} newline tokens dropped; "
            f"base and tiles overlap and are mapped separately; tile tokens placed as the model unpads them "
            f"(up to half a cell off the processor's padding)")
    return tiles, tile_of, rows, cols, keep, text


def processor_canvas(image_size: Sequence[int], resolution: Sequence[int]) -> tuple[int, int, int, int]:
    """(resized height, resized width, top padding, left padding) of an image of ``image_size`` packed into
    ``resolution`` by the processor (transformers' ``get_patch_output_size`` and LLaVA-NeXT/OneVision's
    ``_get_padding_size``, the same float operations).

    Example:
        >>> processor_canvas((60, 70), (64, 64))
        (55, 64, 4, 0)
    """
    original_height, original_width = int(image_size[0]), int(image_size[1])
    target_height, target_width = int(resolution[0]), int(resolution[1])
    scale_w, scale_h = target_width / original_width, target_height / original_height
    if scale_w < scale_h:
        new_width, new_height = target_width, min(math.ceil(original_height * scale_w), target_height)
    else:
        new_height, new_width = target_height, min(math.ceil(original_width * scale_h), target_width)
    return new_height, new_width, (target_height - new_height) // 2, (target_width - new_width) // 2


def anyres_crops(image_size: Sequence[int], *, grid_pinpoints: Any, tile_px: int, patch_px: int) -> tuple[Tile, ...]:
    """The base view and each crop of the best-fit grid as :class:`Tile` s, in the order the processor stacks them
    (base, then row-major), boxes in the original image exact to the pixel (the processor's resize and centred
    padding, :func:`processor_canvas`: a crop reaching into the padding has a box beyond 0..1 there), whether or
    not OneVision then resamples the crop grid (the crops the tower sees are the same).

    Example:
        >>> tiles = anyres_crops((40, 90), grid_pinpoints=[(32, 96)], tile_px=32, patch_px=8)  # 72 px + 2 x 12
        >>> [(t.name, [round(v * 72, 6) for v in t.box[1::2]]) for t in tiles[1:3]]  # left, right in resized px
        [('tile_r0_c0', [-12.0, 20.0]), ('tile_r0_c1', [20.0, 52.0])]
    """
    pins = [tuple(int(v) for v in p) for p in grid_pinpoints]
    side, tile = int(tile_px) // int(patch_px), int(tile_px)
    tiles = _pack_one(image_size, side, pins, tile, None, True, True, "")[0]
    ph, pw = best_fit_resolution(image_size, pins)
    nh, nw, top, left = processor_canvas(image_size, (ph, pw))
    ncol = pw // tile
    out = [tiles[0]]
    for k, t in enumerate(tiles[1:]):
        i, j = divmod(k, ncol)
        out.append(replace(t, box=((i * tile - top) / nh, (j * tile - left) / nw, ((i + 1) * tile - top) / nh,
                                   ((j + 1) * tile - left) / nw)))
    return tuple(out)


def anyres_layout(input_ids: Any, image_size: Any, *, image_token_id: int, grid_pinpoints: Any,
                  tile_px: int, patch_px: int, family: str = "LLaVA-NeXT", max_tiles: int | None = None,
                  newline: bool = True, crops: bool = True, image_index: int = 0) -> ImageTokenLayout:
    """The layout of image ``image_index`` in one prompt's ids; ``image_size`` is its (height, width) before
    processing, or one such row per image of the prompt (the processor's ``image_sizes``).

    ``tile_px``/``patch_px`` are the tower's input and patch sizes; ``max_tiles`` is OneVision's ``anyres_max_N``;
    ``crops=False`` is OneVision's multi-image packing (base view only). Raises :class:`ArgumentError` when the
    prompt's image tokens do not number what this layout packs.

    Example:
        >>> lay = anyres_layout([9] * 60, (40, 90), image_token_id=9, grid_pinpoints=[(32, 96)], tile_px=32,
        ...                     patch_px=8)  # a 4x12 cell canvas; the image fills 9 columns, 1 is cut each side
        >>> [t.name for t in lay.tiles], lay.dropped, lay.tiles[1].box
        (['base', 'tile_r0_c0', 'tile_r0_c1', 'tile_r0_c2'], {'newline': 4}, (0.0, -0.1, 1.0, 0.3))
    """
    sizes = np.asarray(image_size, dtype=np.int64).reshape(-1, 2)
    if not 0 <= image_index < len(sizes):
        raise ArgumentError(f"image_index: {image_index} is not one of the {len(sizes)} images in image_size")
    side = int(tile_px) // int(patch_px)
    pins = [tuple(p) for p in grid_pinpoints]
    packs = [_pack_one(sz, side, pins, tile_px, max_tiles, newline, crops, family) for sz in sizes.tolist()]
    counts = [p[4].size for p in packs]
    pos = image_positions(input_ids, image_token_id)
    if pos.size != sum(counts):
        raise ArgumentError(f"input_ids: {pos.size} image tokens (id {image_token_id}) but this {family} layout "
                            f"of image sizes {sizes.tolist()} packs {sum(counts)}")
    tiles, tile_of, rows, cols, keep, text = packs[image_index]
    pos = pos[sum(counts[:image_index]):sum(counts[:image_index + 1])]
    n_new = int((~keep).sum())
    desc = text + (f"; image {image_index + 1} of {len(sizes)}" if len(sizes) > 1 else "")
    return ImageTokenLayout(pos[keep], np.concatenate(tile_of), np.concatenate(rows), np.concatenate(cols),
                            tuple(tiles), desc, {"newline": n_new} if newline else {},
                            {"newline": pos[~keep]} if newline else {})


def _vision(config: Any) -> tuple[int, int]:
    vc = config.vision_config
    return int(vc.image_size), int(vc.patch_size)


def llava_next_layout(config: Any, input_ids: Any, image_size: Any, *, image_index: int = 0) -> ImageTokenLayout:
    """LLaVA-NeXT: ``config`` a ``LlavaNextConfig``, ``input_ids`` one prompt's ids, ``image_size`` the
    processor's ``image_sizes`` (original height, width; one row per image of the prompt, each packed with its
    own crops); the layout of image ``image_index``.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(vision_config=NS(image_size=336, patch_size=14), image_token_id=9,
        ...          image_grid_pinpoints=[[336, 672], [672, 336], [672, 672]])
        >>> lay = llava_next_layout(cfg, [1] + [9] * 2046 + [2], (500, 800))
        >>> print(lay.description)  # doctest: +NORMALIZE_WHITESPACE
        LLaVA-NeXT any-res: base 24x24 + 2x2 tiles of 24x24, unpadded to 30x48 (864 padding cells cut),
        30 newline tokens dropped; base and tiles overlap and are mapped separately; tile tokens placed as the
        model unpads them (up to half a cell off the processor's padding)
        >>> lay.positions.size, lay.dropped
        (2016, {'newline': 30})
    """
    tile, patch = _vision(config)
    return anyres_layout(input_ids, image_size, image_token_id=config.image_token_id,
                         grid_pinpoints=config.image_grid_pinpoints, tile_px=tile, patch_px=patch,
                         image_index=image_index)


def llava_onevision_layout(config: Any, input_ids: Any, image_size: Any, *, image_index: int = 0,
                           vision_aspect_ratio: str | None = None, crops: bool | None = None) -> ImageTokenLayout:
    """LLaVA-OneVision: as :func:`llava_next_layout`, with ``anyres_max_N`` (``vision_aspect_ratio``, the
    config's by default). A prompt with several images is packed without crops (each image padded to a square,
    its base view and one newline), as the model does when the processor's ``batch_num_images`` is above 1;
    ``crops`` overrides that (``True`` when the model is called without ``batch_num_images``).

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
                         family="LLaVA-OneVision", max_tiles=int(str(var)[len("anyres_max_"):]),
                         crops=(np.asarray(image_size).size == 2) if crops is None else crops,
                         image_index=image_index)
