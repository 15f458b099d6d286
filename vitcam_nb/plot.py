"""Matplotlib views of maps and galleries: the static render that works everywhere, widgets or not."""

from __future__ import annotations

import numpy as np
import xarray as xr


def _image(trace: xr.Dataset) -> np.ndarray:
    return np.asarray(trace["image"].values)


def _title(m: xr.DataArray) -> str:
    title = f"recipe {m.attrs.get('recipe_id', '?')}"
    if m.attrs.get("degenerate"):
        title += " — DEGENERATE (zeros)"
    return title


def overlay(trace: xr.Dataset, cam_map: xr.DataArray, *, ax=None, alpha: float = 0.5, cmap: str = "jet",
            title: str | None = None):
    """Draw ``cam_map`` over the trace's display image; returns the matplotlib Figure.

    Example:
        >>> fig = overlay(tr, vc.cam(tr, vc.Recipe()))  # doctest: +SKIP
    """
    import matplotlib.pyplot as plt

    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha: expected a float in [0, 1], got {alpha!r}")
    mine, theirs = str(trace.attrs.get("trace_id", "")), str(cam_map.attrs.get("trace_id", ""))
    if mine and theirs and mine != theirs:
        raise ValueError(f"cam_map: computed from trace {theirs[:12]}…, not from this trace ({mine[:12]}…); "
                         "overlay a map on the image it explains")
    if ax is None:
        fig, ax = plt.subplots(figsize=(4, 4))
    else:
        fig = ax.figure
    img = _image(trace)
    values = np.asarray(cam_map.values, dtype=np.float32)
    h, w = img.shape[:2]
    ax.imshow(img)
    ax.imshow(values, cmap=cmap, alpha=alpha, extent=(-0.5, w - 0.5, h - 0.5, -0.5), interpolation="nearest")
    ax.set_title(title if title is not None else _title(cam_map), fontsize=9)
    ax.set_axis_off()
    return fig


def grid(trace: xr.Dataset, gallery: xr.DataArray, *, alpha: float = 0.5, cmap: str = "jet",
         size: float = 1.6):
    """Plot a gallery with up to two varied dimensions as a grid of overlays; returns the Figure.

    Rows are the first varied dimension, columns the second; degenerate maps are marked.

    Example:
        >>> fig = grid(tr, vc.gallery(tr, vc.Recipe(), vary=("layer", "site")))  # doctest: +SKIP
    """
    import matplotlib.pyplot as plt

    spatial = gallery.dims[-2:]
    varied = list(gallery.dims[:-2])
    if len(varied) > 2:
        raise ValueError(f"gallery: grid() shows at most two varied dimensions, got {varied}; select some first")
    while len(varied) < 2:
        gallery = gallery.expand_dims(f"_{len(varied)}")
        varied.insert(0, f"_{len(varied)}")
    gallery = gallery.transpose(*varied, *spatial)
    n_rows, n_cols = gallery.shape[:2]
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(size * n_cols + 0.8, size * n_rows + 0.6), squeeze=False)
    img = _image(trace)
    h, w = img.shape[:2]
    degenerate = gallery.coords["degenerate"].values if "degenerate" in gallery.coords else None
    for i in range(n_rows):
        for j in range(n_cols):
            ax = axes[i, j]
            ax.imshow(img)
            ax.imshow(np.asarray(gallery.values[i, j]), cmap=cmap, alpha=alpha, vmin=0, vmax=1,
                      extent=(-0.5, w - 0.5, h - 0.5, -0.5))
            ax.set_xticks([])
            ax.set_yticks([])
            if degenerate is not None and np.ndim(degenerate) == 2 and degenerate[i, j]:
                ax.text(0.5, 0.5, "degenerate", transform=ax.transAxes, ha="center", va="center",
                        color="white", fontsize=7, bbox={"facecolor": "black", "alpha": 0.6})
            if j == 0 and not varied[0].startswith("_"):
                ax.set_ylabel(f"{varied[0]} {gallery[varied[0]].values[i]}", fontsize=8)
            if i == 0 and not varied[1].startswith("_"):
                ax.set_title(f"{varied[1]} {gallery[varied[1]].values[j]}", fontsize=8)
    fig.suptitle(f"base recipe {gallery.attrs.get('recipe_id', '?')}", fontsize=9)
    fig.tight_layout()
    return fig
