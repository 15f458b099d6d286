"""Matplotlib views of maps and galleries: the static render that works everywhere, widgets or not.

Every map figure names the recipe in words (:func:`recipe_short`) and the class it explains, carries a colour
bar, draws the object's outline when a mask is given, and uses a perceptually uniform colormap by default
(:data:`DEFAULT_CMAP`; a rainbow such as jet makes some hues look "cold" or "hot" regardless of the value).
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.escape import escape_mathtext
from vitcam_nb.plot_views import views
from vitcam_nb.plot_words import class_name, map_title, recipe_dict, recipe_short

__all__ = ["DEFAULT_CMAP", "class_name", "draw_mask", "frame_strip", "grid", "overlay", "recipe_short", "views"]

DEFAULT_CMAP = "inferno"
_MASK_COLOUR = "cyan"
_map_title = map_title  # the name this module used before plot_words held it (tests and callers import it)


def _image(trace: xr.Dataset, cam_map: Any = None) -> np.ndarray:
    """The image a map is drawn over: the trace's one image, or the crop a crop's map was selected from."""
    if "image" not in getattr(trace, "variables", {}) and "clip" in getattr(trace, "variables", {}):
        raise ArgumentError("trace: a video trace (its frames in 'clip'); overlay() and grid() draw one image. Draw a "
                            "video map with vc.plot.frame_strip(trace, cam_map)")
    image = trace["image"]
    if "crop" not in image.dims:
        return np.asarray(image.values)
    coords = getattr(cam_map, "coords", {})
    if "crop" in coords and np.ndim(coords["crop"].values) == 0:  # one crop's map: drawn on that crop's pixels
        return np.asarray(image.isel(crop=int(coords["crop"].values)).values)
    raise ArgumentError("trace: its tower ran on several crops (image dims crop, y, x, rgb), so there is no one image "
                        "to draw over; draw every crop or view with vc.plot.views(trace, cam_map), or one crop's map "
                        "with overlay(trace, cam_map.isel(crop=k))")


def _check_image_map(cam_map: xr.DataArray) -> None:
    dims = tuple(getattr(cam_map, "dims", ()))
    if len(dims) != 2:
        hint = "; a video map: draw it with vc.plot.frame_strip(trace, cam_map)" if len(dims) == 3 else ""
        if len(dims) == 3 and dims[0] in ("crop", "view", "tile"):
            hint = (f"; a map with one panel per {dims[0]}: draw them all with vc.plot.views(trace, cam_map), or "
                    f"one with overlay(trace, cam_map.isel({dims[0]}=k))")
        raise ArgumentError(f"cam_map: overlay() draws a 2-D map (y, x), got dims {dims}{hint}")


def draw_mask(ax: Any, mask: Any, shape: tuple[int, int] | None = None) -> None:
    """Outline ``mask`` (a 2-D boolean array) on ``ax`` as a cyan contour in pixel coordinates of ``shape``
    (default: the mask's own shape).

    Example:
        >>> import matplotlib.pyplot as plt
        >>> fig, ax = plt.subplots(); draw_mask(ax, np.eye(4, dtype=bool)); len(ax.collections) > 0
        True
    """
    mask = np.asarray(mask, dtype=bool)
    if mask.ndim != 2:
        raise ArgumentError(f"mask: expected a 2-D boolean array, got shape {mask.shape}")
    h, w = shape or mask.shape
    ys = (np.arange(mask.shape[0]) + 0.5) * h / mask.shape[0] - 0.5
    xs = (np.arange(mask.shape[1]) + 0.5) * w / mask.shape[1] - 0.5
    ax.contour(xs, ys, mask.astype(float), levels=[0.5], colors=_MASK_COLOUR, linewidths=1.2)


def overlay(trace: xr.Dataset, cam_map: xr.DataArray, *, ax=None, alpha: float = 0.5, cmap: str = DEFAULT_CMAP,
            title: str | None = None, mask: Any = None, colorbar: bool = True):
    """Draw ``cam_map`` over the trace's display image; returns the matplotlib Figure.

    The title names the recipe in words and the class (unless ``title`` is given); ``mask`` (the object's
    pixels, if known) is outlined; ``colorbar`` adds the map's scale.

    Example:
        >>> fig = overlay(tr, vc.cam(tr, vc.Recipe()), mask=mask)  # doctest: +SKIP
    """
    import matplotlib.pyplot as plt

    if not 0 <= alpha <= 1:
        raise ArgumentError(f"alpha: expected a float in [0, 1], got {alpha!r}")
    img = _image(trace, cam_map)  # a trace that holds no one image (a video, crops) is named first
    _check_image_map(cam_map)
    mine, theirs = str(trace.attrs.get("trace_id", "")), str(cam_map.attrs.get("trace_id", ""))
    if mine and theirs and mine != theirs:
        raise ArgumentError(f"cam_map: computed from trace {theirs[:12]}…, not from this trace ({mine[:12]}…); "
                            "overlay a map on the image it explains")
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(4.6 if colorbar else 4, 4.2))
    else:
        fig = ax.figure
    values = np.asarray(cam_map.values, dtype=np.float32)
    h, w = img.shape[:2]
    # A min-max map (and an all-zero one) is drawn on its 0..1 scale, so its colour bar reads the same everywhere.
    recipe = cam_map.attrs.get("recipe")
    scaled = (bool(recipe) and recipe_dict(recipe).get("normalize") == "minmax") or not values.any()
    ax.imshow(img)
    im = ax.imshow(values, cmap=cmap, alpha=alpha, extent=(-0.5, w - 0.5, h - 0.5, -0.5), interpolation="nearest",
                   vmin=0 if scaled else None, vmax=1 if scaled else None)
    if mask is not None:
        draw_mask(ax, mask, (h, w))
    ax.set_title(title if title is not None else map_title(trace, cam_map), fontsize=9)
    ax.set_axis_off()
    if colorbar:
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label="map value")
    if own:
        fig.tight_layout()
    return fig


def _site_order(gallery: xr.DataArray, dims: list[str]) -> xr.DataArray:
    """Site coordinates in reading order F1, F2, ... (a trace lists them in capture order)."""
    for dim in dims:
        values = [str(v) for v in gallery[dim].values] if dim in gallery.coords else []
        if values and all(re.fullmatch(r"[A-Z]+\d+", v) for v in values):
            order = sorted(range(len(values)), key=lambda i: (re.sub(r"\d", "", values[i]),
                                                               int(re.sub(r"\D", "", values[i]))))
            gallery = gallery.isel({dim: order})
    return gallery


def _cell_label(dim: str, value: Any) -> str:
    return f"block {value}" if dim == "layer" else f"{dim} {value}"


def _degenerate_text(reason: str) -> str:
    """The first clause of a degenerate map's reason (the part before its parenthesis), wrapped for a cell."""
    return "\n".join(textwrap.wrap(f"all zeros: {reason.split(' (')[0]}", 22)[:5])


def grid(trace: xr.Dataset, gallery: xr.DataArray, *, alpha: float = 0.5, cmap: str = DEFAULT_CMAP,
         size: float = 1.6, mask: Any = None):
    """Plot a gallery with up to two varied dimensions as a grid of overlays; returns the Figure.

    Rows are the first varied dimension, columns the second (sites in order F1, F2, ...). The input image
    (with ``mask`` outlined, when given) comes first, a colour bar last; a degenerate map's cell says why it is
    blank. A gallery of a VLM's crop, view or tile maps is drawn by :func:`views`: one row per cell, one panel per
    crop (over its own pixels), view or tile (no ``mask`` there).

    Example:
        >>> fig = grid(tr, vc.gallery(tr, vc.Recipe(), vary=("layer", "site")))  # doctest: +SKIP
    """
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    lead = gallery.dims[-3] if getattr(gallery, "ndim", 0) > 3 else None
    if lead in ("crop", "view", "tile"):  # one panel per crop, view or tile in each cell: views() draws them
        if mask is not None:
            raise ArgumentError(f"mask: a gallery of {lead} maps is drawn by vc.plot.views, one panel per {lead}, "
                                "with no mask outline; leave mask out")
        return views(trace, gallery, alpha=alpha, cmap=cmap, size=size)
    img = _image(trace)
    spatial = gallery.dims[-2:]
    varied = list(gallery.dims[:-2])
    if len(varied) > 2:
        raise ArgumentError(f"gallery: grid() shows at most two varied dimensions, got {varied}; select some first")
    while len(varied) < 2:
        gallery = gallery.expand_dims(f"_{len(varied)}")
        varied.insert(0, f"_{len(varied)}")
    gallery = _site_order(gallery.transpose(*varied, *spatial), varied)
    n_rows, n_cols = gallery.shape[:2]
    fig, axes = plt.subplots(n_rows, n_cols + 1, figsize=(size * (n_cols + 1) + 1.2, size * n_rows + 1.0),
                             squeeze=False)
    h, w = img.shape[:2]
    degenerate = gallery.coords["degenerate"].values if "degenerate" in gallery.coords else None
    for i in range(n_rows):
        axes[i, 0].set_axis_off()
        for j in range(n_cols):
            ax = axes[i, j + 1]
            ax.imshow(img)
            ax.imshow(np.asarray(gallery.values[i, j]), cmap=cmap, alpha=alpha, vmin=0, vmax=1,
                      extent=(-0.5, w - 0.5, h - 0.5, -0.5))
            if mask is not None:
                draw_mask(ax, mask, (h, w))
            ax.set_xticks([])
            ax.set_yticks([])
            reason = degenerate[i, j] if degenerate is not None and np.ndim(degenerate) == 2 else ""
            if reason:
                text = _degenerate_text(reason if isinstance(reason, str) else "degenerate map")
                ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="white",
                        fontsize=6.5, bbox={"facecolor": "black", "alpha": 0.7})
            if j == 0 and not varied[0].startswith("_"):
                ax.set_ylabel(_cell_label(varied[0], gallery[varied[0]].values[i]), fontsize=8)
            if i == 0 and not varied[1].startswith("_"):
                ax.set_title(_cell_label(varied[1], gallery[varied[1]].values[j]), fontsize=8)
    first = axes[0, 0]
    first.imshow(img)
    if mask is not None:
        draw_mask(first, mask, (h, w))
    first.set_title("input" + (" (object outlined)" if mask is not None else ""), fontsize=8)
    first.set_axis_on()
    first.set_xticks([])
    first.set_yticks([])
    recipe = gallery.attrs.get("recipe")
    title = recipe_short(recipe) if recipe else f"recipe {gallery.attrs.get('recipe_id', '?')}"
    name = class_name(trace, recipe) if recipe else None
    vary = ", ".join(v for v in varied if not v.startswith("_"))
    fig.suptitle(f"{title}" + (f" — class {escape_mathtext(name)}" if name else "")
                 + (f"; varied: {vary}" if vary else ""), fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    cax = fig.add_axes((0.94, 0.15, 0.015, 0.7))
    fig.colorbar(ScalarMappable(Normalize(0, 1), cmap=cmap), cax=cax, label="map value")
    return fig


def frame_strip(trace: xr.Dataset, cam_map: xr.DataArray, *, alpha: float = 0.5, cmap: str = DEFAULT_CMAP,
                size: float = 1.8, title: str | None = None):
    """Draw a video map as a strip with one panel per frame over that frame of the clip; returns the Figure.

    ``cam_map``: a map of a video trace, ``(frame, y, x)``, or ``(patch_frame, patch_row, patch_col)`` (the token
    grid, ``upsample="none"``: one panel per frame or tubelet, drawn over its first frame). The title names the
    recipe in words and the class (unless ``title`` is given); one colour bar holds for every panel (a min-max
    map is normalised over the whole clip, so frames share its 0..1 scale).

    Example:
        >>> fig = frame_strip(tr, vc.cam(tr, vc.Recipe()))  # doctest: +SKIP
    """
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    if not 0 <= alpha <= 1:
        raise ArgumentError(f"alpha: expected a float in [0, 1], got {alpha!r}")
    if "clip" not in getattr(trace, "variables", {}):
        raise ArgumentError("trace: frame_strip draws a video trace (its frames in the variable 'clip'); for an image "
                            "use overlay()")
    dims = tuple(cam_map.dims)
    if dims not in (("frame", "y", "x"), ("patch_frame", "patch_row", "patch_col")):
        raise ArgumentError(f"cam_map: expected a video map with dims (frame, y, x) or (patch_frame, patch_row, "
                            f"patch_col), got {dims}")
    mine, theirs = str(trace.attrs.get("trace_id", "")), str(cam_map.attrs.get("trace_id", ""))
    if mine and theirs and mine != theirs:
        raise ArgumentError(f"cam_map: computed from trace {theirs[:12]}…, not from this trace ({mine[:12]}…); "
                            "draw a map over the clip it explains")
    frames = np.asarray(trace["clip"].values)
    values = np.asarray(cam_map.values, dtype=np.float32)
    n = values.shape[0]
    step = frames.shape[0] // n  # frames per panel: 1, or the tubelet length of a token-grid map
    h, w = frames.shape[1:3]
    recipe = cam_map.attrs.get("recipe")
    scaled = (bool(recipe) and recipe_dict(recipe).get("normalize") == "minmax") or not values.any()
    lo, hi = (0.0, 1.0) if scaled else (float(values.min()), float(values.max()))
    fig, axes = plt.subplots(1, n, figsize=(size * n + 1.0, size + 1.0), squeeze=False)
    for i, ax in enumerate(axes[0]):
        ax.imshow(frames[i * step])
        ax.imshow(values[i], cmap=cmap, alpha=alpha, vmin=lo, vmax=hi, extent=(-0.5, w - 0.5, h - 0.5, -0.5),
                  interpolation="nearest")
        label = f"frame {i}" if step == 1 else f"tubelet {i} (frames {i * step}-{(i + 1) * step - 1})"
        ax.set_title(label, fontsize=8)
        ax.set_axis_off()
    fig.suptitle(title if title is not None else map_title(trace, cam_map).replace("\n", " — "), fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    cax = fig.add_axes((0.94, 0.15, 0.012, 0.7))
    fig.colorbar(ScalarMappable(Normalize(lo, hi if hi > lo else lo + 1), cmap=cmap), cax=cax, label="map value")
    return fig
