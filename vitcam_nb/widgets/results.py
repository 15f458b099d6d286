"""One recipe computed for a widget: the token-grid map of ``vc.cam(trace, recipe, grid=True)`` (of a video
trace: the whole clip's map ``vc.cam(trace, recipe)``, shown one frame at a time) with everything the widgets
display about it, and the message a refused change shows.

Example:
    >>> error_text(KeyError("x"))
    "KeyError: 'x'"
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import numpy as np
import xarray as xr

from vitcam_nb.api import cam
from vitcam_nb.compute.maps import degenerate_cause
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import ArgumentIndexError, DegenerateMapWarning, VitcamError
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.widgets.facts import is_video

__all__ = ["GridResult", "check_frame", "clip_range", "compute_grid", "error_text", "frame_slice"]


@dataclass
class GridResult:
    """One recipe computed on the token grid, with everything the widgets display about it.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> r = compute_grid(vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1"), vc.Recipe(site="F6"))
        >>> r.grid.shape, r.degenerate[:29]
        ((4, 4), 'gradients are exactly zero at')
    """

    recipe: Recipe
    grid: np.ndarray
    checklist: dict
    methods: str
    degenerate: str
    notes: str
    #: Of a video trace: the [low, high] the colours span, over the whole clip (frames share one scale).
    value_range: list[float] | None = None

    @property
    def cause(self) -> str:
        """The short cause of a degenerate map (what its badge says), "" if the map is not degenerate.

        Example:
            >>> GridResult(Recipe(), np.zeros((1, 1)), {}, "", "gradients are exactly zero at x", "").cause
            'zero gradient'
        """
        return degenerate_cause(self.degenerate)

    @property
    def checklist_md(self) -> str:
        """The checklist as a markdown table (what the widget's copy button copies)."""
        return Checklist(self.checklist).to_markdown()


def compute_grid(trace: xr.Dataset, recipe: Recipe) -> GridResult:
    """``vc.cam(trace, recipe, grid=True)`` with its report; the degenerate warning becomes a field. Of a video
    trace: ``vc.cam(trace, recipe)``, the whole clip upsampled in space and time as vc.cam gives it ((frame, y, x);
    with ``upsample="none"`` the (patch_frame, patch_row, patch_col) token grid), with its :func:`clip_range`.

    Example:
        >>> compute_grid(tr, Recipe()).grid.dtype  # doctest: +SKIP
        dtype('float32')
    """
    video = is_video(trace)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateMapWarning)
        m = cam(trace, recipe, grid=not video)
    grid = np.ascontiguousarray(m.values, dtype="<f4")
    # The grid is computed with upsample="none"; the report describes the recipe as chosen (its upsampling).
    return GridResult(recipe=recipe, grid=grid, checklist=json.loads(recipe.checklist(trace).to_json()),
                      methods=recipe.describe(trace), degenerate=str(m.attrs.get("degenerate", "")),
                      notes=str(m.attrs.get("degenerate_layers", "")),
                      value_range=clip_range(grid, recipe.normalize) if video else None)


def clip_range(values: np.ndarray, normalize: str) -> list[float]:
    """The [low, high] a video map's colours span: its range over the whole clip, by the rule the page applies to
    an image map (``displayRange`` in static/core.js), so that every frame is coloured on one scale.

    Example:
        >>> clip_range(np.array([[[0.5]], [[2.0]]], np.float32), "minmax"), clip_range(np.zeros((1, 1, 1)), "max")
        ([0.5, 2.0], [0.0, 1.0])
    """
    if values.size == 0:
        return [0.0, 1.0]
    lo, hi = float(values.min()), float(values.max())
    if normalize == "max":
        return [0.0, hi if hi > 0 else 1.0]
    return [lo, hi] if hi > lo else [lo, lo + 1.0]


def frame_slice(clip: np.ndarray, frame: int, frames: int) -> np.ndarray:
    """The map of frame ``frame`` of a ``frames``-frame clip: its slice of a (frame, y, x) map, or of a token grid
    with fewer time steps (``upsample="none"``) the tubelet holding it (nearest in time, torch's rule).

    Example:
        >>> clip = np.arange(2, dtype=np.float32).reshape(2, 1, 1)
        >>> [float(frame_slice(clip, f, 4)[0, 0]) for f in range(4)]
        [0.0, 0.0, 1.0, 1.0]
    """
    return np.ascontiguousarray(clip[frame * clip.shape[0] // frames])



def check_frame(value: object, frames: int) -> None:
    """Refuse a frame that is not a frame of the clip (an image trace has only "frame" 0).

    Example:
        >>> check_frame(3, 4)
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < max(frames, 1):
        allowed = f"an int in [0, {frames - 1}] (the clip has {frames} frames)" if frames else "0 (an image trace)"
        raise ArgumentIndexError(f"frame: expected {allowed}, got {value!r}")

def error_text(exc: BaseException) -> str:
    """The message shown in a widget for a refused change (no traceback): the kit's own refusals by their message,
    which names the argument, anything else with its type.

    Example:
        >>> error_text(KeyError("x"))
        "KeyError: 'x'"
        >>> from vitcam_nb.core.errors import ArgumentError
        >>> error_text(ArgumentError("k: expected a number in (0, 1], got 2"))
        'k: expected a number in (0, 1], got 2'
    """
    if isinstance(exc, VitcamError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
