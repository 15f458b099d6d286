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
from vitcam_nb.core.errors import TraceError, user_stacklevel

__all__ = ["PreparedInput", "data_config", "prepare_input", "preprocessing_json"]


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

    PIL images and HxWx3 uint8 arrays go through timm's own eval transform (resize, crop, mean/std), or through
    ``processor`` (a Hugging Face image processor) when one is given; a float tensor (1,3,H,W) or (3,H,W) is
    used as given and only un-normalised for display.

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

    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[-1] != 3:
            raise TraceError(f"image: expected an HxWx3 array, got shape {image.shape}")
        if image.dtype != np.uint8:
            raise TraceError(f"image: expected a uint8 array (0..255), got dtype {image.dtype}; "
                             "pass a normalised float tensor (1,3,H,W) to skip preprocessing")
        if min(image.shape[:2]) < 1:
            raise TraceError(f"image: empty array of shape {image.shape}")
        image = Image.fromarray(image)
        facts["input_kind"] = "uint8 array"
    elif isinstance(image, Image.Image):
        facts["input_kind"] = "PIL image"
        image = image.convert("RGB")
    elif isinstance(image, torch.Tensor):
        t = image.detach()
        if t.ndim == 3:
            t = t.unsqueeze(0)
        if t.ndim != 4 or t.shape[0] != 1 or t.shape[1] != 3:
            raise TraceError(f"image: expected a tensor of shape (1,3,H,W) or (3,H,W), got {tuple(image.shape)}")
        if not t.is_floating_point():
            raise TraceError(f"image: expected a float tensor, got dtype {t.dtype}")
        _check_finite(t)
        t = t.to("cpu", torch.float32).clone()
        facts["input_kind"] = "tensor (used as given)"
        return PreparedInput(t, _display(t, mean, std), facts)
    else:
        raise TypeError(
            f"image: expected a PIL image, an HxWx3 uint8 numpy array or a (1,3,H,W) float tensor, "
            f"got {type(image).__name__}"
        )
    transform = create_transform(**{k: v for k, v in cfg.items() if k != "source"})
    t = transform(image).unsqueeze(0).to(torch.float32)
    _check_finite(t)
    return PreparedInput(t, _display(t, mean, std), facts)


def _with_processor(image: object, processor: object, cfg: dict) -> PreparedInput:
    """Preprocess a PIL image or uint8 array with a Hugging Face image processor; warn when its normalisation
    differs from the model's data config (the processor's is used, and both are recorded)."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
            raise TraceError(f"image: expected an HxWx3 uint8 array, got shape {image.shape} dtype {image.dtype}")
        image, kind = Image.fromarray(image), "uint8 array"
    elif isinstance(image, Image.Image):
        image, kind = image.convert("RGB"), "PIL image"
    else:
        raise TraceError(f"processor: given with a {type(image).__name__} image; a processor preprocesses a PIL "
                         "image or an HxWx3 uint8 array (a float tensor is used as given: drop the processor)")
    mean, std = processor_normalisation(processor)
    facts = {"input_kind": kind, "source": "the image processor handed to the trace", **processor_facts(processor),
             "config_input_size": list(cfg["input_size"])}
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
