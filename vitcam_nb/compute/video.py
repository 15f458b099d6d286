"""The video trace kind: maps on a (t, y, x) token grid (VideoMAE, ViViT, TimeSformer).

A video trace stores each patch token's frame or tubelet (``patch_frame``), row and column. Every per-token step
of a recipe (weights, heads, ReLU, per-layer normalisation, layer fusion, rollouts) is the flat kind's, run on
the frames stacked into one (t x h, w) grid, so the per-layer normalisation spans the whole clip and frames stay
comparable. The (t, h, w) grid is then upsampled in space with the recipe's mode and in time to the clip's
frames (linear with half-pixel centres for the bilinear and bicubic modes, nearest for nearest), and normalised
again over the whole clip. The map's dims are ``(frame, y, x)``, or ``(patch_frame, patch_row, patch_col)`` with
``upsample="none"``; the checklist's spatial-reconstruction category states the tubelet size and the time
interpolation.

Example:
    >>> import vitcam_nb as vc
    >>> VIDEO.accepts(None, vc.Recipe())
    False
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

# The kinds that read one image's grid register first, so that this one goes in front of them wherever it is imported.
from vitcam_nb.compute import published, vitcx  # noqa: F401
from vitcam_nb.compute.flat import FLAT
from vitcam_nb.compute.maps import map_array, warn_degenerate
from vitcam_nb.compute.report import build_checklist, describe
from vitcam_nb.compute.spatial import interp_matrix, normalise, upsample
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.kinds import TRACE_KINDS, MapValues, TraceKind
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.schema import EXTRA_SITES

__all__ = ["VIDEO", "VideoKind", "stacked_frames", "time_mode", "upsample_clip"]


def time_mode(mode: str) -> str:
    """The interpolation along time for a spatial ``upsample`` mode: nearest stays nearest, the smooth modes
    interpolate linearly between tubelet centres (bicubic would overshoot between two or three tubelets).

    Example:
        >>> time_mode("bicubic"), time_mode("nearest")
        ('linear', 'nearest')
    """
    return "nearest" if mode == "nearest" else "linear"


def upsample_clip(grid: np.ndarray, size: tuple[int, int, int], mode: str) -> np.ndarray:
    """A (t, h, w) token grid upsampled to (frames, H, W): space with ``mode`` (torch's rules, half-pixel
    centres), then time with :func:`time_mode` as a (frames, t) matrix.

    Example:
        >>> upsample_clip(np.array([[[0.0]], [[1.0]]], np.float32), (4, 1, 1), "bilinear")[:, 0, 0].tolist()
        [0.0, 0.25, 0.75, 1.0]
    """
    space = upsample(grid, size[1:], mode)
    # interp_matrix's "bilinear" on a one-row image is torch's 1-D linear interpolation
    wt = interp_matrix(grid.shape[0], size[0], "nearest" if time_mode(mode) == "nearest" else "bilinear")
    return np.tensordot(wt, space, axes=(1, 0)).astype(np.float32)


def stacked_frames(trace: xr.Dataset) -> xr.Dataset:
    """The trace with its frames stacked into one (t x h, w) grid, for the flat kind's per-token steps (also
    :func:`vitcam_nb.map_many`'s, which stores a clip's maps on that grid).

    Example:
        >>> tr = xr.Dataset(coords={"patch_frame": ("token", [0, 1]), "patch_row": ("token", [0, 0])},
        ...                 attrs={"grid_t": 2, "grid_h": 1})
        >>> stacked_frames(tr)["patch_row"].values.tolist(), stacked_frames(tr).attrs["grid_h"]
        ([0, 1], 2)
    """
    gh = int(trace.attrs["grid_h"])
    frames = trace["patch_frame"].values
    rows = np.where(frames >= 0, frames * gh + trace["patch_row"].values, -1)
    out = trace.assign_coords(patch_row=("token", rows))
    out.attrs = {**trace.attrs, "grid_h": int(trace.attrs["grid_t"]) * gh}
    return out


class VideoKind(TraceKind):
    """Single-clip traces of video models (a ``patch_frame`` coordinate and a ``grid_t`` attribute).

    Example:
        >>> import xarray as xr, vitcam_nb as vc
        >>> VIDEO.accepts(xr.Dataset(), vc.Recipe())
        False
    """

    name = "video"

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        return isinstance(trace, xr.Dataset) and "patch_frame" in trace.coords and "grid_t" in trace.attrs \
            and (recipe is None or recipe.site not in EXTRA_SITES)

    def _check(self, trace: xr.Dataset, recipe: Recipe) -> None:
        # A kind of its own (ViT-CX, the published methods) reads one image's grid; none of them reads a clip yet.
        for kind in TRACE_KINDS.values():
            if kind is not self and kind is not FLAT and kind.accepts(trace, recipe):
                raise RecipeError(f"weighting: {recipe.weighting!r} is computed by the {kind.name} trace kind, which "
                                  "reads one image's grid; on a video trace use a gradient weighting (e.g. 'gradcam')")

    def compute(self, trace: xr.Dataset, recipe: Recipe) -> MapValues:
        self._check(trace, recipe)
        gt, gh, gw = (int(trace.attrs[k]) for k in ("grid_t", "grid_h", "grid_w"))
        grid, notes, partial = FLAT.compute(stacked_frames(trace), recipe.replace(upsample="none"))
        grid = grid.reshape(gt, gh, gw)
        if recipe.upsample == "none":
            return grid, notes, partial
        size = (int(trace.sizes["frame"]), int(trace.sizes["y"]), int(trace.sizes["x"]))
        clip = upsample_clip(grid, size, recipe.upsample)
        # normalised again over the whole clip, as an image map is after upsampling
        return normalise(clip.reshape(1, -1, size[2]), recipe.normalize).reshape(size), notes, partial

    def cam(self, trace: xr.Dataset, recipe: Recipe) -> xr.DataArray:
        values, notes, partial = self.compute(trace, recipe)
        reason = warn_degenerate(recipe, notes) if notes else ""
        checklist = self.checklist(recipe, trace)
        flat = map_array(values[0], recipe, str(trace.attrs.get("trace_id", "")), checklist.to_json(),
                         self.describe(recipe, trace), reason, partial)
        dims = ("patch_frame", "patch_row", "patch_col") if recipe.upsample == "none" else ("frame", "y", "x")
        attrs = {**flat.attrs, "time_interpolation": self.time_text(recipe, trace),
                 "tubelet_size": str(trace.attrs.get("tubelet_size", ""))}
        return xr.DataArray(values.astype(np.float32, copy=False), dims=dims, name="cam", attrs=attrs)

    def gallery(self, trace: xr.Dataset, recipe: Recipe, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
        raise RecipeError("vary: galleries of video maps are not available yet; call vitcam_nb.cam once per recipe")

    @staticmethod
    def time_text(recipe: Recipe, trace: xr.Dataset | None) -> str:
        """The map's time interpolation in words (its ``time_interpolation`` attribute).

        Example:
            >>> VIDEO.time_text(Recipe(upsample="none"), None)
            'none (the map stays on the ? frames or tubelets of the token grid)'
        """
        attrs = getattr(trace, "attrs", {}) or {}
        gt, frames = attrs.get("grid_t", "?"), attrs.get("clip_frames", "?")
        if recipe.upsample == "none":
            return f"none (the map stays on the {gt} frames or tubelets of the token grid)"
        how = {"nearest": "nearest (each frame takes its tubelet's value)",
               "linear": "linear between tubelet centres (half-pixel centres, align_corners=False)"}
        return f"{how[time_mode(recipe.upsample)]}, {gt} -> {frames} frames"

    def checklist(self, recipe: Recipe, trace: Any) -> Checklist:
        checklist = build_checklist(recipe, trace)
        attrs = getattr(trace, "attrs", {}) or {}
        sr = checklist["spatial reconstruction"]
        sr["reshape"] = (f"raster: (t, y, x) grid of {attrs.get('grid_t', '?')} x {attrs.get('grid_h', '?')} x "
                         f"{attrs.get('grid_w', '?')} from the patch_frame/patch_row/patch_col of each token "
                         f"(token order {attrs.get('token_order', '?')})")
        sr["tubelet size"] = str(attrs.get("tubelet_size", "?"))
        sr["time interpolation"] = self.time_text(recipe, trace)
        if recipe.normalize != "none":
            sr["normalisation"] += " (each over the whole clip: frames share one scale)"
        return checklist

    def describe(self, recipe: Recipe, trace: Any) -> str:
        c = self.checklist(recipe, trace)["spatial reconstruction"]
        return (f"{describe(recipe, trace)} Time: the token grid is {c['reshape']}; tubelets of {c['tubelet size']}; "
                f"time interpolation {c['time interpolation']}.")


VIDEO = VideoKind()
# Lookup priority: before the single-image forms: a clip's frames are each a trace they would take.
TRACE_KINDS.register(VIDEO.name, VIDEO, replace=True, priority=20)
