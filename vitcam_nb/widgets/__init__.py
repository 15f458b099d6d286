"""Notebook widgets (anywidget): slice a trace live in JupyterLab, Notebook 7 or marimo (``mo.ui.anywidget(ex)``;
an example app: ``marimo edit notebooks/explorer_marimo.py``).

* :class:`Explorer`: the image with the heatmap of the current recipe and a control for every taxonomy
  dimension, the live methods paragraph and checklist, degenerate-variant notices; on a many-image store,
  an image picker.
* :class:`Gallery`: thumbnails of a recipe with one or two fields varied; a click opens an Explorer.
* :class:`Compare`: two recipes side by side with their agreement and the differing fields.
* :func:`~vitcam_nb.widgets.standalone.export_html` (``vc.export_html``, ``Explorer.to_html``): the Explorer as
  one self-contained HTML file, every recipe of chosen axes precomputed, for readers with no kernel.

The trace stays in the kernel. The browser receives the image once, then small float32 grids as binary
buffers, which it upsamples and colours on a canvas (plain ES modules in ``static/``, no build step, no
network). Without a widget manager (nbconvert, GitHub) the display falls back to a PNG of the view when it was
displayed, and its text names the recipe shown (:mod:`vitcam_nb.widgets.fallback`); ``.static()`` returns the
matplotlib figure.

Example:
    >>> import vitcam_nb as vc
    >>> from vitcam_nb.widgets import Explorer
    >>> ex = Explorer(tr)   # doctest: +SKIP
    >>> ex                  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vitcam_nb.widgets.compare import Compare
    from vitcam_nb.widgets.explorer import Explorer
    from vitcam_nb.widgets.gallery import Gallery, GalleryGrid

__all__ = ["Compare", "Explorer", "Gallery", "GalleryGrid"]

#: Each widget class and its module. They are imported when first named, not by ``import vitcam_nb``: anywidget
#: brings ipywidgets and IPython (about half a second), which a script, the command line or a dask worker never uses.
_MODULES = {"Compare": "compare", "Explorer": "explorer", "Gallery": "gallery", "GalleryGrid": "gallery"}


def __getattr__(name: str) -> type:
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULES})
