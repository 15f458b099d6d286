"""Compare: two recipes side by side on one trace, with their agreement on the token grid (Spearman rank
correlation, top-k IoU) and the fields in which they differ highlighted."""

from __future__ import annotations

import math
import warnings
from typing import Any

import anywidget
import numpy as np
import traitlets as t
import xarray as xr

from vitcam_nb.api import cam
from vitcam_nb.capture.reader import is_store
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, DegenerateMapWarning
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.evaluate import resolve_k, spearman, topk_iou
from vitcam_nb.plot import overlay
from vitcam_nb.widgets.assets import css, esm
from vitcam_nb.widgets.controls import COLORMAPS, as_recipe, diff_fields
from vitcam_nb.widgets.encoding import grid_bytes, grid_from_bytes, image_rgba
from vitcam_nb.widgets.facts import TraceFacts
from vitcam_nb.widgets.fallback import static_bundle, summary
from vitcam_nb.widgets.results import GridResult, compute_grid, error_text
from vitcam_nb.widgets.traits import Opacity, Pixels

__all__ = ["Compare"]


def _finite(value: float) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


class Compare(anywidget.AnyWidget):
    """Two recipes side by side with their agreement and the differing choices highlighted.

    Agreement is measured on the token grid (``vc.cam(tr, r, grid=True)``), as
    :mod:`vitcam_nb.evaluate` recommends: the Spearman rank correlation of the cells and the IoU of the
    top-``k`` cells (``k`` a fraction of the cells, changeable in the widget). A constant (e.g.
    degenerate) map has no ranking: its agreement is shown as n/a with the reason.

    Args:
        trace: a Dataset from :func:`vitcam_nb.trace`.
        recipe_a, recipe_b: the two recipes (Recipe, dict of fields or recipe JSON).
        k: top-k fraction in (0, 1] for the overlap.
        opacity, colormap, size: display.

    Example:
        >>> cmp = vc.Compare(tr, vc.Recipe(site="F1"), vc.Recipe(site="F2"))  # doctest: +SKIP
        >>> cmp.agreement                                                     # doctest: +SKIP
        {'spearman': 0.41, 'topk_iou': 0.33, 'k': 0.1}
    """

    _esm = esm("compare.js")
    _css = css()

    image = t.Bytes().tag(sync=True)
    image_shape = t.List(t.Int()).tag(sync=True)
    size = Pixels(260).tag(sync=True)
    opacity = Opacity(0.5).tag(sync=True)
    colormap = t.Enum(COLORMAPS, default_value="inferno").tag(sync=True)

    grid_a = t.Bytes().tag(sync=True)
    grid_b = t.Bytes().tag(sync=True)
    grid_shape = t.List(t.Int()).tag(sync=True)
    recipe_a_json = t.Unicode().tag(sync=True)
    recipe_b_json = t.Unicode().tag(sync=True)
    id_a = t.Unicode().tag(sync=True)
    id_b = t.Unicode().tag(sync=True)
    degenerate_a = t.Unicode().tag(sync=True)
    degenerate_b = t.Unicode().tag(sync=True)
    #: The short cause of each degenerate map (its notice's badge), "" where the map is not degenerate.
    cause_a = t.Unicode().tag(sync=True)
    cause_b = t.Unicode().tag(sync=True)
    fields = t.List().tag(sync=True)
    spearman = t.Any(None, allow_none=True).tag(sync=True)
    topk_iou = t.Any(None, allow_none=True).tag(sync=True)
    k = t.Float(0.1).tag(sync=True)
    k_cells = t.Int(0).tag(sync=True)
    notes = t.Unicode().tag(sync=True)
    error = t.Unicode().tag(sync=True)
    frame = t.Int(0).tag(sync=True)

    def __init__(self, trace: xr.Dataset, recipe_a: Recipe | dict | str, recipe_b: Recipe | dict | str, *,
                 k: float = 0.1, opacity: float = 0.5, colormap: str = "inferno", size: int = 260,
                 **kwargs: Any) -> None:
        if is_store(trace):
            raise ArgumentTypeError("trace: Compare shows one image's trace, got a trace_many store; pass "
                                    "vitcam_nb.image_trace(store, i), or browse the store with "
                                    "vitcam_nb.Explorer(store)")
        if colormap not in COLORMAPS:
            raise ArgumentError(f"colormap: expected one of {list(COLORMAPS)}, got {colormap!r}")
        if not 0.0 <= float(opacity) <= 1.0:
            raise ArgumentError(f"opacity: expected a float in [0, 1], got {opacity!r}")
        self._check_k(k)
        facts = TraceFacts.of(trace, view="Compare")
        a, b = compute_grid(trace, as_recipe(recipe_a)), compute_grid(trace, as_recipe(recipe_b))
        super().__init__(image=image_rgba(facts.image), image_shape=list(facts.image.shape[:2]),
                         opacity=float(opacity), colormap=colormap, size=int(size), k=float(k), **kwargs)
        self._trace = trace
        self._a, self._b = a, b
        self._reverting = False
        self._publish()
        self.observe(self._on_k, names="k")

    @staticmethod
    def _check_k(k: float) -> None:
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < float(k) <= 1:
            raise ArgumentError(f"k: expected a fraction of the cells in (0, 1], got {k!r}")

    # -- Python API --------------------------------------------------------------------------------
    @property
    def recipe_a(self) -> Recipe:
        """The left recipe; setting it recomputes the map and the agreement.

        Example:
            >>> cmp.recipe_a = vc.Recipe(site="F6")  # doctest: +SKIP
        """
        return self._a.recipe

    @recipe_a.setter
    def recipe_a(self, value: Recipe | dict | str) -> None:
        self._a = compute_grid(self._trace, as_recipe(value))
        self._publish()

    @property
    def recipe_b(self) -> Recipe:
        """The right recipe; setting it recomputes the map and the agreement.

        Example:
            >>> cmp.recipe_b = cmp.recipe_b.replace(weighting="layercam")  # doctest: +SKIP
        """
        return self._b.recipe

    @recipe_b.setter
    def recipe_b(self, value: Recipe | dict | str) -> None:
        self._b = compute_grid(self._trace, as_recipe(value))
        self._publish()

    @property
    def maps(self) -> tuple[np.ndarray, np.ndarray]:
        """The two grids the page shows (``vc.cam(trace, recipe, grid=True).values``).

        Example:
            >>> a, b = cmp.maps  # doctest: +SKIP
        """
        return grid_from_bytes(self.grid_a, self.grid_shape), grid_from_bytes(self.grid_b, self.grid_shape)

    @property
    def agreement(self) -> dict[str, Any]:
        """{"spearman": float|None, "topk_iou": float|None, "k": float, "k_cells": int, "notes": str}.

        Example:
            >>> cmp.agreement["spearman"]  # doctest: +SKIP
            0.41
        """
        return {"spearman": self.spearman, "topk_iou": self.topk_iou, "k": self.k, "k_cells": self.k_cells,
                "notes": self.notes}

    @property
    def differing(self) -> list[str]:
        """Names of the recipe fields in which the two recipes differ.

        Example:
            >>> cmp.differing  # doctest: +SKIP
            ['site']
        """
        return [f["name"] for f in self.fields if f["differs"]]

    def static(self) -> Any:
        """Both overlays side by side as a matplotlib Figure, the agreement in the title.

        Example:
            >>> fig = cmp.static()  # doctest: +SKIP
        """
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(7, 3.8))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DegenerateMapWarning)
            for ax, side, name in zip(axes, (self._a, self._b), "AB"):
                m = cam(self._trace, side.recipe)
                overlay(self._trace, m, ax=ax, alpha=self.opacity, cmap=self.colormap,
                                title=f"{name}: {side.recipe.id}" + (" (degenerate)" if side.degenerate else ""))

        def show(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.3f}"

        fig.suptitle(f"Spearman {show(self.spearman)} · top-{self.k:.0%} IoU {show(self.topk_iou)} · differ: "
                     f"{', '.join(self.differing) or 'nothing'}", fontsize=9)
        fig.tight_layout()
        return fig

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        # The live view, and for viewers without widgets the picture of this moment's view and what it shows.
        return static_bundle(super()._repr_mimebundle_(**kwargs), self.static,
                             summary("Compare", {"A": self._a.recipe, "B": self._b.recipe}, self._trace))

    # -- computation -------------------------------------------------------------------------------
    def _stats(self, a: GridResult, b: GridResult, k: float) -> tuple[float | None, float | None, int, str]:
        if a.grid.shape != b.grid.shape:
            raise ArgumentError(f"the two maps have different grids {a.grid.shape} and {b.grid.shape}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rho = spearman(a.grid, b.grid)
            iou = topk_iou(a.grid, b.grid, k=float(k))
        n = resolve_k(float(k), a.grid.size)
        notes = "; ".join(dict.fromkeys(str(w.message) for w in caught))
        return _finite(rho), _finite(iou), n, notes

    def _publish(self) -> None:
        a, b = self._a, self._b
        try:
            rho, iou, n, notes = self._stats(a, b, self.k)
            error = ""
        except Exception as exc:  # the agreement never breaks the view
            rho, iou, n, notes, error = None, None, 0, "", error_text(exc)
        with self.hold_sync():
            self.grid_a, self.grid_b = grid_bytes(a.grid), grid_bytes(b.grid)
            self.grid_shape = list(a.grid.shape)
            self.recipe_a_json, self.recipe_b_json = a.recipe.to_json(), b.recipe.to_json()
            self.id_a, self.id_b = a.recipe.id, b.recipe.id
            self.degenerate_a, self.degenerate_b = a.degenerate, b.degenerate
            self.cause_a, self.cause_b = a.cause, b.cause
            self.fields = diff_fields(a.recipe, b.recipe)
            self.spearman, self.topk_iou, self.k_cells, self.notes = rho, iou, n, notes
            self.error = error
            self.frame += 1

    def _on_k(self, change: dict) -> None:
        if self._reverting:
            return
        try:
            self._check_k(change["new"])
        except ValueError as exc:  # from the page: keep the last valid k and say why
            self._reverting = True
            try:
                self.k = change["old"]
            finally:
                self._reverting = False
            self.error = error_text(exc)
            return
        self._publish()
