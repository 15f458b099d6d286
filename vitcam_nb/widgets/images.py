"""Explore a many-image store (from :func:`vitcam_nb.trace_many`): pick an image, then explore it as a
single trace with an :class:`~vitcam_nb.widgets.Explorer` that keeps the current recipe."""

from __future__ import annotations

from typing import Any

import ipywidgets
import xarray as xr

from vitcam_nb.taxonomy import Recipe


class ImageExplorer(ipywidgets.VBox):
    """An image picker above an Explorer of the chosen image's trace.

    ``vc.Explorer(store)`` returns one of these when the Dataset has an ``image`` dimension.

    Example:
        >>> ds = vc.open_traces("traces.zarr")   # doctest: +SKIP
        >>> box = vc.Explorer(ds)                # doctest: +SKIP
        >>> box.index = 3                        # doctest: +SKIP
        >>> box.explorer.trace.attrs["image_index"]  # doctest: +SKIP
        3
    """

    def __init__(self, store: xr.Dataset, recipe: Recipe | None = None, *, index: int = 0, **kwargs: Any) -> None:
        from vitcam_nb.many import image_choices, image_trace
        from vitcam_nb.widgets.explorer import Explorer

        choices = image_choices(store)
        if not choices:
            raise ValueError("store: holds no traced images yet")
        self._store, self._kwargs, self._image_trace, self._explorer_cls = store, kwargs, image_trace, Explorer
        self.picker = ipywidgets.Dropdown(options=choices, value=choices[index][1], description="image")
        self.explorer = Explorer(image_trace(store, self.picker.value), recipe, **kwargs)
        super().__init__(children=[self.picker, self.explorer])
        self.picker.observe(self._on_pick, names="value")

    @property
    def index(self) -> int:
        """The image shown (its position in the store); setting it switches image.

        Example:
            >>> box.index = 0  # doctest: +SKIP
        """
        return int(self.picker.value)

    @index.setter
    def index(self, value: int) -> None:
        self.picker.value = value

    @property
    def recipe(self) -> Recipe:
        """The current recipe of the inner Explorer.

        Example:
            >>> box.recipe = vc.Recipe(site="F4")  # doctest: +SKIP
        """
        return self.explorer.recipe

    @recipe.setter
    def recipe(self, value: Recipe) -> None:
        self.explorer.recipe = value

    def _on_pick(self, change: dict) -> None:
        recipe = self.explorer.recipe
        self.explorer = self._explorer_cls(self._image_trace(self._store, change["new"]), recipe, **self._kwargs)
        self.children = [self.picker, self.explorer]
