"""Turn a user's image into the model input tensor and a uint8 display copy, with timm's data config.

Example:
    >>> import numpy as np, timm
    >>> prepare_input(timm.create_model("vit_tiny_patch16_224"), np.zeros((8, 8, 3), np.uint8)).display.shape
    (224, 224, 3)
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from vitcam_nb.adapters.hf_processor import processor_facts, processor_normalisation, run_processor
from vitcam_nb.adapters.registry import find_adapter
from vitcam_nb.core.errors import ArgumentTypeError, TraceError, user_stacklevel
from vitcam_nb.core.input_geometry import Geometry

__all__ = ["InputCropWarning", "PreparedInput", "check_image", "data_config", "prepare_input", "preprocessing_json",
           "to_pixels"]

_PROCESSOR_WITH_TENSOR = ("processor: given with a float tensor image, which is used as given (already normalised); "
                          "drop the processor, or pass the PIL image or pixel array")


@dataclass
class PreparedInput:
    """The model input (1, 3, H, W), its uint8 display copy (H, W, 3) and how it was made.

    Example:
        >>> import timm
        >>> p = prepare_input(timm.create_model("vit_tiny_patch16_224"), torch.zeros(1, 3, 224, 224))
        >>> p.preprocessing["input_kind"], p.display.dtype
        ('tensor (used as given)', dtype('uint8'))
    """

    tensor: torch.Tensor
    display: np.ndarray
    preprocessing: dict


def data_config(model: torch.nn.Module) -> dict:
    """The model's timm data config (input size, mean, std, crop, interpolation).

    Example:
        >>> import timm
        >>> data_config(timm.create_model("vit_tiny_patch16_224"))["input_size"]
        (3, 224, 224)
    """
    from timm.data import resolve_data_config

    try:
        own = find_adapter(model).data_config(model)
    except TypeError:  # no adapter: timm's resolver still gives a usable default
        own = None
    # Families without a timm pretrained_cfg (e.g. open_clip) state their own preprocessing.
    if own is not None:
        return dict(own)
    cfg = resolve_data_config(model=model)
    pe = getattr(model, "patch_embed", None)
    size = getattr(pe, "img_size", None)
    # timm's config keeps the pretrained size (e.g. 224) even for a model built at another img_size.
    if size is not None and not getattr(model, "dynamic_img_size", False):
        cfg["input_size"] = (3, *(int(v) for v in size))
    return cfg


def _check_finite(t: torch.Tensor) -> None:
    if not torch.isfinite(t).all():
        raise TraceError("image: contains NaN or inf values; expected finite pixel values")


def prepare_input(model: torch.nn.Module, image: object, processor: object = None) -> PreparedInput:
    """Preprocess ``image`` the way the model expects.

    Pixels (:func:`to_pixels`, the one input rule) go through timm's own eval transform (resize, crop,
    mean/std), or through ``processor`` (a Hugging Face image processor) when one is given; a float tensor
    (1,3,H,W) or (3,H,W) is used as given and only un-normalised for display.

    Example:
        >>> import numpy as np, timm
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> p = prepare_input(m, np.zeros((300, 200, 3), np.uint8))
        >>> tuple(p.tensor.shape), p.display.shape
        ((1, 3, 224, 224), (224, 224, 3))
    """
    from PIL import Image
    from timm.data import create_transform

    cfg = data_config(model)
    if processor is not None:
        return _with_processor(image, processor, cfg)
    mean = torch.tensor(cfg["mean"], dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(cfg["std"], dtype=torch.float32).view(1, 3, 1, 1)
    facts = {
        "mean": [float(v) for v in cfg["mean"]],
        "std": [float(v) for v in cfg["std"]],
        "interpolation": str(cfg.get("interpolation", "")),
        "crop_pct": float(cfg.get("crop_pct", 1.0)),
        "crop_mode": str(cfg.get("crop_mode", "center")),
        "config_input_size": list(cfg["input_size"]),
    }
    if "source" in cfg:
        facts["source"] = str(cfg["source"])

    pixels, how = to_pixels(image)
    facts.update(how)
    if isinstance(pixels, torch.Tensor):
        return PreparedInput(pixels, _display(pixels, mean, std), facts)
    transform = create_transform(**{k: v for k, v in cfg.items() if k != "source"})
    t, geometry = _transformed(transform, Image.fromarray(pixels))
    t = t.unsqueeze(0).to(torch.float32)
    _check_finite(t)
    facts.update(geometry.facts())
    _warn_geometry(geometry, facts)
    return PreparedInput(t, _display(t, mean, std), facts)


class InputCropWarning(UserWarning):
    """The model's eval transform cut part of the user's image off (or stretched it): the map covers only what the
    model saw, the box recorded in the trace's preprocessing attrs and stated in its checklist.

    Example:
        >>> import warnings
        >>> warnings.simplefilter("ignore", InputCropWarning)
    """


def _transformed(transform: object, image: object) -> tuple[torch.Tensor, Geometry]:
    """Run the transform's steps one by one (as its ``Compose`` does) and follow each resize and crop back to the
    original's pixels, so the box the model sees is read from the steps that ran, not recomputed from the config."""
    from PIL import Image

    geometry = Geometry((image.height, image.width))
    x = image
    for step in getattr(transform, "transforms", [transform]):
        before = x
        x = step(x)
        if isinstance(before, Image.Image) and isinstance(x, Image.Image) and x.size != before.size:
            if "Resize" in type(step).__name__:
                geometry.resize((x.height, x.width))
            else:  # CenterCrop, CenterCropOrPad, TrimBorder: centred
                geometry.crop((x.height, x.width))
    return x, geometry


def _warn_geometry(geometry: Geometry, facts: dict) -> None:
    if not (geometry.cropped() or geometry.stretched()):
        return
    h, w = geometry.original
    said = []
    if geometry.cropped():
        x0, y0, x1, y1 = geometry.box()
        said.append(f"centre-cropped (timm crop_pct {facts['crop_pct']:g}, crop_mode {facts['crop_mode']}): the "
                    f"model sees only the box x {x0:g}..{x1:g}, y {y0:g}..{y1:g} ({geometry.kept_share():.0%} of "
                    "the image) and the map covers only that box")
    if geometry.stretched():
        said.append("stretched (its aspect ratio changed)")
    size = "x".join(str(v) for v in geometry.size)
    warnings.warn(f"image: {h}x{w} (HxW) was resized to the model's {size} input and {' and '.join(said)}; the "
                  "trace's checklist states it. Crop the image yourself to choose what the model sees",
                  InputCropWarning, stacklevel=user_stacklevel())


def _rescale_rule(values: np.ndarray, what: str) -> tuple[np.ndarray, str | None]:
    """8-bit values from any numeric array, and the rule used when it is not the documented one."""
    if values.dtype == np.uint8:
        return values, None
    _check_dtype(values.dtype, what)
    if values.size == 0:
        raise TraceError(f"image: empty {what} of shape {values.shape}")
    if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
        raise TraceError("image: contains NaN or inf values; expected finite pixel values")
    lo, hi = float(values.min()), float(values.max())
    if np.issubdtype(values.dtype, np.floating) and 0.0 <= lo and hi <= 1.0:
        return np.round(values.astype(np.float64) * 255.0).astype(np.uint8), None
    if np.issubdtype(values.dtype, np.integer) and 0 <= lo and hi <= 255:
        return values.astype(np.uint8), None
    if not what.startswith("PIL"):  # a numeric PIL image (a file's I/F mode) keeps the rule it always had: every
        _refuse_flat(values.dtype, lo, hi, what)  # PIL image gives a trace, as tests/integration pin
    expected = "0..1 of floats" if values.dtype.kind == "f" else "0..255 of 8-bit integers"
    rule = f"{what} values {lo:g}..{hi:g} are outside the {expected}; rescaled linearly from their min..max to 0..255"
    warnings.warn(f"image: {rule}. Pass uint8 pixels to choose the mapping yourself", UserWarning,
                  stacklevel=user_stacklevel())
    scaled = (values.astype(np.float64) - lo) / (hi - lo) * 255.0 if hi > lo else np.zeros(values.shape)
    return np.round(scaled).astype(np.uint8), rule


def _refuse_flat(dtype: np.dtype, lo: float, hi: float, what: str) -> None:
    """Refuse an image of one value outside the documented range: the min..max rescale has no range to map (it
    would make every pixel 0, an image nobody gave)."""
    inside = 0.0 <= lo and hi <= (1.0 if np.issubdtype(dtype, np.floating) else 255.0)
    if lo == hi and not inside:
        expected = "0..1 of floats" if np.issubdtype(dtype, np.floating) else "0..255 of 8-bit integers"
        raise TraceError(f"image: {what} holds the one value {lo:g} for every pixel, outside the {expected}; a "
                         "constant image has no min..max to rescale from. Pass uint8 pixels (0..255)")


def _check_dtype(dtype: np.dtype, what: str) -> None:
    """Refuse a dtype that holds no pixel values (booleans, strings, objects, complex numbers)."""
    if dtype == np.bool_ or not (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)):
        raise TraceError(f"image: {what} of dtype {dtype} has no pixel meaning; pass uint8 (0..255), "
                         "floats in 0..1 or integers in 0..255")


def _check_layout(shape: tuple[int, ...], what: str) -> None:
    """Refuse a shape that is no HxW, HxWx1, HxWx3 or HxWx4 image of at least one pixel."""
    if not (len(shape) == 2 or (len(shape) == 3 and shape[-1] in (1, 3, 4))) or min(shape[:2]) < 1:
        raise TraceError(f"image: expected an HxW, HxWx1, HxWx3 or HxWx4 {what}, got shape {tuple(shape)}")


def _check_float_tensor(shape: tuple[int, ...]) -> None:
    """Refuse a float tensor that is no (1,3,H,W) or (3,H,W) model input."""
    batched = (1, *shape) if len(shape) == 3 else tuple(shape)
    if len(batched) != 4 or batched[0] != 1 or batched[1] != 3:
        raise TraceError(f"image: expected a float tensor of shape (1,3,H,W) or (3,H,W) (normalised, used as "
                         f"given), got {tuple(shape)}")


def _hwc(arr: np.ndarray) -> np.ndarray:
    """An integer tensor's values laid out as an image array: a batch of one dropped, CHW moved to HWC."""
    arr = arr[0] if arr.ndim == 4 and arr.shape[0] == 1 else arr
    if arr.ndim == 3 and arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)
    return arr


def _rgb(values: np.ndarray, what: str) -> tuple[np.ndarray, dict]:
    """An HxW, HxWx1, HxWx3 or HxWx4 array as HxWx3 uint8 (grey repeated, alpha dropped)."""
    _check_layout(values.shape, what)
    if values.ndim == 3:
        values = values[..., 0] if values.shape[-1] == 1 else values[..., :3]
    values, rule = _rescale_rule(values, what)
    if values.ndim == 2:
        values = np.repeat(values[..., None], 3, axis=-1)
    return np.ascontiguousarray(values), {"pixel_rule": rule} if rule else {}


def to_pixels(image: object) -> tuple[np.ndarray | torch.Tensor, dict]:
    """The one input rule of every entry point (``trace``, ``trace_many``, the evaluation metrics): any
    accepted image as HxWx3 uint8 pixels, or a float tensor (1,3,H,W) used as given, and how it was read.

    * PIL images: modes 1, L, LA, P, RGB, RGBA, CMYK, YCbCr, ... converted to RGB (alpha dropped); the
      numeric modes I, I;16 and F read as numbers, like arrays;
    * numpy arrays and integer torch tensors: HxW (grey), HxWx1, HxWx3 or HxWx4 (alpha dropped), or CHW
      tensors; uint8 as given, integers in 0..255 as 8-bit values, floats in 0..1 times 255; anything else
      (16-bit scans, floats beyond 0..1) rescaled from its min..max to 0..255 with a warning naming the rule
      (the trace's ``preprocessing`` keeps it as ``pixel_rule``); an array or tensor of one value outside the
      range (no min..max to rescale from) and booleans refused;
    * float torch tensors (1,3,H,W) or (3,H,W): already normalised, used as given.

    Example:
        >>> pix, how = to_pixels(np.full((2, 2), 0.5))
        >>> pix.shape, int(pix[0, 0, 0]), how
        ((2, 2, 3), 128, {'input_kind': 'float64 array'})
    """
    from PIL import Image

    if isinstance(image, np.ndarray):
        pixels, how = _rgb(image, "array")
        return pixels, {"input_kind": "uint8 array" if image.dtype == np.uint8 else f"{image.dtype} array", **how}
    if isinstance(image, Image.Image):
        if image.mode in ("F", "I") or image.mode.startswith("I;"):
            pixels, how = _rgb(np.asarray(image), f"PIL {image.mode} image")
            return pixels, {"input_kind": f"PIL {image.mode} image", **how}
        return np.asarray(image.convert("RGB")), {"input_kind": "PIL image"}
    if isinstance(image, torch.Tensor):
        t = image.detach()
        if not t.is_floating_point():
            pixels, how = _rgb(_hwc(t.cpu().numpy()), f"{t.dtype} tensor".replace("torch.", ""))
            return pixels, {"input_kind": f"{t.dtype} tensor".replace("torch.", ""), **how}
        _check_float_tensor(tuple(t.shape))
        t = t if t.ndim == 4 else t.unsqueeze(0)
        _check_finite(t)
        return t.to("cpu", torch.float32).clone(), {"input_kind": "tensor (used as given)"}
    raise _not_an_image(image)


def _not_an_image(image: object) -> ArgumentTypeError:
    return ArgumentTypeError(f"image: expected a PIL image, a numpy array (HxW or HxWxC), an integer tensor or a "
                             f"normalised (1,3,H,W) float tensor, got {type(image).__name__}")


def check_image(image: object, processor: object = None) -> None:
    """Refuse what :func:`prepare_input` would refuse, without converting or resizing anything: the type, the
    shape and dtype, and NaN or inf values of a float array or tensor (one pass over it). Many images are
    checked this way before any pass, so that a bad one is refused before the model runs. A PIL image is
    taken as it is (each mode converts).

    Example:
        >>> check_image(np.zeros((8, 8, 3), np.uint8))
        >>> check_image(np.zeros((8, 8, 5), np.uint8))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: image: expected an HxW, HxWx1, HxWx3 or HxWx4 array, got shape (8, 8, 5)
    """
    from PIL import Image

    if isinstance(image, np.ndarray):
        _check_layout(image.shape, "array")
        _check_dtype(image.dtype, "array")
        if np.issubdtype(image.dtype, np.floating) and not np.isfinite(image).all():
            raise TraceError("image: contains NaN or inf values; expected finite pixel values")
        if image.dtype != np.uint8 and image.size:
            _refuse_flat(image.dtype, float(image.min()), float(image.max()), "array")
    elif isinstance(image, torch.Tensor) and image.is_floating_point():
        if processor is not None:
            raise TraceError(_PROCESSOR_WITH_TENSOR)
        _check_float_tensor(tuple(image.shape))
        _check_finite(image.detach())
    elif isinstance(image, torch.Tensor):
        what = f"{image.dtype} tensor".replace("torch.", "")
        # A zero-strided stand-in of the tensor's shape and dtype: the layout rule without a copy of the values.
        stand_in = _hwc(np.broadcast_to(image.new_zeros(()).cpu().numpy(), tuple(image.shape)))
        _check_layout(stand_in.shape, what)
        _check_dtype(stand_in.dtype, what)
        if image.numel():
            _refuse_flat(stand_in.dtype, float(image.min()), float(image.max()), what)
    elif not isinstance(image, Image.Image):
        raise _not_an_image(image)


def _with_processor(image: object, processor: object, cfg: dict) -> PreparedInput:
    """Preprocess a PIL image or uint8 array with a Hugging Face image processor; warn when its normalisation
    differs from the model's data config (the processor's is used, and both are recorded)."""
    from PIL import Image

    pixels, how = to_pixels(image)
    if isinstance(pixels, torch.Tensor):
        raise TraceError(_PROCESSOR_WITH_TENSOR)
    image = Image.fromarray(pixels)
    mean, std = processor_normalisation(processor)
    facts = {**how, "source": "the image processor handed to the trace", **processor_facts(processor),
             "config_input_size": list(cfg["input_size"]), "original_size": [image.height, image.width]}
    own_mean, own_std = tuple(float(v) for v in cfg["mean"]), tuple(float(v) for v in cfg["std"])
    if not (np.allclose(mean, own_mean, atol=1e-6) and np.allclose(std, own_std, atol=1e-6)):
        facts["model_config_mean"], facts["model_config_std"] = list(own_mean), list(own_std)
        warnings.warn(f"processor: {type(processor).__name__} normalises with mean={list(mean)} std={list(std)}, "
                      f"the model's configuration with mean={list(own_mean)} std={list(own_std)}; the processor's "
                      "is used (both are recorded in the trace's preprocessing attrs)", UserWarning,
                      stacklevel=user_stacklevel())
    t = run_processor(processor, image)
    _check_finite(t)
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return PreparedInput(t, _display(t, m, s), facts)


def _display(t: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> np.ndarray:
    pixels = (t * std + mean).clamp(0, 1)[0].permute(1, 2, 0).numpy()
    return np.round(pixels * 255.0).astype(np.uint8)


def preprocessing_json(facts: dict) -> str:
    """Canonical JSON of the preprocessing facts stored in the trace attrs.

    Example:
        >>> preprocessing_json({"b": 1, "a": [0.5]})
        '{"a":[0.5],"b":1}'
    """
    return json.dumps(facts, sort_keys=True, separators=(",", ":"))
