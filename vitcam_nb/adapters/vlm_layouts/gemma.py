"""PaliGemma and Gemma 3 layouts: one square SigLIP grid per image, image tokens before (or inside) the prompt.

PaliGemma: the processor puts ``(image_size / patch_size)**2`` image tokens per image at the very start of the
sequence, before ``<bos>`` and the prompt; each token is one tower patch, raster order (the projector is a
linear map per patch). Gemma 3: the projector average-pools the tower's ``p x p`` patch grid with a
``k x k`` kernel (``k = p / sqrt(mm_tokens_per_image)``) into ``mm_tokens_per_image`` tokens, raster order,
written between a begin-of-image and an end-of-image token wherever the prompt holds the image. With
pan-and-scan, Gemma 3's processor adds crops as further images; each is mapped onto its own crop, and where the
crop sits on the original image is not reconstructed here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, Tile, VlmAnatomy, image_positions
from vitcam_nb.core.errors import ArgumentError

__all__ = ["GEMMA3_ANATOMY", "PALIGEMMA_ANATOMY", "gemma3_layout", "gemma3_patch_token", "paligemma_layout",
           "paligemma_token_types"]

PALIGEMMA_ANATOMY = VlmAnatomy(
    family="paligemma", model_class="PaliGemmaForConditionalGeneration",
    vision_blocks="model.vision_tower.encoder.layers", projector="model.multi_modal_projector",
    lm_layers="model.language_model.layers", image_token_key="image_token_id",
    notes="tower's last layer -> linear projector per patch -> image tokens first in the sequence; the prefix "
          "(image + prompt) attends bidirectionally when token_type_ids mark it")
GEMMA3_ANATOMY = VlmAnatomy(
    family="gemma3", model_class="Gemma3ForConditionalGeneration",
    vision_blocks="model.vision_tower.encoder.layers", projector="model.multi_modal_projector",
    lm_layers="model.language_model.layers", image_token_key="image_token_id",
    notes="the projector average-pools the patch grid to mm_tokens_per_image tokens before its norm and "
          "matmul, so its output is per pooled token, its input per patch; image tokens sit between "
          "boi_token_id and eoi_token_id")


def _run(config: Any, input_ids: Any, per_image: int, image_index: int) -> tuple[np.ndarray, int]:
    pos = image_positions(input_ids, config.image_token_id)
    if per_image < 1 or pos.size % per_image:
        raise ArgumentError(f"input_ids: {pos.size} image tokens (id {config.image_token_id}) are not a whole "
                            f"number of images of {per_image} tokens")
    n = pos.size // per_image
    if not 0 <= image_index < n:
        raise ArgumentError(f"image_index: {image_index} is not one of the {n} images in input_ids")
    return pos[image_index * per_image:(image_index + 1) * per_image], n


def paligemma_layout(config: Any, input_ids: Any, *, image_index: int = 0) -> ImageTokenLayout:
    """PaliGemma: ``config`` a ``PaliGemmaConfig``, ``input_ids`` one prompt's ids (image tokens first).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(vision_config=NS(image_size=224, patch_size=14), image_token_id=9)
        >>> print(paligemma_layout(cfg, [9] * 256 + [2, 5, 6]).description)  # doctest: +NORMALIZE_WHITESPACE
        PaliGemma: 16x16 SigLIP patches of 14 px, one token each, raster order, before the prompt
        (positions 0..255); image 1 of 1
    """
    side = int(config.vision_config.image_size) // int(config.vision_config.patch_size)
    pos, n = _run(config, input_ids, side * side, image_index)
    where = "before the prompt" if pos[0] == image_index * side * side else f"from position {pos[0]}"
    desc = (f"PaliGemma: {side}x{side} SigLIP patches of {config.vision_config.patch_size} px, one token each, "
            f"raster order, {where} (positions {pos[0]}..{pos[-1]}); image {image_index + 1} of {n}")
    lay = ImageTokenLayout.raster(pos, (side, side))
    return ImageTokenLayout(lay.positions, lay.tile_of, lay.rows, lay.cols, (Tile("image", (side, side)),), desc)


def gemma3_layout(config: Any, input_ids: Any, *, image_index: int = 0) -> ImageTokenLayout:
    """Gemma 3: ``config`` a ``Gemma3Config``, ``input_ids`` one prompt's ids; each token is the mean of a
    ``k x k`` block of tower patches, stated in the description.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(vision_config=NS(image_size=224, patch_size=14), image_token_id=9, mm_tokens_per_image=64,
        ...          boi_token_id=3, eoi_token_id=4)
        >>> print(gemma3_layout(cfg, [2, 3] + [9] * 64 + [4]).description)  # doctest: +NORMALIZE_WHITESPACE
        Gemma 3: 16x16 SigLIP patches average-pooled 2x2 into 8x8 tokens, raster order, between begin/end-of-image
        tokens (positions 2..65); image 1 of 1; pan-and-scan crops, if any, are mapped onto their crop, not
        placed on the original
    """
    patches = int(config.vision_config.image_size) // int(config.vision_config.patch_size)
    side = math.isqrt(int(config.mm_tokens_per_image))
    if side * side != int(config.mm_tokens_per_image) or patches % side:
        raise ArgumentError(f"config: mm_tokens_per_image={config.mm_tokens_per_image} is not a square dividing "
                            f"the {patches}x{patches} patch grid")
    k = patches // side
    pos, n = _run(config, input_ids, side * side, image_index)
    ids = np.asarray(input_ids)
    framed = (pos[0] > 0 and ids[pos[0] - 1] == config.boi_token_id and pos[-1] + 1 < ids.size
              and ids[pos[-1] + 1] == config.eoi_token_id)
    desc = (f"Gemma 3: {patches}x{patches} SigLIP patches average-pooled {k}x{k} into {side}x{side} tokens, "
            f"raster order, {'between begin/end-of-image tokens' if framed else 'without begin/end-of-image'} "
            f"(positions {pos[0]}..{pos[-1]}); image {image_index + 1} of {n}; pan-and-scan crops, if any, are "
            f"mapped onto their crop, not placed on the original")
    lay = ImageTokenLayout.raster(pos, (side, side))
    return ImageTokenLayout(lay.positions, lay.tile_of, lay.rows, lay.cols, (Tile("image", (side, side)),), desc)


def gemma3_patch_token(config: Any) -> np.ndarray:
    """For each tower patch (raster over the ``p x p`` grid), the index of the pooled image token it feeds.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(vision_config=NS(image_size=224, patch_size=14), mm_tokens_per_image=64)
        >>> gemma3_patch_token(cfg)[[0, 1, 2, 16, 17, 32]].tolist()
        [0, 0, 1, 0, 0, 8]
    """
    patches = int(config.vision_config.image_size) // int(config.vision_config.patch_size)
    side = math.isqrt(int(config.mm_tokens_per_image))
    k = patches // side
    r, c = np.divmod(np.arange(patches * patches), patches)
    return (r // k) * side + c // k


def paligemma_token_types(model: object, seq: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """PaliGemma's token types: 0 over the prefix (image and prompt), 1 over the answer, as its processor gives a
    suffix and ``generate`` extends the prompt's ids.

    Example:
        >>> paligemma_token_types(None, torch.tensor([5, 5, 2, 9, 10]), 3).tolist()
        [0, 0, 0, 1, 1]
    """
    out = torch.ones_like(seq)
    out[:n_prompt] = 0
    return out
