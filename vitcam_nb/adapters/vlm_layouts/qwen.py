"""Qwen2-VL and Qwen2.5-VL layouts: 2x2 (``spatial_merge_size``) merged patches, raster order per image.

The processor resizes each image to a multiple of ``patch_size * merge`` (``smart_resize``: no padding, the
aspect ratio bent by at most one merge cell) and gives ``image_grid_thw`` = (t, h, w) in patches. The tower sees
the patches grouped by merge block ((h/m, w/m, m, m) order); the merger concatenates each block's ``m*m``
vectors into one token, so the LM reads ``h/m x w/m`` tokens per image in raster order, between the
vision-start and vision-end tokens.

Qwen2.5-VL's tower additionally runs most blocks on windows: it permutes the merge blocks into window order
(``window_size`` px windows, row-major windows, row-major blocks inside each) before its first block and
un-permutes the merged tokens after the merger, so the LM order is the same raster as Qwen2-VL's, but the tower
blocks' own token order is not: :func:`qwen_tower_cells` says which patch each tower position holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, Tile, VlmAnatomy, image_positions
from vitcam_nb.core.errors import ArgumentError

__all__ = ["QWEN2_5_VL_ANATOMY", "QWEN2_VL_ANATOMY", "qwen2_5_vl_layout", "qwen2_vl_layout", "qwen_tower_cells"]

QWEN2_VL_ANATOMY = VlmAnatomy(
    family="qwen2_vl", model_class="Qwen2VLForConditionalGeneration", vision_blocks="model.visual.blocks",
    projector="model.visual.merger", lm_layers="model.language_model.layers", image_token_key="image_token_id",
    notes="the merger is the projector: one output per 2x2 patch block; the LM forward needs "
          "mm_token_type_ids (1 at image tokens) for M-RoPE; tower tokens are patches in "
          "merge-block order (qwen_tower_cells); the LM reads merged tokens in raster order")
QWEN2_5_VL_ANATOMY = VlmAnatomy(
    family="qwen2_5_vl", model_class="Qwen2_5_VLForConditionalGeneration", vision_blocks="model.visual.blocks",
    projector="model.visual.merger", lm_layers="model.language_model.layers", image_token_key="image_token_id",
    notes="tower blocks see patches in window order (qwen_tower_cells with window_size), and so does the "
          "merger's own output (one row per merge block, window order): the tower un-permutes it after the "
          "merger, so a hook on the merger reads window order while the LM reads raster order; the LM forward "
          "needs mm_token_type_ids (1 at image tokens) for M-RoPE")


def _grid(grid_thw: Any, image_index: int) -> list[tuple[int, int, int]]:
    rows = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3).tolist()
    if not 0 <= image_index < len(rows):
        raise ArgumentError(f"image_index: {image_index} is not one of the {len(rows)} images in image_grid_thw")
    return [tuple(int(v) for v in r) for r in rows]


def qwen_tower_cells(grid_thw: Sequence[int], merge: int, *, window_size: int | None = None,
                     patch_size: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(frame, row, col) in patches of each position of the tower's token sequence for one image/video whose
    ``image_grid_thw`` row is ``grid_thw``; with ``window_size``/``patch_size`` (Qwen2.5-VL) in window order,
    the order the tower's blocks see.

    Example:
        >>> _, rows, cols = qwen_tower_cells((1, 4, 8), 2)  # raster merge blocks: the third is (0, 2)
        >>> rows[:12].tolist(), cols[8:12].tolist()
        ([0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1], [4, 5, 4, 5])
        >>> _, rows, cols = qwen_tower_cells((1, 4, 8), 2, window_size=56, patch_size=14)  # 2x2-block windows
        >>> rows[:12].tolist(), cols[8:12].tolist()
        ([0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 0, 1])
    """
    t, h, w = (int(v) for v in grid_thw)
    if h % merge or w % merge:
        raise ArgumentError(f"grid_thw: {h}x{w} patches are not a multiple of the {merge}x{merge} merge")
    bh, bw = h // merge, w // merge
    blocks = np.arange(t * bh * bw)  # merge blocks, raster per frame
    if window_size:
        if not patch_size:
            raise ArgumentError("patch_size: needed with window_size")
        win = int(window_size) // merge // int(patch_size)  # window side in merge blocks
        order = []
        for f in range(t):
            for wy in range(0, bh, win):
                for wx in range(0, bw, win):
                    for y in range(wy, min(wy + win, bh)):
                        order.extend(f * bh * bw + y * bw + np.arange(wx, min(wx + win, bw)))
        blocks = np.asarray(order, dtype=np.int64)
    f, rem = np.divmod(blocks, bh * bw)
    by, bx = np.divmod(rem, bw)
    sub_y, sub_x = np.divmod(np.arange(merge * merge), merge)  # the m*m patches of a block, row-major
    rows = (by[:, None] * merge + sub_y[None]).reshape(-1)
    cols = (bx[:, None] * merge + sub_x[None]).reshape(-1)
    return np.repeat(f, merge * merge), rows, cols


def _layout(config: Any, input_ids: Any, image_grid_thw: Any, image_index: int, family: str,
            extra: str) -> ImageTokenLayout:
    merge = int(config.vision_config.spatial_merge_size)
    grids = _grid(image_grid_thw, image_index)
    counts = [t * (h // merge) * (w // merge) for t, h, w in grids]
    pos = image_positions(input_ids, config.image_token_id)
    if pos.size != sum(counts):
        raise ArgumentError(f"input_ids: {pos.size} image tokens (id {config.image_token_id}) but image_grid_thw "
                            f"{[list(g) for g in grids]} packs {sum(counts)}")
    start = sum(counts[:image_index])
    t, h, w = grids[image_index]
    if t != 1:
        raise ArgumentError(f"image_grid_thw: image {image_index} has t={t}; one frame per image is expected")
    gh, gw = h // merge, w // merge
    lay = ImageTokenLayout.raster(pos[start:start + counts[image_index]], (gh, gw))
    patch = int(config.vision_config.patch_size)
    desc = (f"{family}: {h}x{w} patches of {patch} px (image resized to {h * patch}x{w * patch} px) merged "
            f"{merge}x{merge} into {gh}x{gw} tokens in raster order{extra}; image {image_index + 1} of "
            f"{len(grids)}; vision start/end tokens not mapped")
    return ImageTokenLayout(lay.positions, lay.tile_of, lay.rows, lay.cols, (Tile("image", (gh, gw)),), desc)


def qwen2_vl_layout(config: Any, input_ids: Any, image_grid_thw: Any, *, image_index: int = 0) -> ImageTokenLayout:
    """Qwen2-VL: ``config`` a ``Qwen2VLConfig``, ``input_ids`` one prompt's ids, ``image_grid_thw`` the
    processor's (n_images, 3) grid; the layout of image ``image_index`` of the prompt.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(vision_config=NS(spatial_merge_size=2, patch_size=14), image_token_id=9)
        >>> lay = qwen2_vl_layout(cfg, [7, 9, 9, 9, 9, 9, 9, 8], [[1, 4, 6]])
        >>> lay.positions.tolist(), lay.rows.tolist(), lay.cols.tolist()
        ([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2])
    """
    return _layout(config, input_ids, image_grid_thw, image_index, "Qwen2-VL", "")


def qwen2_5_vl_layout(config: Any, input_ids: Any, image_grid_thw: Any, *,
                      image_index: int = 0) -> ImageTokenLayout:
    """Qwen2.5-VL: as :func:`qwen2_vl_layout`; the description also states the tower's window order.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(vision_config=NS(spatial_merge_size=2, patch_size=14, window_size=112,
        ...                           fullatt_block_indexes=[7, 15, 23, 31]), image_token_id=9)
        >>> print(qwen2_5_vl_layout(cfg, [9] * 6, [[1, 4, 6]]).description)  # doctest: +NORMALIZE_WHITESPACE
        Qwen2.5-VL: 4x6 patches of 14 px (image resized to 56x84 px) merged 2x2 into 2x3 tokens in raster order
        (tower blocks run in windows of 4x4 tokens, full attention at blocks [7, 15, 23, 31]; merged tokens are
        put back in raster order before the LM); image 1 of 1; vision start/end tokens not mapped
    """
    vc = config.vision_config
    win = int(vc.window_size) // int(vc.spatial_merge_size) // int(vc.patch_size)
    extra = (f" (tower blocks run in windows of {win}x{win} tokens, full attention at blocks "
             f"{list(vc.fullatt_block_indexes)}; merged tokens are put back in raster order before the LM)")
    return _layout(config, input_ids, image_grid_thw, image_index, "Qwen2.5-VL", extra)
