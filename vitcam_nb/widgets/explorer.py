"""The Explorer: one trace (or one image of a many-image store, with an image picker), the heatmap of the
current recipe and a control for every taxonomy dimension. The trace stays in the kernel; the browser gets
the image once and then one small float32 grid per change, which it upsamples and colours itself. A video
trace gets a frame slider: the page shows one frame of the clip under that frame of ``vc.cam(trace, recipe)``.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), np.zeros((224, 224, 3), np.uint8), targets="top1")
    >>> ex = Explorer(tr, vc.Recipe(site="F4", layer=0))
    >>> ex.map.shape, ex.images
    ((14, 14), [])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import anywidget
import numpy as np
import traitlets as t
import xarray as xr

from vitcam_nb.api import cam
from vitcam_nb.capture.reader import image_choices, is_store
from vitcam_nb.compute.map_store import is_map_store
from vitcam_nb.core.errors import (
    ArgumentError,
    ArgumentIndexError,
    ArgumentTypeError,
    DegenerateMapWarning,
    RecipeError,
)
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.plot import frame_strip, overlay
from vitcam_nb.widgets.assets import css, esm
from vitcam_nb.widgets.controls import COLORMAPS, as_recipe, coerce_request
from vitcam_nb.widgets.encoding import grid_bytes, grid_from_bytes, image_rgba
from vitcam_nb.widgets.fallback import static_bundle, summary
from vitcam_nb.widgets.mapstore import display_trace, explorer_view, read_image
from vitcam_nb.widgets.prefetch import prefetch_message
from vitcam_nb.widgets.results import GridResult, check_frame, compute_grid, error_text, frame_slice
from vitcam_nb.widgets.standalone import explorer_html, export_html
from vitcam_nb.widgets.traces import TracePicker, is_trace_set, named_traces, trace_choices
from vitcam_nb.widgets.traits import Opacity, Pixels

__all__ = ["Explorer"]


class Explorer(TracePicker, anywidget.AnyWidget):
    """Interactive Grad-CAM explorer for one trace, or for the images of a many-image store.

    The image with the heatmap of the current recipe overlaid; a control for every taxonomy dimension
    (controls that do not apply to the current choices are hidden); overlay opacity and colormap; the
    live methods paragraph and checklist with copy buttons; the recipe id; a notice, starting with its cause
    (e.g. "zero gradient"), when the variant is degenerate. A refused combination (a control, or a preset this
    trace cannot give) shows its message in the widget, never a traceback, and the controls go back to the
    recipe whose map is shown. Given a store
    (``vc.open_traces``), the page shows an image picker; switching image keeps the recipe. Given a map store
    (``vc.open_maps``), the controls offer only the recipes it holds, each map read as ``vc.cam`` reads it,
    drawn over a grey image (a map store holds no pixels). Given several traces of one image (``{"gradient": tr,
    "cp_lrp": rel}``, or a list named by backward rule), the page shows a trace picker; switching trace keeps the
    recipe (``trace_name``; see :class:`~vitcam_nb.widgets.traces.TracePicker`). Given a video trace (VideoMAE,
    ViViT, TimeSformer), the page has a frame slider (``frame_index``): it shows that frame of the clip under that
    frame of ``vc.cam(trace, recipe)`` (upsampled in space and time and normalised over the whole clip, as vc.cam
    gives it: drawn pixel for pixel, coloured on the clip's one scale); with ``upsample="none"``, the token grid of
    the frame's tubelet. Switching frame keeps the recipe and computes nothing.

    Args:
        trace: a Dataset from :func:`vitcam_nb.trace`, or a many-image Dataset from
            :func:`vitcam_nb.open_traces` or :func:`vitcam_nb.open_maps`, or several traces of one image (same
            ``input_sha256``, else a :class:`~vitcam_nb.core.errors.TraceError` before any map is computed): a
            dict ``{name: trace}``, or a list or tuple named by each trace's backward rule. The first is shown
            first.
        recipe: the recipe to start from (default :class:`~vitcam_nb.Recipe` ``()``, moved to a traced
            site/class if needed).
        opacity: overlay opacity in [0, 1].
        colormap: one of ``inferno`` (default, perceptually uniform), ``viridis``, ``gray`` or ``jet``.
        size: display width of the image in CSS pixels.
        index: with a store, the position of the image shown first.
        frame_index: with a video trace, the frame shown first.

    Example:
        >>> import vitcam_nb as vc
        >>> ex = vc.Explorer(tr)                       # doctest: +SKIP
        >>> ex                                         # doctest: +SKIP
        >>> ex.recipe = ex.recipe.replace(site="F4")   # doctest: +SKIP
        >>> ex.recipe.site                             # doctest: +SKIP
        'F4'
    """

    _esm = esm("explorer.js")
    _css = css()

    options = t.Dict().tag(sync=True)
    image = t.Bytes().tag(sync=True)
    image_shape = t.List(t.Int()).tag(sync=True)
    size = Pixels(360).tag(sync=True)
    opacity = Opacity(0.5).tag(sync=True)
    colormap = t.Enum(COLORMAPS, default_value="inferno").tag(sync=True)

    recipe_json = t.Unicode().tag(sync=True)
    recipe_id = t.Unicode().tag(sync=True)
    grid = t.Bytes().tag(sync=True)
    grid_shape = t.List(t.Int()).tag(sync=True)
    checklist = t.Dict().tag(sync=True)
    checklist_md = t.Unicode().tag(sync=True)
    methods = t.Unicode().tag(sync=True)
    degenerate = t.Unicode().tag(sync=True)
    notes = t.Unicode().tag(sync=True)
    error = t.Unicode().tag(sync=True)

    #: With a store: [label, position] of every image, for the page's picker; empty for a single trace.
    images = t.List().tag(sync=True)
    #: With a store: the position of the image shown (set by the kernel once the image is shown).
    image_index = t.Int(0).tag(sync=True)
    #: The page's picker: {"id": int, "index": int}; answered like a recipe request (image_index, or error).
    image_request = t.Dict().tag(sync=True, echo_update=False)

    #: The browser's change: {"id": int, "recipe": {field: value}, "changed": [field, ...]}.
    request = t.Dict().tag(sync=True, echo_update=False)
    #: The id of the last browser request answered; the browser ignores answers older than its newest request.
    response_id = t.Int(0).tag(sync=True)
    #: Incremented with every answer (from the browser's requests or from Python), so the page repaints.
    frame = t.Int(0).tag(sync=True)
    #: Send the page the neighbouring views after each answer and paint cached views without a round trip
    #: (off: every change waits for the kernel, as benchmarks of the round trip need).
    prefetch = t.Bool(True).tag(sync=True)

    #: With a video trace: the number of frames of its clip, for the page's frame slider; 0 for an image trace.
    frames = t.Int(0).tag(sync=True)
    #: With a video trace: the frame shown (set by the kernel once it is shown).
    frame_shown = t.Int(0).tag(sync=True)
    #: The page's frame slider: {"id": int, "index": int}; answered like an image request (frame_shown, or error).
    frame_request = t.Dict().tag(sync=True, echo_update=False)
    #: With a video trace: the [low, high] the colours span, the map's range over the whole clip; else empty.
    value_range = t.List(t.Float()).tag(sync=True)

    def __init__(self, trace: xr.Dataset, recipe: Recipe | None = None, *, opacity: float = 0.5,
                 colormap: str = "inferno", size: int = 360, index: int = 0,
                 frame_index: int = 0, **kwargs: Any) -> None:
        if not 0.0 <= float(opacity) <= 1.0:
            raise ArgumentError(f"opacity: expected a float in [0, 1], got {opacity!r}")
        if colormap not in COLORMAPS:
            raise ArgumentError(f"colormap: expected one of {list(COLORMAPS)}, got {colormap!r}")
        named = named_traces(trace) if is_trace_set(trace) else {}
        if named:
            trace = next(iter(named.values()))
        self._store = trace if is_store(trace) else None
        choices = []
        if self._store is not None:
            choices = [[label, pos] for label, pos in image_choices(self._store)]
            if not choices:
                raise ArgumentError("store: holds no traced images yet")
            trace = read_image(self._store, index)
        facts, options, start = explorer_view(trace)
        check_frame(frame_index, facts.frames)
        start = start if recipe is None else as_recipe(recipe)
        first = compute_grid(trace, start)  # raises for a recipe this trace cannot give: fail at construction
        shown = facts.image if facts.clip is None else facts.clip[frame_index]
        super().__init__(options=options, image=image_rgba(shown),
                         image_shape=list(facts.image.shape[:2]), opacity=float(opacity), colormap=colormap,
                         size=int(size), images=choices, image_index=int(index) if choices else 0,
                         trace_choices=trace_choices(named), trace_shown=next(iter(named), ""),
                         frames=facts.frames, frame_shown=int(frame_index), **kwargs)
        self._traces = named
        self._trace = trace
        self._facts = facts
        self._recipe = start
        self._callbacks: list[Callable[[Recipe], Any]] = []
        self._publish(first, response_id=0)
        self.observe(self._on_request, names="request")
        self.observe(self._on_image_request, names="image_request")
        self.observe(self._on_trace_request, names="trace_request")
        self.observe(self._on_frame_request, names="frame_request")
        self.on_msg(self._on_custom)

    # -- Python API --------------------------------------------------------------------------------
    @property
    def trace(self) -> xr.Dataset:
        """The trace this explorer slices (with a store: the shown image's; with several traces: the shown one),
        kept in the kernel.

        Example:
            >>> ex.trace is tr  # doctest: +SKIP
            True
        """
        return self._trace

    @property
    def store(self) -> xr.Dataset | None:
        """The many-image Dataset this explorer picks images from, or None for a single trace.

        Example:
            >>> vc.Explorer(vc.open_traces("traces.zarr")).store is not None  # doctest: +SKIP
            True
        """
        return self._store

    @property
    def index(self) -> int:
        """With a store: the position of the image shown; setting it switches image and keeps the recipe.

        Example:
            >>> ex.index = 3  # doctest: +SKIP
        """
        return int(self.image_index)

    @index.setter
    def index(self, value: int) -> None:
        if self._store is None:
            raise ArgumentTypeError("index: this Explorer shows a single trace; pass a many-image store "
                                    "(vc.open_traces) to pick images")
        n = len(self.images)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < n:
            raise ArgumentIndexError(f"index: expected an int in [0, {n - 1}], got {value!r}")
        self._show_image(int(value))  # a Python caller gets the exception (e.g. a class this image lacks)

    @property
    def frame_index(self) -> int:
        """With a video trace: the frame shown; setting it shows that frame of the clip and of the current map
        (nothing is recomputed).

        Example:
            >>> ex.frame_index = 2  # doctest: +SKIP
        """
        return int(self.frame_shown)

    @frame_index.setter
    def frame_index(self, value: int) -> None:
        if not self.frames:
            raise ArgumentTypeError("frame_index: this Explorer shows an image trace; a video trace (vc.trace of a "
                                    "clip) has frames to pick")
        check_frame(value, self.frames)
        self._show_frame(int(value))

    @property
    def recipe(self) -> Recipe:
        """The current recipe: the one whose map is shown. Setting it updates the page.

        Example:
            >>> ex.recipe = vc.Recipe(site="F6", layer=3)  # doctest: +SKIP
        """
        return self._recipe

    @recipe.setter
    def recipe(self, value: Recipe | dict | str) -> None:
        recipe = as_recipe(value)
        result = compute_grid(self._trace, recipe)  # a Python caller gets the exception
        self._publish(result, response_id=self.response_id)

    @property
    def map(self) -> np.ndarray:
        """The grid the browser shows: ``vc.cam(trace, recipe, grid=True).values`` as float32; of a video trace,
        the frame shown: ``vc.cam(trace, recipe).values[ex.frame_index]`` (with ``upsample="none"``, the token
        grid of its tubelet).

        Example:
            >>> ex.map.shape == (tr.attrs["grid_h"], tr.attrs["grid_w"])  # doctest: +SKIP
            True
        """
        return grid_from_bytes(self.grid, self.grid_shape)

    def cam(self) -> xr.DataArray:
        """The full-resolution map of the current recipe (``vc.cam(trace, recipe)``; of a video trace the whole
        clip's), with its attrs.

        Example:
            >>> ex.cam().dims  # doctest: +SKIP
            ('y', 'x')
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DegenerateMapWarning)
            return cam(self._trace, self._recipe)

    def on_change(self, callback: Callable[[Recipe], Any]) -> None:
        """Call ``callback(recipe)`` after every change of the shown recipe (from the page or Python).

        Example:
            >>> ex.on_change(lambda r: print(r.id))  # doctest: +SKIP
        """
        self._callbacks.append(callback)

    def static(self) -> Any:
        """The current view as a matplotlib Figure (for static renders, papers and widget-less viewers): the map
        over the image with its colour bar, titled with the recipe in words, the class and the recipe id; of a
        video trace, the strip of every frame (``vc.plot.frame_strip``). Its PNG is stored with the widget's
        output when it is displayed (see :mod:`vitcam_nb.widgets.fallback`).

        Example:
            >>> fig = ex.static()  # doctest: +SKIP
        """
        if self.frames:
            return frame_strip(self._trace, self.cam(), alpha=self.opacity, cmap=self.colormap)
        shown = display_trace(self._trace, self._facts) if is_map_store(self._trace) else self._trace
        fig = overlay(shown, self.cam(), alpha=self.opacity, cmap=self.colormap)
        ax = fig.axes[0]  # the recipe's id under its words, as the page shows it: the picture names its map
        ax.set_title(f"{ax.get_title()}\nrecipe {self._recipe.id}", fontsize=9)
        return fig

    def to_html(self, path: str | None = None, *, axes: Mapping[str, Any] | None = None, quantize: str = "uint8",
                progress: bool = True) -> str:
        """This explorer as one self-contained HTML page (no kernel, no network), starting at the current
        recipe, colormap, opacity and size; see :func:`vitcam_nb.export_html` for ``axes`` and ``quantize``.
        With several traces, the page holds each (its trace picker starting at the one shown); of a video trace,
        every frame (its slider starting at frame 0).
        With ``path``, the page is also written there (its size printed first).

        Example:
            >>> html = ex.to_html(axes={"site": ["F1", "F4"]})  # doctest: +SKIP
        """
        if is_map_store(self._trace):
            raise ArgumentTypeError("to_html: a page precomputes its axes' maps from a trace; a map store holds only "
                                    "its recipes' maps: export vc.image_trace of a trace store instead")
        args = dict(recipe=self._recipe, axes=axes, quantize=quantize, colormap=self.colormap,
                    opacity=self.opacity, size=self.size, progress=progress)
        # With several traces the page holds them all, starting at the one shown.
        shown = {self.trace_shown: self._trace, **self._traces} if self._traces else self._trace
        if path is not None:
            return export_html(shown, path, **args).read_text(encoding="utf-8")
        return explorer_html(shown, **args)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        # The live view, and for viewers without widgets the picture of this moment's view and what it shows.
        where = [f"image {self.image_index + 1} of {len(self.images)} of a store"] if self._store is not None else []
        where += [f"trace {self.trace_shown!r} of {len(self._traces)}"] if self._traces else []
        where += [f"a clip of {self.frames} frames (the picture: every frame)"] if self.frames else []
        return static_bundle(super()._repr_mimebundle_(**kwargs), self.static,
                             summary("Explorer", {"recipe": self._recipe}, self._trace, where))

    # -- the round trip ----------------------------------------------------------------------------
    def _show_image(self, index: int) -> None:
        """Show image ``index`` of the store with the current recipe; raises (changing nothing) if it cannot."""
        trace = read_image(self._store, index)
        facts, options, _ = explorer_view(trace)
        result = compute_grid(trace, self._recipe)
        self._trace, self._facts = trace, facts
        with self.hold_sync():  # image and map in one message: the page never paints one with the other's map
            self.options = options
            self.image = image_rgba(facts.image)
            self.image_shape = list(facts.image.shape[:2])
            self.image_index = index
            self._publish(result, response_id=self.response_id)

    def _on_image_request(self, change: dict) -> None:
        request = change["new"] or {}
        try:
            index = request.get("index")
            n = len(self.images)
            if self._store is None or isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
                raise ArgumentIndexError(f"index: expected an image position in [0, {n - 1}], got {index!r}")
            self._show_image(index)
        except Exception as exc:  # e.g. a class the new image did not trace: said in the page, image kept
            if not isinstance(exc, (ValueError, IndexError)):
                self.log.warning("vitcam_nb Explorer: unexpected error", exc_info=True)
            with self.hold_sync():
                self.error = error_text(exc)
                self.frame += 1

    def _show_frame(self, index: int) -> None:
        """Show frame ``index`` of the clip under the same frame of the current map (already computed)."""
        with self.hold_sync():  # frame and map in one message: the page never paints one with the other's map
            self.image = image_rgba(self._facts.clip[index])
            self.frame_shown = index
            self._publish(self._result, response_id=self.response_id)

    def _on_frame_request(self, change: dict) -> None:
        request = change["new"] or {}
        try:
            if not self.frames:
                raise ArgumentTypeError("frame: this Explorer shows an image trace, which has no frames")
            index = request.get("index")
            check_frame(index, self.frames)
            self._show_frame(index)
        except Exception as exc:  # said in the page, frame kept
            if not isinstance(exc, (ValueError, IndexError, TypeError)):
                self.log.warning("vitcam_nb Explorer: unexpected error", exc_info=True)
            with self.hold_sync():
                self.error = error_text(exc)
                self.frame += 1

    def _on_request(self, change: dict) -> None:
        request = change["new"] or {}
        try:
            rid = int(request.get("id", 0))
        except (TypeError, ValueError):
            rid = self.response_id
        try:
            draft = request.get("recipe")
            if not isinstance(draft, Mapping):
                raise RecipeError(f"request: expected an object of recipe fields, got {type(draft).__name__}")
            changed = request.get("changed") or []
            fields = coerce_request({**self._recipe.to_dict(), **draft}, list(changed), self._facts)
            result = compute_grid(self._trace, Recipe.from_dict(fields))
        except Exception as exc:  # every refusal becomes a message in the widget, never a traceback
            if not isinstance(exc, ValueError):
                self.log.warning("vitcam_nb Explorer: unexpected error", exc_info=True)
            hint = self._elsewhere(request) if self._traces else ""
            with self.hold_sync():
                self.error = error_text(exc) + hint
                self.response_id = max(rid, self.response_id)
                self.frame += 1
            return
        self._publish(result, response_id=max(rid, self.response_id))
        self._prefetch()

    def _on_custom(self, _widget: Any, content: Any, _buffers: Any) -> None:
        # The page asks once it is shown (messages sent before it exists would be lost).
        if isinstance(content, Mapping) and content.get("kind") == "prefetch":
            self._prefetch()

    def _prefetch(self) -> None:
        """Send the page the views one step away on the layer slider and the site list (after the answer, so
        the shown view never waits for them)."""
        if not self.prefetch or self.frames:  # a video view is a whole clip's map: not prefetched
            return
        try:
            message, buffers = prefetch_message(self._trace, self._recipe, self._facts)
        except Exception:  # a prefetch is an optimisation: the round trip still answers every change
            self.log.warning("vitcam_nb Explorer: prefetch failed", exc_info=True)
            return
        if message["entries"]:
            self.send(message, buffers)

    def _publish(self, result: GridResult, response_id: int) -> None:
        changed = result.recipe != self._recipe
        self._recipe, self._result = result.recipe, result
        grid = result.grid if not self.frames else frame_slice(result.grid, self.frame_shown, self.frames)
        with self.hold_sync():
            self.recipe_json = result.recipe.to_json()
            self.recipe_id = result.recipe.id
            self.grid = grid_bytes(grid)
            self.grid_shape = list(grid.shape)
            self.value_range = list(result.value_range or [])
            self.checklist = result.checklist
            self.checklist_md = result.checklist_md
            self.methods = result.methods
            self.degenerate = result.degenerate
            self.notes = result.notes
            self.error = ""
            self.response_id = response_id
            self.frame += 1
        if changed:
            for callback in list(self._callbacks):
                try:
                    callback(result.recipe)
                except Exception:
                    self.log.warning("vitcam_nb Explorer: on_change callback failed", exc_info=True)

