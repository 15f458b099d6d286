"""The refusals of a pass over a tower that runs on several crops of one image (``Adapter.runs_crops``), made
before any model call: the input must be one image's crops, at least as many as the target's image needs, and
the ``projector`` site must be one crop's row per image token.

Example:
    >>> CROP_PIXELS
    'crop_pixels'
"""

from __future__ import annotations

from typing import Any

import torch

from vitcam_nb.adapters.vlm_crops import projector_rows
from vitcam_nb.core.errors import TraceError

__all__ = ["CROP_PIXELS", "check_crops"]

#: the trace context's fact holding the crops the tower ran on, as its patch embedding received them
CROP_PIXELS = "crop_pixels"


def check_crops(plan: Any, x: torch.Tensor) -> None:
    """Refuse ``x`` unless it is ``(1, n, 3, H, W)`` with ``n`` at least the crops the family runs for the plan's
    target (a batch padded with more rows is what the processor gives several images; the model slices it), and
    the ``projector`` site unless each of the layout's tiles is one crop's projector rows.

    Example:
        >>> check_crops(None, torch.zeros(2, 3, 8, 8))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        vitcam_nb.core.errors.TraceError: image: ...
    """
    if x.ndim != 5 or x.shape[0] != 1:
        raise TraceError(f"image: a model whose tower runs on crops takes one image's crops (1, crops, 3, H, W), got "
                         f"shape {tuple(x.shape)}; trace one image at a time")
    model, adapter, target = plan.model, plan.adapter, plan.target
    names = adapter.crop_tiles(model, target)
    if int(x.shape[1]) < len(names):
        raise TraceError(f"image: holds {int(x.shape[1])} crops, but the model runs {len(names)} for this image "
                         f"({', '.join(n or '(unread)' for n in names)}, from the target's model_kwargs); pass the "
                         "processor's pixel_values for this image")
    if "projector" in plan.site_ids:
        lay = adapter.layout(model, target.sequence.numpy(), getattr(target, "model_kwargs", None))
        projector_rows(lay, names, max(t.grid[0] * t.grid[1] for t in lay.tiles))
