"""The Explorer as one self-contained HTML file, for readers with no Python, kernel or network: a handout, a
paper's supplementary file. The page runs the Explorer's own browser code (``static/core.js``,
``explorer.js``) against a local stand-in for the kernel (``static/standalone.js``) that answers each
control change from the precomputed maps of :mod:`vitcam_nb.widgets.bundle`. Every script and style is
inline; a Content-Security-Policy forbids the page any request.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1")
    >>> html = explorer_html(tr, axes={"site": ["F1", "F4"]}, progress=False)
    >>> html.startswith("<!doctype html>"), "https://" in html
    (True, False)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path

import xarray as xr

from vitcam_nb.core.recipe import Recipe
from vitcam_nb.widgets.assets import STATIC_DIR, css, esm
from vitcam_nb.widgets.bundle import Bundle, build_bundle
from vitcam_nb.widgets.controls import COLORMAPS

__all__ = ["export_html", "explorer_html", "page_html"]

# No request of any kind may leave the page: scripts and styles are inline, the image and maps are data.
_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:"
_PAGE_CSS = "body{font-family:system-ui,sans-serif;margin:1em;color:#222}.vc-export-note{color:#555;font-size:.85em}"


def _inline_json(value: object) -> str:
    # Inside <script> only "</" can end the element; \u003c keeps every label (even "</script>") as data.
    return json.dumps(value, separators=(",", ":")).replace("<", "\\u003c")


def page_html(bundle: Bundle, title: str) -> str:
    """The HTML text of the page for a computed bundle.

    Example:
        >>> page_html(build_bundle(tr, progress=False), "demo").count("<script")  # doctest: +SKIP
        4
    """
    meta = bundle.meta
    code = esm("explorer.js") + "\n// ---- standalone.js ----\n" + (STATIC_DIR / "standalone.js").read_text("utf-8")
    note = (f"vitcam_nb Explorer, exported: {meta['count']} recipes ({meta['maps']} distinct maps, stored as "
            f"{meta['quantize']}) of model {meta['model']}, trace {meta['trace_id']}. Varied: "
            + "; ".join(f"{name} ({len(values)})" for name, values in meta["axes"])
            + ". Other fields stay as shown; upsampling, colours and overlay are drawn in this page.")
    return "\n".join([
        "<!doctype html>",
        "<html lang='en'><head><meta charset='utf-8'>",
        f"<meta http-equiv='Content-Security-Policy' content=\"{_CSP}\">",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{escape(title)}</title>",
        f"<style>{_PAGE_CSS}\n{css()}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p class='vc-export-note'>{escape(note)}</p>",
        "<div id='vc-app'></div>",
        "<noscript>This explorer needs JavaScript.</noscript>",
        f"<script type='application/json' id='vc-meta'>{_inline_json(meta)}</script>",
        f"<script type='text/plain' id='vc-maps'>{bundle.maps}</script>",
        f"<script type='text/plain' id='vc-texts'>{bundle.texts}</script>",
        f"<script type='module'>{code}</script>",
        "</body></html>",
    ])


def explorer_html(trace: xr.Dataset, recipe: Recipe | None = None, *, axes: Mapping[str, Sequence] | None = None,
                  quantize: str = "uint8", colormap: str = "jet", opacity: float = 0.5, size: int = 360,
                  title: str | None = None, progress: bool = True) -> str:
    """The exported Explorer as an HTML string (see :func:`export_html` for the arguments).

    Example:
        >>> explorer_html(tr, axes={"site": ["F1"]}, progress=False)[:15]  # doctest: +SKIP
        '<!doctype html>'
    """
    return _page(trace, recipe, axes, quantize, colormap, opacity, size, title, progress)[1]


def _page(trace: xr.Dataset, recipe: Recipe | None, axes: Mapping[str, Sequence] | None, quantize: str,
          colormap: str, opacity: float, size: int, title: str | None, progress: bool) -> tuple[Bundle, str]:
    if colormap not in COLORMAPS:
        raise ValueError(f"colormap: expected one of {list(COLORMAPS)}, got {colormap!r}")
    if not 0.0 <= float(opacity) <= 1.0:
        raise ValueError(f"opacity: expected a float in [0, 1], got {opacity!r}")
    bundle = build_bundle(trace, recipe, axes=axes, quantize=quantize, progress=progress)
    bundle.meta.update(colormap=colormap, opacity=float(opacity), size=int(size))
    return bundle, page_html(bundle, title or f"vitcam_nb Explorer: {trace.attrs.get('model_name', 'trace')}")


def export_html(trace: xr.Dataset, path: str | Path, recipe: Recipe | None = None, *,
                axes: Mapping[str, Sequence] | None = None, quantize: str = "uint8", colormap: str = "jet",
                opacity: float = 0.5, size: int = 360, title: str | None = None, max_mb: float | None = None,
                progress: bool = True) -> Path:
    """Write the Explorer of ``trace`` as one self-contained HTML file that works from ``file://`` with no
    server, kernel or network: the same controls, canvas, colour bar, checklist, methods paragraph and
    recipe id as :class:`~vitcam_nb.Explorer`, for every recipe in ``axes``.

    Args:
        trace: a Dataset from :func:`vitcam_nb.trace` (one stage of a hierarchical trace).
        path: the file to write.
        recipe: the recipe shown first; fields not in ``axes`` keep its values (default: the Explorer's).
        axes: recipe field -> values varied in the page. Default: site x layer x weighting x target x
            class on the traced sites, layers and classes; a field given here replaces its default (e.g.
            ``{"site": ["F1"], "layer": [-1]}`` shrinks the file), any other field may be added
            (``{"upsample": ["bilinear", "nearest"]}``).
        quantize: how maps are stored: "uint8" (per-map codes of 1/255 of its range; default), "float16",
            or "float32" (bit-exact).
        colormap, opacity, size: the display the page starts with.
        title: the page title.
        max_mb: refuse (ValueError, nothing written) when the file would be larger.
        progress: a progress bar over the recipes.

    Returns the path written; the size is printed before writing.

    Example:
        >>> vc.export_html(tr, "explorer.html", axes={"site": ["F1", "F6"]})  # doctest: +SKIP
        explorer.html: 0.41 MB (648 recipes, 590 maps as uint8)
    """
    bundle, html = _page(trace, recipe, axes, quantize, colormap, opacity, size, title, progress)
    data = html.encode("utf-8")
    meta = bundle.meta
    line = (f"{Path(path).name}: {len(data) / 1e6:.2f} MB ({meta['count']} recipes, {meta['maps']} maps as "
            f"{meta['quantize']})")
    if max_mb is not None and len(data) > max_mb * 1e6:
        raise ValueError(f"max_mb: the file would be {len(data) / 1e6:.2f} MB, over {max_mb} MB; narrow axes= "
                         "or use quantize='uint8'")
    print(line)
    path = Path(path)
    path.write_bytes(data)
    return path
