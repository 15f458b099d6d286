"""The any-resolution LLaVA families as :class:`~vitcam_nb.adapters.hf_vlm.VlmFamily` rows: LLaVA-NeXT
(``LlavaNextForConditionalGeneration``, a CLIP tower) and LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``,
a SigLIP tower), read from transformers 5's ``modeling_llava_next.py`` and ``modeling_llava_onevision.py``.

Both run the tower on several crops of one image (``crops=True``): the processor's ``pixel_values`` hold, per
image, the base view (the image squashed to one tile) then the crops of the best-fit grid in row-major order, and
the model keeps the first ``image_size_to_num_patches(image_sizes)`` of them (a batch of images is padded to the
longest). Their image-token layouts are :func:`~vitcam_nb.adapters.vlm_layouts.llava_next_layout` and
:func:`~vitcam_nb.adapters.vlm_layouts.llava_onevision_layout`, which read the target's ``image_sizes``
(``vc.targets.answer(..., model_kwargs={"image_sizes": ...})``). One image per prompt: OneVision's multi-image
packing (``batch_num_images``) is refused by name.

Crop ``0`` becomes layout tile ``base``, crop ``1 + i * cols + j`` tile ``tile_r{i}_c{j}``; when OneVision's
``anyres_max_N`` shrinks the unpadded crop grid, every crop after the base becomes part of the one resampled tile
``tiles`` (each token then blends cells of up to four crops), and :func:`anyres_crop_boxes` still says where each
crop lies in the image. The ``projector`` site is then refused (``adapters.vlm_crops.projector_rows``): per LM
token the blended projector output is exactly ``lm_resid`` at layer 0, and the rows before the resize are one per
crop cell, a token set the trace has no variable for.

Example:
    >>> sorted(name for name in VLM_FAMILIES if name.startswith("llava_"))
    ['llava_next', 'llava_onevision']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.hf_vlm import VLM_FAMILIES, VlmFamily, register_vlm_family
from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, Tile
from vitcam_nb.adapters.vlm_layouts.anyres import (
    LLAVA_NEXT_ANATOMY,
    LLAVA_ONEVISION_ANATOMY,
    anyres_crops,
    llava_next_layout,
    llava_onevision_layout,
)
from vitcam_nb.core.errors import ArgumentError, TraceError

__all__ = ["anyres_crop_boxes", "anyres_crop_tiles", "image_size_of", "next_layout", "onevision_layout"]

#: the tower each family's row is written for: (config model_type, whether it has a class token)
_TOWERS = {"llava_next": ("clip_vision_model", ("cls",)), "llava_onevision": ("siglip_vision_model", ())}


def image_size_of(model: torch.nn.Module, extra: Mapping[str, Any] | None) -> tuple[int, int]:
    """The one image's original (height, width) from the target's ``image_sizes``; refused when missing, when
    it holds several images, or when OneVision is asked to pack several images (``batch_num_images``).

    Example:
        >>> image_size_of(torch.nn.Module(), {"image_sizes": [[40, 90]]})
        (40, 90)
    """
    extra = dict(extra or {})
    name = type(model).__name__
    if extra.get("image_sizes") is None:
        raise TraceError(f"model_kwargs: {name} needs the processor's image_sizes (the original height and width "
                         "the crops were cut from): vc.targets.answer(..., model_kwargs={'image_sizes': ...})")
    sizes = extra["image_sizes"]
    sizes = np.asarray(sizes.detach().cpu() if isinstance(sizes, torch.Tensor) else sizes, dtype=np.float64)
    if sizes.size != 2 or not np.all(np.isfinite(sizes)) or np.any(sizes < 1) or np.any(sizes != np.round(sizes)):
        raise TraceError(f"model_kwargs: image_sizes must be one image's (height, width) in pixels, e.g. "
                         f"[[{336}, {504}]]; got shape {sizes.shape} (a trace explains one image)")
    bni = extra.get("batch_num_images")
    if bni is not None and int(np.asarray(bni.cpu() if isinstance(bni, torch.Tensor) else bni).sum()) != 1:
        raise TraceError("model_kwargs: batch_num_images packs several images per prompt (OneVision then drops "
                         "the crops); a trace explains one image")
    h, w = sizes.reshape(2).astype(np.int64).tolist()
    return int(h), int(w)


def _check_tower(model: torch.nn.Module, family: str) -> None:
    kind, prefix = _TOWERS[family]
    got = str(getattr(model.config.vision_config, "model_type", ""))
    if got != kind:
        cls = "a class token" if prefix else "no class token"
        raise TraceError(f"model: the {family} row reads a {kind} tower ({cls} in front of the patches); "
                         f"{type(model).__name__}'s tower is {got!r}")


def _wrapped(fn: Any, model: torch.nn.Module, ids: np.ndarray, extra: Mapping[str, Any], **kw: Any
             ) -> ImageTokenLayout:
    try:
        return fn(model.config, ids, image_size_of(model, extra), **kw)
    except ArgumentError as exc:
        raise TraceError(f"input_ids: {exc}") from exc


def next_layout(model: torch.nn.Module, ids: np.ndarray, grid: tuple[int, int],
                extra: Mapping[str, Any] | None = None) -> ImageTokenLayout:
    """LLaVA-NeXT's layout of the prompt ``ids`` for the image of the target's ``image_sizes``.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> m = torch.nn.Module()
        >>> m.config = NS(vision_config=NS(image_size=32, patch_size=8, model_type="clip_vision_model"),
        ...               image_grid_pinpoints=[[32, 64]], image_token_id=9)
        >>> next_layout(m, np.array([9] * 34), (4, 4), {"image_sizes": [[24, 90]]}).dropped
        {'newline': 2}
    """
    _check_tower(model, "llava_next")
    return _wrapped(llava_next_layout, model, ids, extra or {})


def onevision_layout(model: torch.nn.Module, ids: np.ndarray, grid: tuple[int, int],
                     extra: Mapping[str, Any] | None = None) -> ImageTokenLayout:
    """LLaVA-OneVision's layout (``anyres_max_N`` from the target's ``vision_aspect_ratio`` or the config).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> m = torch.nn.Module()
        >>> m.config = NS(vision_config=NS(image_size=32, patch_size=8, model_type="siglip_vision_model"),
        ...               image_grid_pinpoints=[[64, 64]], image_token_id=9, vision_aspect_ratio="anyres_max_1")
        >>> [t.grid for t in onevision_layout(m, np.array([9] * 31), (4, 4), {"image_sizes": [[60, 70]]}).tiles]
        [(4, 4), (3, 4)]
    """
    _check_tower(model, "llava_onevision")
    extra = extra or {}
    own = getattr(model.config, "vision_aspect_ratio", "anyres_max_9")
    if extra.get("vision_aspect_ratio") not in (None, own):
        # transformers 5's forward takes the argument but packs with the config's value
        raise TraceError(f"model_kwargs: vision_aspect_ratio={extra['vision_aspect_ratio']!r}, but the model packs "
                         f"its image features with its config's {own!r}; leave it out")
    return _wrapped(llava_onevision_layout, model, ids, extra, crops=True, vision_aspect_ratio=own)


def _geometry(model: torch.nn.Module, extra: Mapping[str, Any]) -> list[Tile]:
    """The Tile of every crop (base first, then row-major), boxes in the original image exact to the pixel, as
    the processor cuts the crop grid (no resampling)."""
    vc = model.config.vision_config
    return list(anyres_crops(image_size_of(model, extra), grid_pinpoints=model.config.image_grid_pinpoints,
                             tile_px=int(vc.image_size), patch_px=int(vc.patch_size)))


def anyres_crop_tiles(model: torch.nn.Module, ids: np.ndarray, extra: Mapping[str, Any]) -> tuple[str, ...]:
    """The layout tile each tower crop becomes, in the tower's order: ``base``, then ``tile_r{i}_c{j}`` row-major
    (``tiles`` for every one of them when OneVision resamples the crop grid into one tile).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> m = torch.nn.Module()
        >>> m.config = NS(vision_config=NS(image_size=32, patch_size=8), image_grid_pinpoints=[[32, 64]],
        ...               image_token_id=9)
        >>> anyres_crop_tiles(m, np.array([9] * 34), {"image_sizes": [[24, 90]]})
        ('base', 'tile_r0_c0', 'tile_r0_c1')
    """
    tiles = _geometry(model, extra)
    names = [t.name for t in tiles]
    if type(model).__name__ == LLAVA_ONEVISION_ANATOMY.model_class:
        lay = onevision_layout(model, ids, (0, 0), extra)
        if [t.name for t in lay.tiles] == ["base", "tiles"]:  # anyres_max shrank the crop grid into one tile
            names = ["base"] + ["tiles"] * (len(tiles) - 1)
    return tuple(names)


def anyres_crop_boxes(model: torch.nn.Module, ids: np.ndarray, extra: Mapping[str, Any]) -> tuple[Tile, ...]:
    """Where each tower crop lies in the original image, exact to the pixel (the processor's resize and centred
    padding undone: :func:`~vitcam_nb.adapters.vlm_layouts.anyres.anyres_crops`): the base view covers it whole,
    crop ``tile_r{i}_c{j}`` its cell of the best-fit grid; the same whether OneVision resamples the grid after the
    projector or not (the crops the tower sees do not change). The 60x70 image below is resized to 55x64 and
    padded 4 px on top in a 64x64 canvas, so crop 1's 32 px rows run from image fraction -4/55 to 28/55.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> m = torch.nn.Module()
        >>> m.config = NS(vision_config=NS(image_size=32, patch_size=8), image_grid_pinpoints=[[64, 64]])
        >>> [t.box for t in anyres_crop_boxes(m, np.array([]), {"image_sizes": [[60, 70]]})][1]
        (-0.07272727272727272, 0.0, 0.509090909090909, 0.5)
    """
    return tuple(_geometry(model, extra))


register_vlm_family(VlmFamily(
    "llava_next", (LLAVA_NEXT_ANATOMY.model_class,), tower="model.vision_tower",
    projector=LLAVA_NEXT_ANATOMY.projector, lm_layers=LLAVA_NEXT_ANATOMY.lm_layers, layout=next_layout,
    tower_prefix=_TOWERS["llava_next"][1], crops=True, crop_tiles=anyres_crop_tiles,
    crop_boxes=anyres_crop_boxes), replace="llava_next" in VLM_FAMILIES)
register_vlm_family(VlmFamily(
    "llava_onevision", (LLAVA_ONEVISION_ANATOMY.model_class,), tower="model.vision_tower",
    projector=LLAVA_ONEVISION_ANATOMY.projector, lm_layers=LLAVA_ONEVISION_ANATOMY.lm_layers,
    layout=onevision_layout, tower_prefix=_TOWERS["llava_onevision"][1], crops=True, crop_tiles=anyres_crop_tiles,
    crop_boxes=anyres_crop_boxes), replace="llava_onevision" in VLM_FAMILIES)
