"""The Gallery: many variants of one recipe as a grid of thumbnails; clicking one opens it in an Explorer.

All maps travel as one float32 buffer on the token grid; the browser upsamples and colours them."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anywidget
import ipywidgets
import numpy as np
import traitlets as t
import xarray as xr

from vitcam_nb.api import gallery as compute_gallery
from vitcam_nb.capture.reader import is_store
from vitcam_nb.compute.maps import degenerate_cause
from vitcam_nb.core.errors import ArgumentError, ArgumentIndexError, ArgumentTypeError, DegenerateMapWarning
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.plot import grid as plot_grid
from vitcam_nb.widgets.assets import css, esm
from vitcam_nb.widgets.controls import COLORMAPS, as_recipe
from vitcam_nb.widgets.encoding import grid_bytes, image_rgba
from vitcam_nb.widgets.explorer import Explorer
from vitcam_nb.widgets.facts import TraceFacts, default_recipe
from vitcam_nb.widgets.fallback import static_bundle, summary
from vitcam_nb.widgets.results import error_text
from vitcam_nb.widgets.traits import Opacity, Pixels

__all__ = ["Gallery", "GalleryGrid"]


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


class GalleryGrid(anywidget.AnyWidget):
    """The thumbnail grid of a :class:`Gallery` (the browser half; build a :class:`Gallery` instead).

    Example:
        >>> g = vc.Gallery(tr)        # doctest: +SKIP
        >>> g.thumbnails.maps_shape   # doctest: +SKIP
        [12, 6, 14, 14]
    """

    _esm = esm("gallery.js")
    _css = css()

    image = t.Bytes().tag(sync=True)
    image_shape = t.List(t.Int()).tag(sync=True)
    maps = t.Bytes().tag(sync=True)
    maps_shape = t.List(t.Int()).tag(sync=True)
    row_field = t.Unicode().tag(sync=True)
    col_field = t.Unicode().tag(sync=True)
    row_labels = t.List(t.Unicode()).tag(sync=True)
    col_labels = t.List(t.Unicode()).tag(sync=True)
    degenerate = t.List().tag(sync=True)
    #: Per cell, the short cause of a degenerate map (its badge), "" for a map that is not degenerate.
    causes = t.List().tag(sync=True)
    recipe_ids = t.List().tag(sync=True)
    upsample = t.Unicode("bilinear").tag(sync=True)
    normalize = t.Unicode("minmax").tag(sync=True)
    base_id = t.Unicode().tag(sync=True)
    thumb = Pixels(96).tag(sync=True)
    opacity = Opacity(0.5).tag(sync=True)
    colormap = t.Enum(COLORMAPS, default_value="inferno").tag(sync=True)
    #: The page's click: {"cell": [row, col], "n": click count}.
    selected = t.Dict().tag(sync=True, echo_update=False)
    #: The cell open in the Explorer, [row, col], or [] before the first click.
    active = t.List(t.Int()).tag(sync=True)
    error = t.Unicode().tag(sync=True)
    #: The Gallery this grid belongs to (set by it): displayed alone, the grid stores the Gallery's picture.
    gallery: Gallery | None = None

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        return bundle if self.gallery is None else self.gallery._with_picture(bundle)


class Gallery(ipywidgets.VBox):
    """A grid of thumbnails of ``recipe`` with one or two fields varied; clicking one opens it in an Explorer
    shown below the grid (one Explorer, reused).

    Args:
        trace: a Dataset from :func:`vitcam_nb.trace`.
        recipe: the base recipe (default: the package default).
        vary: one or two field names (each varied over all its traced values: ``layer``, ``site``) or a
            mapping of field -> values, as for :func:`vitcam_nb.gallery`. Rows are the first field,
            columns the second. ``g.select(row, col)`` opens a thumbnail from Python, as a click does.
        opacity, colormap: overlay display.
        thumb: thumbnail width in pixels.

    Example:
        >>> g = vc.Gallery(tr, vary=("layer", "site"))   # doctest: +SKIP
        >>> g                                            # doctest: +SKIP
        >>> g.select(0, 1).site                          # doctest: +SKIP
        'F3'
    """

    def __init__(self, trace: xr.Dataset, recipe: Recipe | None = None,
                 vary: Mapping[str, Any] | Sequence[str] = ("layer", "site"), *, opacity: float = 0.5,
                 colormap: str = "inferno", thumb: int = 96, **kwargs: Any) -> None:
        if is_store(trace):
            raise ArgumentTypeError("trace: Gallery shows one image's trace, got a trace_many store; pass "
                                    "vitcam_nb.image_trace(store, i), or browse the store with "
                                    "vitcam_nb.Explorer(store)")
        if colormap not in COLORMAPS:
            raise ArgumentError(f"colormap: expected one of {list(COLORMAPS)}, got {colormap!r}")
        if not 0.0 <= float(opacity) <= 1.0:
            raise ArgumentError(f"opacity: expected a float in [0, 1], got {opacity!r}")
        facts = TraceFacts.of(trace, view="Gallery")
        base = default_recipe(facts) if recipe is None else as_recipe(recipe)
        if isinstance(vary, str):
            vary = (vary,)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DegenerateMapWarning)
            maps = compute_gallery(trace, base.replace(upsample="none"), vary=vary)
        fields = list(maps.dims[:-2])
        if len(fields) > 2:
            raise ArgumentError(f"vary: a gallery grid shows one or two varied fields, got {fields}")
        if len(fields) == 1:
            maps = maps.expand_dims("_row")
        self._trace, self._base, self._maps = trace, base, maps
        self._fields = fields
        rows_f = fields[0] if len(fields) == 2 else ""
        cols_f = fields[-1]
        self._row_values = [_plain(v) for v in maps[rows_f].values] if rows_f else [None]
        self._col_values = [_plain(v) for v in maps[cols_f].values]
        n_rows, n_cols = len(self._row_values), len(self._col_values)
        self._recipes = [[self._cell_recipe(i, j) for j in range(n_cols)] for i in range(n_rows)]
        degenerate = np.asarray(maps.coords["degenerate"].values, dtype=str).reshape(n_rows, n_cols)
        self._explorer: Explorer | None = None
        self._selected: Recipe | None = None
        self._callbacks: list[Callable[[Recipe], Any]] = []
        self._explorer_options = {"opacity": float(opacity), "colormap": colormap}
        self.thumbnails = GalleryGrid(
            image=image_rgba(facts.image), image_shape=list(facts.image.shape[:2]),
            maps=grid_bytes(maps.values), maps_shape=list(maps.shape), row_field=rows_f, col_field=cols_f,
            row_labels=[str(v) for v in self._row_values] if rows_f else [""],
            col_labels=[str(v) for v in self._col_values], degenerate=degenerate.tolist(),
            causes=[[degenerate_cause(why) for why in row] for row in degenerate.tolist()],
            recipe_ids=[[r.id for r in row] for row in self._recipes], upsample=base.upsample,
            normalize=base.normalize, base_id=base.id, thumb=int(thumb), opacity=float(opacity),
            colormap=colormap)
        self.thumbnails.observe(self._on_click, names="selected")
        self.thumbnails.gallery = self
        super().__init__(children=[self.thumbnails], **kwargs)

    def _cell_recipe(self, i: int, j: int) -> Recipe:
        changes = {self._fields[-1]: self._col_values[j]}
        if len(self._fields) == 2:
            changes[self._fields[0]] = self._row_values[i]
        return self._base.replace(**changes)

    # -- Python API --------------------------------------------------------------------------------
    @property
    def recipe(self) -> Recipe:
        """The base recipe every thumbnail varies.

        Example:
            >>> vc.Gallery(tr, vc.Recipe(site="F4"), vary="layer").recipe.site  # doctest: +SKIP
            'F4'
        """
        return self._base

    @property
    def maps(self) -> xr.DataArray:
        """The thumbnails' maps on the token grid (``vc.gallery`` with ``upsample="none"``).

        Example:
            >>> g.maps.dims  # doctest: +SKIP
            ('layer', 'site', 'patch_row', 'patch_col')
        """
        return self._maps.squeeze("_row", drop=True) if "_row" in self._maps.dims else self._maps

    def recipe_at(self, row: int, col: int) -> Recipe:
        """The recipe of one thumbnail (the base recipe with the varied fields set).

        Example:
            >>> g.recipe_at(0, 0).layer  # doctest: +SKIP
            0
        """
        return self._recipes[row][col]

    @property
    def selected(self) -> Recipe | None:
        """The recipe of the thumbnail last opened, or None.

        Example:
            >>> g.select(1, 0) == g.selected  # doctest: +SKIP
            True
        """
        return self._selected

    @property
    def explorer(self) -> Explorer | None:
        """The Explorer below the grid (created at the first selection), or None before it.

        Example:
            >>> g.select(0, 0); g.explorer.recipe == g.recipe_at(0, 0)  # doctest: +SKIP
            True
        """
        return self._explorer

    def select(self, row: int, col: int) -> Recipe:
        """Open thumbnail (row, col) in the Explorer, as a click does; returns its recipe.

        Example:
            >>> g.select(2, 0)  # doctest: +SKIP
        """
        recipe = self._recipes[row][col]
        if self._explorer is None:
            self._explorer = Explorer(self._trace, recipe, **self._explorer_options)
            self.children = [self.thumbnails, self._explorer]
        else:
            self._explorer.recipe = recipe
        self._selected = recipe
        self.thumbnails.active = [int(row), int(col)]
        for callback in list(self._callbacks):
            callback(recipe)
        return recipe

    def on_select(self, callback: Callable[[Recipe], Any]) -> None:
        """Call ``callback(recipe)`` whenever a thumbnail is opened.

        Example:
            >>> g.on_select(lambda r: print(r.id))  # doctest: +SKIP
        """
        self._callbacks.append(callback)

    def static(self) -> Any:
        """The grid as a matplotlib Figure (``vc.plot.grid`` of the maps).

        Example:
            >>> fig = g.static()  # doctest: +SKIP
        """
        return plot_grid(self._trace, self.maps, alpha=self.thumbnails.opacity, cmap=self.thumbnails.colormap)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self._with_picture(super()._repr_mimebundle_(**kwargs))

    def _with_picture(self, bundle: Any) -> Any:
        """The live view, and for viewers without widgets the picture of the grid and what it shows."""
        varied = ", ".join(f"{field} ({self.maps.sizes[field]})" for field in self._fields)
        opened = [f"open in its Explorer: {self._selected.id} (not in the picture)"] if self._selected else []
        return static_bundle(bundle, self.static, summary("Gallery", {"base recipe": self._base}, self._trace,
                                                          [f"varied: {varied}", *opened]))

    def _on_click(self, change: dict) -> None:
        cell = (change["new"] or {}).get("cell")
        try:
            row, col = (int(v) for v in cell)
            if not (0 <= row < len(self._recipes) and 0 <= col < len(self._recipes[0])):
                raise ArgumentIndexError(f"cell {cell} is outside the {len(self._recipes)}x{len(self._recipes[0])} "
                                         "grid")
            self.select(row, col)
            self.thumbnails.error = ""
        except Exception as exc:  # a click never shows a traceback
            self.thumbnails.error = error_text(exc)
