"""Turn every accepted kind of ``images`` (list, array, iterator, folder, torch Dataset or DataLoader) into
items: an image, its label and mask, and where it came from.

Example:
    >>> import numpy as np
    >>> items, n = iter_items([np.zeros((4, 4, 3), np.uint8)], image_labels=[2], masks=None)
    >>> n, next(items).label
    (1, 2)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitcam_nb.core.errors import ArgumentTypeError, TraceError
from vitcam_nb.preprocess import PreparedInput, check_image, prepare_input

__all__ = ["IMAGE_SUFFIXES", "Item", "check_item", "check_items", "check_label", "iter_items", "prepare_item",
           "prepare_mask"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


@dataclass
class Item:
    """One image to trace, its ground-truth label (-1: unknown), mask (or None) and where it came from.

    Example:
        >>> Item(np.zeros((2, 2, 3), np.uint8), label=-1, mask=None, source="a.png").source
        'a.png'
    """

    image: Any
    label: int
    mask: np.ndarray | None
    source: str


def _label(value: Any, where: str) -> int:
    if value is None:
        return -1
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TraceError(f"image_labels: {where} has a label tensor of shape {tuple(value.shape)}; "
                             "expected one int")
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < -1:
        raise TraceError(f"image_labels: {where} has label {value!r}; expected a class index >= 0 (or -1/None "
                         "for unknown)")
    return int(value)


def _mask(value: Any, where: str) -> np.ndarray | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim != 2:
        raise TraceError(f"masks: {where} has a mask of shape {arr.shape}; expected (H, W)")
    return arr.astype(bool)


def _image(value: Any) -> Any:
    """A single image as prepare_input accepts it (uint8 torch tensors become HxWx3 arrays)."""
    if isinstance(value, torch.Tensor) and not value.is_floating_point():
        arr = value.detach().cpu().numpy()
        if arr.ndim == 3 and arr.shape[0] == 3 and arr.shape[-1] != 3:
            arr = np.moveaxis(arr, 0, -1)
        return np.ascontiguousarray(arr.astype(np.uint8))
    return value


def _unpack(obj: Any, where: str) -> tuple[Any, Any, Any]:
    """An item is an image, a tuple (image, label[, mask]) or a dict with image, label and mask keys."""
    if isinstance(obj, Mapping):
        if "image" not in obj:
            raise TraceError(f"images: {where} is a dict without an 'image' key (keys: {sorted(obj)})")
        return obj["image"], obj.get("label"), obj.get("mask")
    if isinstance(obj, tuple) or (isinstance(obj, list) and 2 <= len(obj) <= 3):
        if not 2 <= len(obj) <= 3:
            raise TraceError(f"images: {where} is a tuple of {len(obj)}; expected (image, label) or "
                             "(image, label, mask)")
        return obj[0], obj[1], obj[2] if len(obj) == 3 else None
    return obj, None, None


def _unbatch(batch: Any) -> Iterator[Any]:
    """Split one DataLoader batch into per-image items."""
    if isinstance(batch, torch.Tensor):
        yield from batch
        return
    if isinstance(batch, Mapping):
        n = len(batch["image"])
        for i in range(n):
            yield {k: batch[k][i] for k in ("image", "label", "mask") if k in batch}
        return
    if isinstance(batch, (tuple, list)) and 2 <= len(batch) <= 3:
        yield from zip(*batch)
        return
    raise TraceError(f"images: a DataLoader batch of type {type(batch).__name__} is not understood; expected a "
                     "tensor, (images, labels[, masks]) or a dict with 'image', 'label' and 'mask' keys")


def _folder(path: Path) -> list[Path]:
    if not path.is_dir():
        raise TraceError(f"images: {path} is not a folder of image files (pass a list, an iterator, a folder or a "
                         "torch DataLoader)")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise TraceError(f"images: folder {path} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
    return files


def _read_file(path: Path) -> Any:
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.convert("RGB") if im.mode not in ("I", "F") and not im.mode.startswith("I;") else im.copy()
    except (OSError, ValueError, SyntaxError) as exc:  # PIL's errors for a damaged or foreign file
        raise TraceError(f"images: {path} could not be read as an image ({exc}); remove or repair it") from exc


def iter_items(images: Any, image_labels: Any, masks: Any) -> tuple[Iterator[Item], int | None]:
    """Normalise every accepted kind of ``images`` into items, and the image count when it is known.

    Example:
        >>> items, n = iter_items(iter([np.zeros((4, 4, 3), np.uint8)]), None, None)
        >>> n, next(items).label
        (None, -1)
    """
    n: int | None
    sources: Iterable[str] | None = None
    if isinstance(images, (str, os.PathLike)):
        files = _folder(Path(images))
        raw: Iterable[Any] = (_read_file(f) for f in files)
        n, sources = len(files), [f.name for f in files]
    elif isinstance(images, torch.utils.data.DataLoader):
        raw, n = (item for batch in images for item in _unbatch(batch)), None
    elif isinstance(images, np.ndarray):
        if images.ndim != 4:
            raise TraceError(f"images: expected an array of images (N, H, W, 3), got shape {images.shape}")
        raw, n = iter(images), len(images)
    elif isinstance(images, torch.Tensor):
        if images.ndim != 4:
            raise TraceError(f"images: expected a tensor of images (N, 3, H, W), got shape {tuple(images.shape)}")
        raw, n = iter(images), len(images)
    elif isinstance(images, Sequence) and not isinstance(images, (str, bytes)):
        raw, n = iter(images), len(images)
    elif isinstance(images, torch.utils.data.Dataset) and hasattr(images, "__len__"):
        raw, n = (images[i] for i in range(len(images))), len(images)
    elif isinstance(images, Iterable):
        raw, n = iter(images), None
    else:
        raise ArgumentTypeError(f"images: expected a list, an iterator, a folder of image files or a torch DataLoader, "
                                f"got {type(images).__name__}")
    for name, extra in (("image_labels", image_labels), ("masks", masks)):
        if extra is not None and n is not None and len(extra) != n:
            raise TraceError(f"{name}: {len(extra)} values for {n} images")

    def generate() -> Iterator[Item]:
        src = iter(sources) if sources is not None else None
        for i, obj in enumerate(raw):
            where = f"image {i}"
            image, label, mask = _unpack(obj, where)
            if image_labels is not None:
                if label is not None:
                    raise TraceError(f"image_labels: {where} carries its own label; pass labels one way only")
                label = image_labels[i]
            if masks is not None:
                if mask is not None:
                    raise TraceError(f"masks: {where} carries its own mask; pass masks one way only")
                mask = masks[i]
            yield Item(_image(image), _label(label, where), _mask(mask, where), next(src) if src else "")

    return generate(), n


def _indexed(exc: TraceError | ArgumentTypeError, index: int, video: bool) -> TraceError | ArgumentTypeError:
    """The refusal of one item, of the same type, naming it by its index among ``images``."""
    rest = str(exc).removeprefix("image: ")
    return type(exc)(f"images: clip {index}: {rest}" if video else f"images[{index}]: {rest}")


def prepare_item(model: torch.nn.Module, adapter: Any, image: Any, processor: Any, index: int,
                 target: Any = None) -> PreparedInput:
    """One item prepared as the pass takes it: a video family's clip by its adapter (a clip that does not fit
    the model is refused naming the clip and both frame counts or sizes), an image by the model's data config
    (a bad one refused naming it, ``images[index]``). With the item's ``target`` (an answer target), as
    :func:`vitcam_nb.trace` prepares it: by the adapter's ``prepare_traced_input`` first (Qwen2-VL's packed
    ``pixel_values`` are read with the target's ``image_grid_thw``).

    Example:
        >>> import timm
        >>> from vitcam_nb.adapters.registry import find_adapter
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> tuple(prepare_item(m, find_adapter(m), np.zeros((224, 224, 3), np.uint8), None, 0).tensor.shape)
        (1, 3, 224, 224)
    """
    video = getattr(adapter, "video", False)
    try:
        if target is not None:
            prepared = adapter.prepare_traced_input(model, image, processor, target)
            if prepared is not None:
                return prepared
        return adapter.prepare_input(model, image, processor) if video else prepare_input(model, image, processor)
    except (TraceError, ArgumentTypeError) as exc:
        raise _indexed(exc, index, video) from exc


def check_item(model: torch.nn.Module, adapter: Any, image: Any, processor: Any, index: int,
               target: Any = None) -> None:
    """Refuse, before any pass, an item :func:`prepare_item` would refuse: an image by its type, shape, dtype and
    values, without resizing it; a video family's clip, or an item its ``target`` reads (a family whose adapter
    overrides ``prepare_traced_input``), by preparing it (one copy).

    Example:
        >>> import timm
        >>> from vitcam_nb.adapters.registry import find_adapter
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> check_item(m, find_adapter(m), "cat.png", None, 2)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ArgumentTypeError: images[2]: expected a PIL image, a numpy array (HxW or HxWxC), ... got str
    """
    if getattr(adapter, "video", False) or (target is not None and _reads_target(adapter)):
        prepare_item(model, adapter, image, processor, index, target)
        return
    try:
        check_image(image, processor)
    except (TraceError, ArgumentTypeError) as exc:
        raise _indexed(exc, index, False) from exc


def _reads_target(adapter: Any) -> bool:
    """Whether ``adapter`` prepares its input with the trace's target (overrides ``prepare_traced_input``)."""
    from vitcam_nb.adapters.base import Adapter

    return getattr(type(adapter), "prepare_traced_input", None) is not Adapter.prepare_traced_input


def check_label(label: int, index: int, classes: int) -> None:
    """Refuse an image label outside the model's ``classes`` (-1: unknown).

    Example:
        >>> check_label(-1, 0, 10)
    """
    if label >= classes:
        raise TraceError(f"image_labels: image {index} has label {label}; the model has {classes} classes "
                         f"(0..{classes - 1}, or -1/None)")


def _in_memory(images: Any) -> bool:
    """Whether ``images`` are held in memory (a list, array or tensor), so that reading them twice costs nothing; a
    folder, iterator, Dataset or DataLoader is read once, as it is traced."""
    return isinstance(images, (np.ndarray, torch.Tensor)) or (
        isinstance(images, Sequence) and not isinstance(images, (str, bytes)))


def check_items(images: Any, image_labels: Any, masks: Any, check: Callable[[Item, int], None],
                classes: int | None) -> None:
    """Refuse, before any pass, every input that is bad without the model's output: each ``image_labels`` value
    (its type, and the model's ``classes`` when given) and ``masks`` value (its shape), and for images held in
    memory (a list, array or tensor) each item: by ``check(item, index)`` (its image), its label, its mask's size.
    Images read from a folder, an iterator or a DataLoader are checked as each is read.

    Example:
        >>> check_items([np.zeros((4, 4, 3), np.uint8)], [7], None, lambda item, i: None, classes=5)
        Traceback (most recent call last):
        ...
        vitcam_nb.core.errors.TraceError: image_labels: image 0 has label 7; the model has 5 classes (0..4, or -1/None)
    """
    if _in_memory(images):
        for i, item in enumerate(iter_items(images, image_labels, masks)[0]):
            check(item, i)
            if classes is not None:
                check_label(item.label, i, classes)
            if item.mask is not None:
                _check_mask_size(item, i)
        return
    # Labels and masks given beside lazily read images are in memory: checked here, not when each image is read.
    for i, value in enumerate(image_labels if _in_memory(image_labels) else ()):
        label = _label(value, f"image {i}")
        if classes is not None:
            check_label(label, i, classes)
    for i, value in enumerate(masks if _in_memory(masks) else ()):
        _mask(value, f"image {i}")


def _check_mask_size(item: Item, index: int) -> None:
    """Refuse a mask of another size than its image (a tensor used as given: its own H x W)."""
    if isinstance(item.image, torch.Tensor):
        hw = tuple(item.image.shape[-2:])
        if item.mask.shape != hw:
            raise TraceError(f"masks: image {index} is a tensor used as given ({hw[0]}x{hw[1]}), but its "
                             f"mask is {item.mask.shape[0]}x{item.mask.shape[1]}")
        return
    size = item.image.shape[:2] if isinstance(item.image, np.ndarray) else item.image.size[::-1]
    if item.mask.shape != tuple(size):
        raise TraceError(f"masks: image {index} is {size[0]}x{size[1]} but its mask is "
                         f"{item.mask.shape[0]}x{item.mask.shape[1]}")


def prepare_mask(model: torch.nn.Module, item: Item, index: int) -> np.ndarray | None:
    """The mask in the model input's geometry: it goes through the image's own resize and crop.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> image, mask = np.zeros((112, 112, 3), np.uint8), np.ones((112, 112), bool)
        >>> prepare_mask(m, Item(image, 0, mask, ""), 0).shape
        (224, 224)
    """
    if item.mask is None:
        return None
    _check_mask_size(item, index)
    if isinstance(item.image, torch.Tensor):
        return item.mask
    rgb = np.repeat(item.mask[..., None].astype(np.uint8) * 255, 3, axis=-1)
    return prepare_input(model, rgb).display[..., 0] >= 128
