"""A Hugging Face image processor as the preprocessing of a trace: run it on the image, and state what it did
(its class, size, crop, resampling and normalisation) as flat facts for the trace's ``preprocessing`` attrs.

transformers is not imported here: the processor object the user hands in is called as it is.

Example:
    >>> class Proc:  # what vitcam_nb reads from a processor
    ...     image_mean, image_std, do_normalize = (0.5,) * 3, (0.5,) * 3, True
    >>> processor_normalisation(Proc())
    ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
"""

from __future__ import annotations

import numpy as np
import torch

from vitcam_nb.core.errors import TraceError

__all__ = ["processor_facts", "processor_normalisation", "run_processor"]


def processor_normalisation(processor: object) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) the processor normalises with; (0, 0, 0), (1, 1, 1) when it does not normalise.

    Example:
        >>> class NoNorm: do_normalize = False
        >>> processor_normalisation(NoNorm())
        ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    """
    if not getattr(processor, "do_normalize", True):
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)
    if mean is None or std is None:
        raise TraceError(f"processor: {type(processor).__name__} states no image_mean/image_std; pass a Hugging "
                         "Face image processor (e.g. AutoImageProcessor.from_pretrained(...))")
    mean = (float(mean),) * 3 if np.isscalar(mean) else tuple(float(v) for v in mean)
    std = (float(std),) * 3 if np.isscalar(std) else tuple(float(v) for v in std)
    return mean, std


def _plain(value: object) -> object:
    """A JSON-friendly form of a processor setting (size dicts, resampling enums)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if hasattr(value, "__dict__") and not hasattr(value, "name"):
        return {str(k): _plain(v) for k, v in vars(value).items() if v is not None}
    return str(getattr(value, "name", value))


def processor_facts(processor: object) -> dict:
    """What the processor does, as flat facts for the trace attrs.

    Example:
        >>> class Proc:
        ...     image_mean, image_std, do_normalize, size, do_center_crop = (0.5,) * 3, (0.5,) * 3, True, None, False
        >>> processor_facts(Proc())["processor"], processor_facts(Proc())["mean"]
        ('Proc', [0.5, 0.5, 0.5])
    """
    mean, std = processor_normalisation(processor)
    facts = {"processor": type(processor).__name__, "mean": list(mean), "std": list(std)}
    for name in ("size", "do_resize", "resample", "do_center_crop", "crop_size", "do_rescale", "rescale_factor",
                 "do_normalize"):
        if hasattr(processor, name):
            facts[f"processor_{name}"] = _plain(getattr(processor, name))
    return facts


def run_processor(processor: object, image: object) -> torch.Tensor:
    """``processor(images=image, return_tensors="pt").pixel_values`` as a (1, 3, H, W) float32 tensor.

    Example:
        >>> class Proc:
        ...     def __call__(self, images, return_tensors):
        ...         return {"pixel_values": torch.zeros(1, 3, 4, 4)}
        >>> tuple(run_processor(Proc(), None).shape)
        (1, 3, 4, 4)
    """
    if not callable(processor):
        raise TraceError(f"processor: expected a Hugging Face image processor, got {type(processor).__name__}")
    out = processor(images=image, return_tensors="pt")
    pixels = out["pixel_values"] if hasattr(out, "__getitem__") else getattr(out, "pixel_values", None)
    if not isinstance(pixels, torch.Tensor) or pixels.ndim != 4 or pixels.shape[:2] != (1, 3):
        shape = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
        raise TraceError(f"processor: expected pixel_values of shape (1, 3, H, W) for one image, got {shape}")
    return pixels.detach().to("cpu", torch.float32)
