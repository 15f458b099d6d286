"""A generative VLM whose tower runs on several crops of one image (``VlmFamily.crops``: LLaVA-NeXT/OneVision's
any-resolution tiles, Idefics3/SmolVLM's image splitting): its input, where each crop lies, and which projector
row each image token is.

- Input: the processor's ``pixel_values`` as a float tensor ``(1, n, 3, H, W)`` or ``(n, 3, H, W)`` (``n`` crops of
  one image at the tower's size), used as given; anything else is refused naming ``image`` before any model call.
- Crops: ``VlmFamily.crop_tiles`` names the layout tile each crop the tower runs becomes (``""``: a crop the LM
  never reads); ``VlmFamily.crop_boxes`` (or else the layout's tile of that name) says where the crop lies in the
  original image, padding undone.
- Projector: the projector runs per crop, so its output is ``(crops, rows, channels)``; image token ``i`` of layout
  tile ``T`` at cell ``(r, c)`` is row ``first + r * cols + c`` of the crop whose tile is ``T``, when exactly one crop
  makes that tile and its rows hold the tile's grid (``first`` leading rows, a class token, are not image tokens).

Example:
    >>> lay = ImageTokenLayout(np.arange(3), np.array([0, 1, 1]), np.array([0, 0, 0]), np.array([0, 0, 1]),
    ...                        (Tile("base", (1, 1)), Tile("t", (1, 2))), "demo")
    >>> [a.tolist() for a in projector_rows(lay, ("base", "t"), 2)]
    [[0, 1, 1], [1, 0, 1]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vitcam_nb.adapters.vlm_layout import ImageTokenLayout, Tile
from vitcam_nb.core.errors import TraceError

__all__ = ["crop_geometry", "crops_input", "crops_tensor", "projector_rows"]


def crops_tensor(image: object, size: tuple[int, int], family: str) -> torch.Tensor:
    """``image`` as a ``(1, n, 3, H, W)`` float32 tensor of crops at the tower's ``size``, or a TraceError naming
    ``image``.

    Example:
        >>> tuple(crops_tensor(torch.zeros(3, 3, 8, 8), (8, 8), "llava_next").shape)
        (1, 3, 3, 8, 8)
    """
    how = (f"{family} tiles the image: pass the processor's pixel_values (a float tensor (1, crops, 3, H, W)) as "
           "image and the processor's other outputs (e.g. image_sizes) in the target's model_kwargs")
    if not isinstance(image, torch.Tensor) or not image.is_floating_point():
        got = f"a {image.dtype} tensor" if isinstance(image, torch.Tensor) else type(image).__name__
        raise TraceError(f"image: got {got}; {how}")
    t = image[None] if image.ndim == 4 else image
    if t.ndim != 5 or t.shape[0] != 1 or t.shape[1] < 1 or t.shape[2] != 3:
        raise TraceError(f"image: got a tensor of shape {tuple(image.shape)}, expected (1, crops, 3, H, W) or "
                         f"(crops, 3, H, W) (one image's crops); {how}")
    if tuple(int(v) for v in t.shape[-2:]) != tuple(size):
        raise TraceError(f"image: crops of {t.shape[-2]}x{t.shape[-1]} px, but the tower takes {size[0]}x{size[1]} "
                         f"(config.vision_config.image_size); {how}")
    if not torch.isfinite(t).all():
        raise TraceError("image: contains NaN or inf values; expected finite pixel values")
    return t.detach().to(torch.float32)


def crops_input(model: torch.nn.Module, image: object, processor: object, size: tuple[int, int], family: str,
                config: dict) -> Any:
    """The :class:`~vitcam_nb.preprocess.PreparedInput` of a crops family: the crops tensor used as given, its
    display one de-normalised image per crop ``(n, H, W, 3)`` with the data ``config``'s mean and std.

    Example:
        >>> p = crops_input(None, torch.zeros(1, 2, 3, 4, 4), None, (4, 4), "llava_next",
        ...                 {"mean": (0.5,) * 3, "std": (0.5,) * 3})
        >>> tuple(p.tensor.shape), p.display.shape
        ((1, 2, 3, 4, 4), (2, 4, 4, 3))
    """
    from vitcam_nb.preprocess import PreparedInput  # the preprocessing module imports the adapters

    if processor is not None:
        raise TraceError(f"processor: {family} takes the processor's pixel_values as given; call the processor "
                         "yourself and pass pixel_values as image (image_sizes in the target's model_kwargs)")
    t = crops_tensor(image, size, family)
    facts = {"input_kind": "crops tensor (the processor's pixel_values, used as given)", "crops_given": int(t.shape[1]),
             "mean": [float(v) for v in config["mean"]], "std": [float(v) for v in config["std"]],
             "display": "each crop de-normalised with mean and std"}
    return PreparedInput(t, display_crops(t[0], config), facts)


def display_crops(pixels: torch.Tensor, config: dict) -> np.ndarray:
    """Crops ``(n, 3, H, W)`` as the model saw them, de-normalised to uint8 ``(n, H, W, 3)``.

    Example:
        >>> display_crops(torch.zeros(2, 3, 1, 1), {"mean": (0.5,) * 3, "std": (0.5,) * 3})[:, 0, 0, 0].tolist()
        [128, 128]
    """
    mean = torch.tensor(config["mean"], dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(config["std"], dtype=torch.float32).view(1, 3, 1, 1)
    x = (pixels.detach().to("cpu", torch.float32) * std + mean).clamp(0, 1)
    return np.round(x.permute(0, 2, 3, 1).numpy() * 255.0).astype(np.uint8)


def crop_geometry(layout: ImageTokenLayout, names: Sequence[str], boxes: Sequence[Tile] | None
                  ) -> list[Tile | None]:
    """The :class:`Tile` each crop covers (None: a crop the LM never reads): the family's ``boxes`` when given (one
    per crop), else the layout's tile named by the crop.

    Example:
        >>> lay = ImageTokenLayout.raster([0, 1], (1, 2))
        >>> crop_geometry(lay, ("image", ""), None)[0].box, crop_geometry(lay, ("image", ""), None)[1]
        ((0.0, 0.0, 1.0, 1.0), None)
    """
    if boxes is not None:
        if len(boxes) != len(names):
            raise TraceError(f"model: the family gives {len(boxes)} crop boxes for {len(names)} crops")
        return [b if n else None for n, b in zip(names, boxes)]
    by_name = {t.name: t for t in layout.tiles}
    missing = sorted({n for n in names if n and n not in by_name})
    if missing:
        raise TraceError(f"model: crops name tiles {missing} the image-token layout does not hold "
                         f"({[t.name for t in layout.tiles]})")
    return [by_name[n] if n else None for n in names]


def projector_rows(layout: ImageTokenLayout, names: Sequence[str], rows_per_crop: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(crop, row) of the projector output for every kept image token of ``layout``; a TraceError naming the
    ``projector`` site when a tile is not exactly one crop's projected rows (a resampled grid blends them).

    Example:
        >>> lay = ImageTokenLayout.raster([5, 6, 7, 8], (2, 2))
        >>> [a.tolist() for a in projector_rows(lay, ("image",), 5)]  # a class token first: rows 1..4
        [[0, 0, 0, 0], [1, 2, 3, 4]]
    """
    crop_of, first = {}, {}
    for k, tile in enumerate(layout.tiles):
        owners = [i for i, n in enumerate(names) if n == tile.name]
        cells = tile.grid[0] * tile.grid[1]
        if len(owners) != 1 or not 0 <= rows_per_crop - cells <= 1:
            why = (f"{len(owners)} crops make it" if len(owners) != 1 else
                   f"its {tile.grid[0]}x{tile.grid[1]} cells are not the crop's {rows_per_crop} projected rows")
            raise TraceError(f"sites: 'projector' is stored per image token, but layout tile {tile.name!r} is not "
                             f"one crop's projector rows ({why}: the model resamples or merges them after the "
                             "projector); trace lm_resid instead (its layer 0 is what the LM reads at each image "
                             "token)")
        crop_of[k], first[k] = owners[0], rows_per_crop - cells
    tiles = layout.tile_of
    crops = np.array([crop_of[int(t)] for t in tiles], dtype=np.int64)
    widths = np.array([layout.tiles[int(t)].grid[1] for t in tiles], dtype=np.int64)
    starts = np.array([first[int(t)] for t in tiles], dtype=np.int64)
    return crops, starts + layout.rows * widths + layout.cols
