"""Idefics3 and SmolVLM layouts: image split into a grid of tiles plus a global view, each pixel-shuffled.

The image processor resizes the image to whole multiples of the tile size (``max_image_size``; a resize, so
the aspect ratio bends slightly and nothing is padded) and cuts it into ``rows x cols`` tiles, row-major, then
appends the whole image squashed to one tile (the global view); a small image is not split (``rows = cols =
0``: the global view only). The tower turns each tile into ``p x p`` patches; the connector's pixel shuffle
concatenates each ``s x s`` block of patches (``scale_factor`` s) into one token, so a tile gives ``p/s x p/s``
tokens in raster order. The prompt holds, per tile, ``<fake_token_around_image><row_r_col_c>`` then its image
tokens, a newline after each row of tiles, and ``<fake_token_around_image><global-img>`` before the global view's
tokens: those text tokens carry no image cell and are not mapped. Tiles cover the image without overlap and
are stitched; the global view overlaps them and is mapped separately.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, Tile, VlmAnatomy, image_positions
from vitcam_nb.core.errors import ArgumentError

__all__ = ["IDEFICS3_ANATOMY", "SMOLVLM_ANATOMY", "idefics3_layout", "shuffle_patches", "smolvlm_layout"]

_NOTES = ("tower's last layer per tile -> connector (pixel shuffle by scale_factor, then modality_projection) "
          "-> tiles row-major then the global view; all-zero padding images are skipped by the model")
IDEFICS3_ANATOMY = VlmAnatomy(
    family="idefics3", model_class="Idefics3ForConditionalGeneration",
    vision_blocks="model.vision_model.encoder.layers", projector="model.connector",
    lm_layers="model.text_model.layers", image_token_key="image_token_id", notes=_NOTES)
SMOLVLM_ANATOMY = VlmAnatomy(
    family="smolvlm", model_class="SmolVLMForConditionalGeneration",
    vision_blocks="model.vision_model.encoder.layers", projector="model.connector",
    lm_layers="model.text_model.layers", image_token_key="image_token_id", notes=_NOTES)


def _per_image(v: int | Sequence[int], name: str) -> list[int]:
    out = [int(v)] if np.ndim(v) == 0 else [int(x) for x in np.asarray(v).reshape(-1)]
    if any(x < 0 for x in out):
        raise ArgumentError(f"{name}: tile counts must be >= 0, got {out}")
    return out


def _layout(config: Any, input_ids: Any, rows: int | Sequence[int], cols: int | Sequence[int],
            image_index: int, family: str) -> ImageTokenLayout:
    vc = config.vision_config
    p, s = int(vc.image_size) // int(vc.patch_size), int(config.scale_factor)
    if p % s:
        raise ArgumentError(f"config: {p}x{p} patches per tile do not pixel-shuffle by scale_factor {s}")
    g = p // s
    rs, cs = _per_image(rows, "rows"), _per_image(cols, "cols")
    if len(rs) != len(cs) or any((r == 0) != (c == 0) for r, c in zip(rs, cs)):
        raise ArgumentError(f"rows/cols: {rs} and {cs} do not describe the same images (0 only together)")
    if not 0 <= image_index < len(rs):
        raise ArgumentError(f"image_index: {image_index} is not one of the {len(rs)} images given by rows/cols")
    counts = [(r * c + 1) * g * g for r, c in zip(rs, cs)]
    pos = image_positions(input_ids, config.image_token_id)
    if pos.size != sum(counts):
        raise ArgumentError(f"input_ids: {pos.size} image tokens (id {config.image_token_id}) but rows {rs} x cols "
                            f"{cs} tiles (+ a global view each) of {g}x{g} tokens pack {sum(counts)}")
    pos = pos[sum(counts[:image_index]):sum(counts[:image_index + 1])]
    nr, nc = rs[image_index], cs[image_index]
    tiles = [Tile(f"tile_r{r}_c{c}", (g, g), (r / nr, c / nc, (r + 1) / nr, (c + 1) / nc), group="tiles")
             for r in range(nr) for c in range(nc)] + [Tile("global", (g, g), group="global")]
    cell_r, cell_c = np.divmod(np.arange(g * g), g)
    n_t = len(tiles)
    split = f"split into {nr}x{nc} tiles + a global view" if nr else "not split (global view only)"
    desc = (f"{family}: image {split}, each {p}x{p} patches pixel-shuffled {s}x{s} into {g}x{g} tokens "
            f"(raster); <fake_token_around_image>/<row_r_col_c>/<global-img> text tokens not mapped; tiles "
            f"stitched, the global view mapped separately; image {image_index + 1} of {len(rs)}")
    return ImageTokenLayout(pos, np.repeat(np.arange(n_t), g * g), np.tile(cell_r, n_t), np.tile(cell_c, n_t),
                            tuple(tiles), desc)


def idefics3_layout(config: Any, input_ids: Any, rows: int | Sequence[int], cols: int | Sequence[int], *,
                    image_index: int = 0) -> ImageTokenLayout:
    """Idefics3: ``config`` an ``Idefics3Config``, ``input_ids`` one prompt's ids, ``rows``/``cols`` the image
    processor's tile grid (``return_row_col_info=True``), one int per image of the prompt.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(vision_config=NS(image_size=512, patch_size=16), scale_factor=4, image_token_id=9)
        >>> lay = idefics3_layout(cfg, [9] * 64 * 7, 2, 3)
        >>> [t.name for t in lay.tiles][::3], lay.tiles[1].box[1:3]
        (['tile_r0_c0', 'tile_r1_c0', 'global'], (0.3333333333333333, 0.5))
    """
    return _layout(config, input_ids, rows, cols, image_index, "Idefics3")


def smolvlm_layout(config: Any, input_ids: Any, rows: int | Sequence[int], cols: int | Sequence[int], *,
                   image_index: int = 0) -> ImageTokenLayout:
    """SmolVLM: as :func:`idefics3_layout` (same split, shuffle and prompt template).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(vision_config=NS(image_size=512, patch_size=16), scale_factor=4, image_token_id=9)
        >>> smolvlm_layout(cfg, [9] * 64, 0, 0).description.split(",")[0]
        'SmolVLM: image not split (global view only)'
    """
    return _layout(config, input_ids, rows, cols, image_index, "SmolVLM")


def shuffle_patches(config: Any) -> np.ndarray:
    """(g*g, s*s, 2): for each token of a tile (raster), the (row, col) of the ``s x s`` tower patches it
    concatenates, in the order their channels are concatenated.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(vision_config=NS(image_size=512, patch_size=16), scale_factor=4)
        >>> shuffle_patches(cfg)[1, :5].tolist()  # token (0, 1): patches (0, 4), (0, 5), ... row by row
        [[0, 4], [0, 5], [0, 6], [0, 7], [1, 4]]
    """
    vc = config.vision_config
    p, s = int(vc.image_size) // int(vc.patch_size), int(config.scale_factor)
    g = p // s
    ti, tj = np.divmod(np.arange(g * g), g)
    a, b = np.divmod(np.arange(s * s), s)
    return np.stack([ti[:, None] * s + a[None], tj[:, None] * s + b[None]], axis=-1)
