"""Matplotlib views of the maps of a generative VLM whose image reaches the model as several pieces: one panel per
crop, per view or per tile, each titled in words, never merged into one picture.

Three map shapes come from such traces, and each is drawn on what it was computed on:

* ``(crop, y, x)`` (or ``(crop, patch_row, patch_col)``): a tower site of a trace whose tower ran on several crops
  (LLaVA-NeXT/OneVision tiles, Idefics3/SmolVLM splits). Crop ``k``'s map is drawn over crop ``k``'s own pixels
  (``trace["image"]`` has the same ``crop`` dim), titled with the crop's tile name.
* ``(view, y, x)``: an LM-side site (``projector``, ``lm_resid``, ``lm_attn``) of a multi-tile layout, one map per
  tile group placed on the original image; :func:`vitcam_nb.compute.vlm_crops.stitch_crops` gives the same per
  group (a dict of ``(y, x)`` maps) for the crops' tower maps. They are drawn over the original image when it is
  known (the trace's own single image, or ``image=`` passed in); a crops trace stores only the crops the tower saw,
  so without ``image=`` the maps are drawn alone and the figure says so.
* ``(tile, patch_row, patch_col)``: the per-tile token grids (``upsample="none"``), drawn alone per tile.
* ``(*varied, crop|view|tile, y, x)``: ``vc.gallery`` on an answer trace (:mod:`vitcam_nb.compute.vlm_gallery`):
  one row per gallery cell (labelled with its varied values), one panel per crop (over that crop's pixels), per
  view (over ``image=`` when given) or per tile.

Cells no token or crop covers are NaN: drawn transparent over an image, grey when drawn alone, never as a value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError
from vitcam_nb.core.escape import escape_mathtext
from vitcam_nb.plot_words import map_title, recipe_dict

__all__ = ["views"]

_GREY = (0.85, 0.85, 0.85, 1.0)
_MULTI = ("crop", "view", "tile")


def _text(value: Any) -> str:
    return escape_mathtext(str(value))


def _as_panels(cam_map: Any) -> tuple[str, list[str], np.ndarray, dict]:
    """(leading dim, panel names, (n, h, w) values, attrs) of a crop/view/tile map or a stitch_crops dict."""
    if isinstance(cam_map, Mapping):
        if not cam_map or not all(isinstance(v, xr.DataArray) and v.ndim == 2 for v in cam_map.values()):
            raise ArgumentTypeError("cam_map: expected a crop/view/tile map or the dict of (y, x) maps "
                                    "vitcam_nb.compute.vlm_crops.stitch_crops returns")
        shapes = {v.shape for v in cam_map.values()}
        if len(shapes) != 1:
            raise ArgumentError(f"cam_map: the stitched maps differ in size {sorted(shapes)}")
        first = next(iter(cam_map.values()))
        return "view", [str(k) for k in cam_map], np.stack([np.asarray(v.values, np.float32)
                                                          for v in cam_map.values()]), dict(first.attrs)
    if not isinstance(cam_map, xr.DataArray):
        raise ArgumentTypeError(f"cam_map: expected an xarray DataArray, got {type(cam_map).__name__}")
    if cam_map.ndim != 3 or cam_map.dims[0] not in _MULTI:
        raise ArgumentError(f"cam_map: views() draws a map with dims (crop|view|tile, y, x), got {cam_map.dims}; "
                            "draw a (y, x) map with vc.plot.overlay")
    dim = str(cam_map.dims[0])
    names = [str(v) for v in cam_map[dim].values] if dim in cam_map.coords else \
        [str(k) for k in range(cam_map.shape[0])]
    return dim, names, np.asarray(cam_map.values, np.float32), dict(cam_map.attrs)


def _crop_images(trace: xr.Dataset, n: int) -> np.ndarray:
    if "image" not in getattr(trace, "variables", {}) or "crop" not in trace["image"].dims:
        raise ArgumentError("trace: a (crop, y, x) map is drawn over each crop's pixels, and this trace's image has "
                            "no crop dim; pass the trace the map was computed from")
    images = np.asarray(trace["image"].transpose("crop", ...).values)
    if images.shape[0] != n:
        raise ArgumentError(f"cam_map: has {n} crops, the trace's image {images.shape[0]}")
    return images


def _original(trace: xr.Dataset, image: Any) -> np.ndarray | None:
    """The original image under view maps: ``image`` when given, else the trace's single image, else None."""
    if image is not None:
        img = np.asarray(image)
        if img.ndim not in (2, 3) or (img.ndim == 3 and img.shape[-1] not in (3, 4)) or img.size == 0:
            raise ArgumentError(f"image: expected the original image as (height, width[, 3]), got shape {img.shape}")
        return img
    if "image" in getattr(trace, "variables", {}) and "crop" not in trace["image"].dims:
        return np.asarray(trace["image"].values)
    return None


def _extent(attrs: dict, img: np.ndarray | None, h: int, w: int) -> tuple[float, float, float, float]:
    """Pixel extent of a view map: the original image's, else its stated size (crop_source_size), else its own."""
    if img is not None:
        h, w = img.shape[:2]
    elif "x" in str(attrs.get("crop_source_size", "")):
        h, w = (int(v) for v in str(attrs["crop_source_size"]).split("x"))
    return (-0.5, w - 0.5, h - 0.5, -0.5)


def _scale(values: np.ndarray, attrs: dict) -> tuple[float, float, bool]:
    """(low, high, min-max) of the colour bar: 0..1 for a min-max (or all-zero) map, else the finite range."""
    recipe = attrs.get("recipe")
    finite = values[np.isfinite(values)]
    minmax = bool(recipe) and recipe_dict(recipe).get("normalize") == "minmax"
    if minmax or finite.size == 0 or not finite.any():
        return 0.0, 1.0, minmax
    lo, hi = float(finite.min()), float(finite.max())
    return lo, hi if hi > lo else lo + 1.0, False


def _panel_title(dim: str, k: int, name: str, cam_map: Any) -> str:
    if dim == "crop":
        tile = cam_map["crop_tile"].values[k] if "crop_tile" in cam_map.coords else name
        words = f"crop {k}: {_text(tile)}"
        why = str(cam_map["crop_degenerate"].values[k]) if "crop_degenerate" in cam_map.coords else ""
        return words + ("\nall zeros: " + _text(why.split(" (")[0])[:40] if why else "")
    if dim == "tile":
        group = cam_map["tile_group"].values[k] if "tile_group" in cam_map.coords else ""
        return f"tile {_text(name)}" + (f" ({_text(group)})" if group else "")
    return f"view: {_text(name)}"


def views(trace: xr.Dataset, cam_map: Any, *, image: Any = None, alpha: float = 0.5, cmap: str = "inferno",
          size: float = 2.2, title: str | None = None):
    """Draw a map of a tiled or cropped VLM trace, one panel per crop, view or tile (or a gallery of such maps: one
    row per cell); returns the Figure.

    ``cam_map``: ``vc.cam`` on a crops trace's tower site ``(crop, y, x)`` (each panel over that crop's own pixels,
    titled with its tile name; a degenerate crop says so), on a multi-tile LM site ``(view, y, x)`` or its tiles
    ``(tile, patch_row, patch_col)``, or the dict :func:`vitcam_nb.compute.vlm_crops.stitch_crops` returns (one
    panel per tile group). ``image``: the original image under view maps (a crops trace stores only its crops; the
    trace's own image is used when it has no crop dim); without one the maps are drawn alone and the figure says so.
    One colour bar: a min-max map reads on 0..1 (each crop normalised on its own), other maps on their range; NaN
    cells (no token or crop there) are transparent over an image, grey alone. The suptitle names the recipe and the
    class (unless ``title`` is given).

    Example:
        >>> fig = views(tr, vc.cam(tr, vc.Recipe(site="F1")))  # doctest: +SKIP
    """
    import matplotlib.pyplot as plt
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    if not 0 <= alpha <= 1:
        raise ArgumentError(f"alpha: expected a float in [0, 1], got {alpha!r}")
    if isinstance(cam_map, xr.DataArray) and cam_map.ndim > 3 and cam_map.dims[-3] in _MULTI:
        return _gallery(trace, cam_map, str(cam_map.dims[-3]), image, alpha, cmap, size, title)
    dim, names, values, attrs = _as_panels(cam_map)
    mine, theirs = str(trace.attrs.get("trace_id", "")), str(attrs.get("trace_id", ""))
    if mine and theirs and mine != theirs:
        raise ArgumentError(f"cam_map: computed from trace {theirs[:12]}…, not from this trace ({mine[:12]}…)")
    crops = _crop_images(trace, len(names)) if dim == "crop" else None
    original = _original(trace, image) if dim == "view" else None
    alone = crops is None and original is None
    lo, hi, minmax = _scale(values, attrs)
    colours = colormaps[cmap].with_extremes(bad=_GREY if alone else (0.0, 0.0, 0.0, 0.0))
    n = len(names)
    fig, axes = plt.subplots(1, n, figsize=(size * n + 1.2, size + 1.3), squeeze=False)
    h, w = values.shape[1:]
    for k, ax in enumerate(axes[0]):
        under = crops[k] if crops is not None else original
        extent = _extent(attrs, under, h, w) if dim != "tile" else (-0.5, w - 0.5, h - 0.5, -0.5)
        if under is not None:
            ax.imshow(under, extent=extent)
        ax.imshow(np.ma.masked_invalid(values[k]), cmap=colours, alpha=alpha if under is not None else 1.0,
                  vmin=lo, vmax=hi, extent=extent, interpolation="nearest")
        ax.set_title(_panel_title(dim, k, names[k], cam_map), fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    head = title if title is not None else map_title(trace, xr.DataArray(values[0], attrs=attrs)).replace(
        "\nDEGENERATE: map is all zeros", "").replace("\n", " — ")
    notes = []
    if dim == "view" and alone:
        notes.append("the trace stores only the crops the tower saw, not the original image: maps drawn alone "
                     "(pass image= to draw them over it)")
    if np.isnan(values).any():
        notes.append("grey: no token covers these cells" if alone else "blank: no token covers these cells")
    if attrs.get("degenerate") and dim != "crop":
        notes.append("DEGENERATE: map is all zeros")
    fig.suptitle("\n".join([head, *notes]), fontsize=8.5)
    fig.tight_layout(rect=(0, 0, 0.92, 1))
    cax = fig.add_axes((0.935, 0.15, 0.012, 0.6))
    per_crop = dim == "crop" or bool(attrs.get("stitched_crops"))  # stitch_crops keeps each crop's own scale
    label = "map value (each crop min-max on its own)" if per_crop and minmax else "map value"
    fig.colorbar(ScalarMappable(Normalize(lo, hi), cmap=colours), cax=cax, label=label)
    return fig


def _cell_words(gallery: xr.DataArray, fields: list[str], index: tuple[int, ...]) -> str:
    """A gallery cell's varied values in words ("block 1, site F4")."""
    words = []
    for f, i in zip(fields, index):
        value = gallery[f].values[i] if f in gallery.coords else i
        words.append(f"block {value}" if f == "layer" else f"{f} {value}")
    return _text(", ".join(words))


def _gallery(trace: xr.Dataset, gallery: xr.DataArray, lead: str, image: Any, alpha: float, cmap: str,
             size: float, title: str | None):
    """A gallery with a crop, view or tile dim (module docstring): rows are its cells, columns its crops, views or
    tiles, each panel as :func:`views` draws it, one colour bar."""
    import matplotlib.pyplot as plt
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    at = gallery.dims.index(lead)
    if at != gallery.ndim - 3:
        raise ArgumentError(f"cam_map: a gallery of {lead} maps has dims (*varied, {lead}, y, x), got "
                            f"{gallery.dims}")
    mine, theirs = str(trace.attrs.get("trace_id", "")), str(gallery.attrs.get("trace_id", ""))
    if mine and theirs and mine != theirs:
        raise ArgumentError(f"cam_map: computed from trace {theirs[:12]}…, not from this trace ({mine[:12]}…)")
    fields = [str(d) for d in gallery.dims[:at]]
    cells = list(np.ndindex(*gallery.shape[:at]))
    values = np.asarray(gallery.values, np.float32).reshape(len(cells), *gallery.shape[at:])
    n, (h, w) = values.shape[1], values.shape[2:]
    names = [str(v) for v in gallery[lead].values] if lead in gallery.coords else [str(k) for k in range(n)]
    crops = _crop_images(trace, n) if lead == "crop" else None
    original = _original(trace, image) if lead == "view" else None
    alone = crops is None and original is None
    attrs = dict(gallery.attrs)
    lo, hi, minmax = _scale(values, attrs)
    colours = colormaps[cmap].with_extremes(bad=_GREY if alone else (0.0, 0.0, 0.0, 0.0))
    per_crop = gallery["crop_degenerate"].values.reshape(len(cells), n) if "crop_degenerate" in gallery.coords \
        else np.full((len(cells), n), "")
    cell_why = gallery["degenerate"].values.reshape(len(cells)) if "degenerate" in gallery.coords and \
        lead != "crop" else np.full(len(cells), "")
    fig, axes = plt.subplots(len(cells), n, figsize=(size * n + 1.6, size * len(cells) + 1.3), squeeze=False)
    for r, index in enumerate(cells):
        for k in range(n):
            ax = axes[r, k]
            under = crops[k] if crops is not None else original
            extent = (-0.5, w - 0.5, h - 0.5, -0.5) if lead == "tile" else _extent(attrs, under, h, w)
            if under is not None:
                ax.imshow(under, extent=extent)
            ax.imshow(np.ma.masked_invalid(values[r, k]), cmap=colours, alpha=alpha if under is not None else 1.0,
                      vmin=lo, vmax=hi, extent=extent, interpolation="nearest")
            tile = gallery["crop_tile"].values[k] if "crop_tile" in gallery.coords else k
            words = "" if r else f"crop {k}: {_text(tile)}" if lead == "crop" else _panel_title(lead, k, names[k],
                                                                                                gallery)
            why = str(per_crop[r, k]) or (str(cell_why[r]) if k == 0 else "")
            ax.set_title(words + ("\nall zeros: " + _text(why.split(" (")[0])[:40] if why else ""), fontsize=7.5)
            ax.set_xticks([])
            ax.set_yticks([])
            if k == 0 and fields:
                ax.set_ylabel(_cell_words(gallery, fields, index), fontsize=8)
    head = title if title is not None else map_title(trace, xr.DataArray(values[0, 0], attrs=attrs))
    head = head.replace("\nDEGENERATE: map is all zeros", "").replace("\n", " — ")
    over = {"crop": "over its own pixels", "view": "drawn alone" if alone else "over the original image",
            "tile": "on its token grid"}[lead]
    notes = [f"varied: {_text(', '.join(fields))}; one row per recipe, one panel per {lead} {over}"]
    if lead == "view" and alone:
        notes.append("the trace stores no original image: pass image= to draw the views over it")
    if np.isnan(values).any():
        notes.append("grey: no token covers these cells" if alone else "blank: no token covers these cells")
    fig.suptitle("\n".join([head, *notes]), fontsize=8.5)
    fig.tight_layout(rect=(0, 0, 0.92, 1))
    cax = fig.add_axes((0.935, 0.15, 0.012, 0.6))
    label = "map value (each crop min-max on its own)" if minmax and lead == "crop" else "map value"
    fig.colorbar(ScalarMappable(Normalize(lo, hi), cmap=colours), cax=cax, label=label)
    return fig
