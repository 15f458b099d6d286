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

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from html import escape
from numbers import Integral, Real
from pathlib import Path

import xarray as xr

from vitcam_nb.compute.vlm import VLM_SITES
from vitcam_nb.core.arguments import as_flag
from vitcam_nb.core.errors import ArgumentTypeError, ExportError, OutputExistsError, RecipeError, TraceError
from vitcam_nb.core.outfiles import check_output, write_atomic
from vitcam_nb.core.recipe import Recipe, is_int
from vitcam_nb.core.recipe_space import check_space
from vitcam_nb.core.version import __version__
from vitcam_nb.widgets.assets import STATIC_DIR, css, esm
from vitcam_nb.widgets.bundle import Bundle, build_bundle, export_axes
from vitcam_nb.widgets.controls import COLORMAPS, as_recipe
from vitcam_nb.widgets.facts import TraceFacts
from vitcam_nb.widgets.traces import is_trace_set, named_traces, trace_choices

__all__ = ["export_html", "explorer_html", "page_html"]

_RECIPE_FIELDS = frozenset(f.name for f in dataclasses.fields(Recipe))

# No request of any kind may leave the page: scripts and styles are inline, the image and maps are data.
_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:"
_PAGE_CSS = "body{font-family:system-ui,sans-serif;margin:1em;color:#222}.vc-export-note{color:#555;font-size:.85em}"
# Every page says who wrote it; a file at the export path is replaced only when it carries this mark.
_GENERATOR = f"<meta name='generator' content='vitcam_nb {__version__} export_html'>"
_OURS = re.compile(r"<meta name='generator' content='vitcam_nb [0-9A-Za-z.+-]+ export_html'>")
#: The last line of a page export_html writes: the SHA-256 of every byte before it. A page edited since (a user's
#: notes added) no longer matches and is not replaced without overwrite=True.
_SEAL = re.compile(rb"<!-- vitcam_nb export_html sha256 ([0-9a-f]{64}) -->\n\Z")
# What a video page draws: vc.cam's maps as computed, one colour range for the clip.
_VIDEO_NOTE = ("a video trace of {} frames: each frame's map is the one vc.cam computed (upsampled in space and time); "
               "this page enlarges its pixels, colours every frame on the whole clip's range and draws the overlay.")
#: The least a page spends on each recipe it shows: its own 12-hex-digit id, a hash that does not compress
#: (6 bytes, 8 in base64).
RECIPE_FLOOR_BYTES = 8
#: The display width a page may start with, in CSS pixels.
SIZES = (1, 4096)
#: What a page shows: one trace, or several traces of one image (a dict of named traces, or a list).
Traces = xr.Dataset | Mapping[str, xr.Dataset] | Sequence[xr.Dataset]


def _inline_json(value: object) -> str:
    # Inside <script> only "</" can end the element; \u003c keeps every label (even "</script>") as data.
    return json.dumps(value, separators=(",", ":")).replace("<", "\\u003c")


def page_html(bundle: Bundle, title: str, others: Sequence[Bundle] = ()) -> str:
    """The HTML text of the page for a computed bundle (and, with several traces of one image, the bundles of the
    traces after the first, whose metas are also in ``bundle.meta["trace_parts"]``).

    Example:
        >>> page_html(build_bundle(tr, progress=False), "demo").count("<script")  # doctest: +SKIP
        4
    """
    meta = bundle.meta
    code = esm("explorer.js") + "\n// ---- standalone.js ----\n" + (STATIC_DIR / "standalone.js").read_text("utf-8")
    note = (f"vitcam_nb Explorer, exported: {meta['count']} recipes ({meta['maps']} distinct maps, stored as "
            f"{meta['quantize']}) of model {meta['model']}, trace {meta['trace_id']}. Varied: "
            + "; ".join(f"{name} ({len(values)})" for name, values in meta["axes"])
            + ". Other fields stay as shown; " + (_VIDEO_NOTE.format(meta["frames"]) if meta.get("frames") else
                                                  "upsampling, colours and overlay are drawn in this page."))
    left = meta.get("left_out", "")
    if others:
        parts = [meta, *(b.meta for b in others)]
        note += (" Traces of this image: " + "; ".join(f"{label} (trace {m['trace_id']}, {m['count']} recipes)"
                                                        for (_, label), m in zip(meta["trace_choices"], parts))
                 + ". The trace picker switches between them and keeps the recipe where the other trace holds it.")
    return "\n".join([
        "<!doctype html>",
        "<html lang='en'><head><meta charset='utf-8'>",
        _GENERATOR,
        f"<meta http-equiv='Content-Security-Policy' content=\"{_CSP}\">",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{escape(title)}</title>",
        f"<style>{_PAGE_CSS}\n{css()}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p class='vc-export-note'>{escape(note)}</p>",
        f"<p class='vc-export-note vc-export-left-out'>{escape(left)}</p>" if left else "",
        "<div id='vc-app'></div>",
        "<noscript>This explorer needs JavaScript.</noscript>",
        f"<script type='application/json' id='vc-meta'>{_inline_json(meta)}</script>",
        f"<script type='text/plain' id='vc-maps'>{bundle.maps}</script>",
        f"<script type='text/plain' id='vc-texts'>{bundle.texts}</script>",
        *(f"<script type='text/plain' id='vc-maps-{i}'>{b.maps}</script>\n"
          f"<script type='text/plain' id='vc-texts-{i}'>{b.texts}</script>" for i, b in enumerate(others, 1)),
        f"<script type='module'>{code}</script>",
        "</body></html>",
    ])


def explorer_html(trace: Traces, recipe: Recipe | None = None, *, axes: Mapping[str, Sequence] | None = None,
                  quantize: str = "uint8", colormap: str = "inferno", opacity: float = 0.5, size: int = 360,
                  title: str | None = None, progress: bool = True) -> str:
    """The exported Explorer as an HTML string (see :func:`export_html` for the arguments).

    Example:
        >>> explorer_html(tr, axes={"site": ["F1"]}, progress=False)[:15]  # doctest: +SKIP
        '<!doctype html>'
    """
    return _page(trace, recipe, axes, quantize, colormap, opacity, size, title, progress)[1]


def _check_display(trace: object, colormap: object, opacity: object, size: object, title: object) -> None:
    """Refuse a display argument, or a trace the page cannot show, before any map is computed."""
    if isinstance(trace, xr.Dataset) and "store_kind" in trace.attrs:
        raise TraceError("trace: this is a trace_many store of many images; a page shows one image's trace: "
                         "export vitcam_nb.image_trace(store, i)")
    if not isinstance(colormap, str) or colormap not in COLORMAPS:
        raise ExportError(f"colormap: expected one of {list(COLORMAPS)}, got {colormap!r}")
    if isinstance(opacity, bool) or not isinstance(opacity, Real):
        raise ArgumentTypeError(f"opacity: expected a number in [0, 1], got {opacity!r}")
    if not 0.0 <= float(opacity) <= 1.0:
        raise ExportError(f"opacity: expected a number in [0, 1], got {opacity!r}")
    if isinstance(size, bool) or not isinstance(size, Integral):
        raise ArgumentTypeError(f"size: expected a whole number of pixels from {SIZES[0]} to {SIZES[1]}, got {size!r}")
    if not SIZES[0] <= int(size) <= SIZES[1]:
        raise ExportError(f"size: expected a display width from {SIZES[0]} to {SIZES[1]} pixels, got {size!r}")
    if title is not None and not isinstance(title, str):
        raise ArgumentTypeError(f"title: expected a string or None, got {type(title).__name__}")


def _traces_of(trace: Traces) -> dict[str, xr.Dataset]:
    """``{name: trace}`` of an export: one trace (named ""), or several traces of one image, checked as the
    Explorer checks them (:func:`~vitcam_nb.widgets.traces.named_traces`)."""
    return named_traces(trace) if is_trace_set(trace) else {"": trace}  # type: ignore[arg-type]


def _page(trace: Traces, recipe: Recipe | None, axes: Mapping[str, Sequence] | None, quantize: str,
          colormap: str, opacity: float, size: int, title: str | None, progress: bool,
          max_mb: float | None = None) -> tuple[Bundle, str]:
    named = _traces_of(trace)
    for one in named.values():
        _check_display(one, colormap, opacity, size, title)
    # Several traces share the budget: each trace's table may use its part of it.
    budget = None if max_mb is None else (float(max_mb) * 1e6 - _code_bytes()) / len(named)
    # The page opens on the first trace: its table must hold the asked recipe; another trace's table (a trace the
    # picker switches to, e.g. one without the rule the recipe names) opens on its first map the trace gives.
    bundle, *others = [build_bundle(one, recipe, axes=axes, quantize=quantize, progress=progress, max_bytes=budget,
                                    start_required=(i == 0))
                       for i, one in enumerate(named.values())]
    bundle.meta.update(colormap=colormap, opacity=float(opacity), size=int(size))
    if others:
        bundle.meta.update(trace_choices=trace_choices(named), trace_shown=next(iter(named)),
                           trace_parts=[b.meta for b in others])
    model = next(iter(named.values())).attrs.get("model_name", "trace")
    return bundle, _sealed(page_html(bundle, title or f"vitcam_nb Explorer: {model}", others))


def _sealed(html: str) -> str:
    """``html`` with its seal: a last line holding the SHA-256 of its UTF-8 bytes."""
    return html + f"\n<!-- vitcam_nb export_html sha256 {hashlib.sha256(html.encode('utf-8')).hexdigest()} -->\n"


def _page_state(path: Path) -> str:
    """"ours" for a page export_html wrote and nobody changed since (its seal matches), "edited" for one of its
    pages whose bytes changed (or written before pages were sealed: unknown), "other" for any other file."""
    try:
        data = path.read_bytes()
    except OSError:
        return "other"
    head = data[:4096].decode("utf-8", "replace")
    if not (head.startswith("<!doctype html>") and _OURS.search(head) is not None):
        return "other"
    seal = _SEAL.search(data)
    body = data[:seal.start()].removesuffix(b"\n") if seal else b""
    return "ours" if seal and hashlib.sha256(body).hexdigest() == seal.group(1).decode() else "edited"


def _is_page(path: Path) -> bool:
    """Whether the file at ``path`` is a page export_html wrote, as it wrote it (its generator mark in the head
    and its seal, the SHA-256 of the page, at the end)."""
    return _page_state(path) == "ours"


def _code_bytes() -> int:
    return len(esm("explorer.js")) + len((STATIC_DIR / "standalone.js").read_text("utf-8")) + len(css())


def _check_limit(trace: Traces, axes: Mapping[str, Sequence] | None, max_mb: object) -> None:
    """Refuse ``max_mb`` when it is not a size, or when the axes alone need more: the page code plus
    :data:`RECIPE_FLOOR_BYTES` per recipe (counted from the axes, before any map is computed)."""
    if max_mb is None:
        return
    if isinstance(max_mb, bool) or not isinstance(max_mb, Real):
        raise ArgumentTypeError(f"max_mb: expected a number of megabytes > 0 or None, got {max_mb!r}")
    if not float(max_mb) > 0:
        raise ExportError(f"max_mb: expected a number of megabytes > 0 or None, got {max_mb!r}")
    count = sum(math.prod(len(v) for v in export_axes(TraceFacts.of(one), axes).values())
                for one in _traces_of(trace).values())
    floor = _code_bytes() + count * RECIPE_FLOOR_BYTES
    if floor > float(max_mb) * 1e6:
        raise ExportError(f"max_mb: the {count} recipes of these axes need at least {floor / 1e6:.2f} MB if each "
                          f"is a distinct recipe the page can show (its code and {RECIPE_FLOOR_BYTES} bytes a recipe), "
                          f"over {max_mb} MB; nothing was computed or written. Narrow axes=")


def _check_start(trace: Traces, recipe: Recipe | None, axes: Mapping[str, Sequence] | None) -> None:
    """Refuse, before any map, a class no model output has (``axes`` class 7 of a 5-class model: every recipe with
    it would only be refused and left out) and a starting recipe whose block or class the model lacks (the page
    would open on another recipe than the one asked for, as ``vc.cam`` refuses it)."""
    start = None if recipe is None else as_recipe(recipe)
    classes = axes.get("class_") if isinstance(axes, Mapping) else None
    for one in _traces_of(trace).values():
        n_classes = one.sizes.get("class")
        n_layers = int(one.attrs.get("num_layers", 0))
        if start is not None and start.site in VLM_SITES and f"{start.site}_grad" in one.variables:
            # a VLM's projector (one layer) and LM sites (the LM's layers), not the tower's blocks
            n_layers = 1 if start.site == "projector" else int(one.sizes.get("lm_layer", 1))
        if n_classes and isinstance(classes, (list, tuple)):
            bad = [c for c in classes if is_int(c) and not 0 <= int(c) < n_classes]
            if bad:
                raise RecipeError(f"axes: class_ {bad[0]!r} is out of range for a model with {n_classes} classes "
                                  f"(allowed 0..{n_classes - 1} or 'topN')")
        if start is None:
            continue
        if n_classes and is_int(start.class_) and not 0 <= int(start.class_) < n_classes:
            raise RecipeError(f"recipe: class_ {start.class_!r} is out of range for a model with {n_classes} classes")
        layers = start.layer if isinstance(start.layer, tuple) else (start.layer,)
        bad = [v for v in layers if is_int(v) and n_layers and not -n_layers <= int(v) < n_layers]
        if bad:
            raise RecipeError(f"recipe: layer {bad[0]!r} is out of range for a model with {n_layers} blocks (allowed "
                              f"{-n_layers}..{n_layers - 1}); the page would open on another recipe")


def _check_axes(axes: Mapping[str, Sequence] | None) -> None:
    """Refuse a value no recipe can take (a typo such as ``"f4"``) before any map is computed: otherwise every
    combination holding it is refused and the value silently left out of the page. The shape of ``axes`` (a dict
    of recipe fields to non-empty lists, ``"all"``) is checked by :func:`export_axes`."""
    if not isinstance(axes, Mapping):
        return
    # Values of a type no field takes (an object) are left to export_axes, whose type check names them.
    check_space({name: values for name, values in axes.items()
                 if name in _RECIPE_FIELDS and isinstance(values, (list, tuple))
                 and all(isinstance(v, (str, int, float, list, tuple)) for v in values)}, "axes")


def export_html(trace: Traces, path: str | os.PathLike, recipe: Recipe | None = None, *,
                axes: Mapping[str, Sequence] | None = None, quantize: str = "uint8", colormap: str = "inferno",
                opacity: float = 0.5, size: int = 360, title: str | None = None, max_mb: float | None = None,
                progress: bool = True, overwrite: bool = False) -> Path:
    """Write the Explorer of ``trace`` as one self-contained HTML file that works from ``file://`` with no
    server, kernel or network: the same controls, canvas, colour bar, checklist, methods paragraph and
    recipe id as :class:`~vitcam_nb.Explorer`, for every recipe in ``axes``.

    The page offers only what it can show: an axis value (e.g. a weighting that needs ``vc.score`` outputs the
    trace lacks) whose every combination is refused, and a preset whose recipe is not in the page, are left out,
    and one paragraph of the page says which and why. Every argument is checked before any map is computed.

    Args:
        trace: a Dataset from :func:`vitcam_nb.trace` (one stage of a hierarchical trace; one image of a store),
            or several traces of one image as :class:`~vitcam_nb.Explorer` takes them (``{"gradient": tr,
            "cp_lrp": rel}``, or a list named by backward rule): the page then has a trace picker, the axes are
            exported for each trace (the file grows with each), and ``max_mb`` is shared between them.
        path: the file to write. An existing file is replaced only when it is a page this function wrote and
            nobody changed since (a page ends with the SHA-256 of its bytes); anything else, an edited page too, is
            refused (:class:`~vitcam_nb.OutputExistsError`) unless ``overwrite=True``. The
            page is written to a temporary file and renamed, so a failed write leaves the old file whole.
        recipe: the recipe shown first; fields not in ``axes`` keep its values (default: the Explorer's).
        axes: recipe field -> values varied in the page. Default: site x layer x weighting x target x
            class on the traced sites, layers and classes; a field given here replaces its default (e.g.
            ``{"site": ["F1"], "layer": [-1]}`` shrinks the file), any other field may be added
            (``{"upsample": ["bilinear", "nearest"]}``). A layer outside the model is refused, as vc.cam does.
        quantize: how maps are stored: "uint8" (per-map codes of 1/255 of its range; default), "float16",
            or "float32" (bit-exact).
        colormap, opacity, size: the display the page starts with (size: 1 to 4096 CSS pixels).
        title: the page title.
        max_mb: refuse (:class:`~vitcam_nb.ExportError`, nothing written) when the file would be larger: at once
            when the axes alone need more (:data:`RECIPE_FLOOR_BYTES` a recipe), while computing as soon as the
            recipes computed so far need more, else once the page is built.
        progress: a progress bar over the recipes.
        overwrite: replace a file at ``path`` that this function did not write (True or False; anything else is
            refused with :class:`~vitcam_nb.ArgumentTypeError`).

    Returns the path written; one line with the size is printed before writing (what the page leaves out is
    named in the page).

    Example:
        >>> vc.export_html(tr, "explorer.html", axes={"site": ["F1", "F6"]})  # doctest: +SKIP
        explorer.html: 0.41 MB (648 recipes, 590 maps as uint8)
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"path: expected a file path (str or pathlib.Path), got {type(path).__name__}")
    path = Path(path)
    overwrite, progress = as_flag("overwrite", overwrite), as_flag("progress", progress)
    _check_display(trace, colormap, opacity, size, title)
    _check_axes(axes)
    _check_start(trace, recipe, axes)
    _check_limit(trace, axes, max_mb)
    if not overwrite and path.is_file() and _page_state(path) == "edited":
        raise OutputExistsError(f"path: {path} is a page export_html wrote, changed since (its bytes no longer match "
                                "the SHA-256 it was written with, or it was written before pages carried one); it is "
                                "left alone. Use another path, or overwrite=True (--overwrite) to replace it")
    check_output(path, overwrite=overwrite, ours=_is_page, what="page")
    bundle, html = _page(trace, recipe, axes, quantize, colormap, opacity, size, title, progress, max_mb)
    data = html.encode("utf-8")
    meta = bundle.meta
    if max_mb is not None and len(data) > float(max_mb) * 1e6:
        raise ExportError(f"max_mb: the file would be {len(data) / 1e6:.2f} MB, over {max_mb} MB; narrow axes= "
                          "or use quantize='uint8'")
    # One short line: what is not offered is said once, in the page itself (its note), not on every call.
    print(f"{path.name}: {len(data) / 1e6:.2f} MB ({meta['count']} recipes, {meta['maps']} maps as "
          f"{meta['quantize']})" + ("; the page names what it leaves out" if meta["left_out"] else ""))
    return write_atomic(path, data)
