"""One recipe computed for a widget: the token-grid map of ``vc.cam(trace, recipe, grid=True)`` with
everything the widgets display about it, and the message a refused change shows.

Example:
    >>> error_text(KeyError("x"))
    "KeyError: 'x'"
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import numpy as np
import xarray as xr

from vitcam_nb.api import cam
from vitcam_nb.compute.maps import degenerate_cause
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import DegenerateMapWarning, RecipeError
from vitcam_nb.core.recipe import Recipe

__all__ = ["GridResult", "compute_grid", "error_text"]


@dataclass
class GridResult:
    """One recipe computed on the token grid, with everything the widgets display about it.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> r = compute_grid(vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1"), vc.Recipe(site="F6"))
        >>> r.grid.shape, r.degenerate[:29]
        ((4, 4), 'gradients are exactly zero at')
    """

    recipe: Recipe
    grid: np.ndarray
    checklist: dict
    methods: str
    degenerate: str
    notes: str

    @property
    def cause(self) -> str:
        """The short cause of a degenerate map (what its badge says), "" if the map is not degenerate.

        Example:
            >>> GridResult(Recipe(), np.zeros((1, 1)), {}, "", "gradients are exactly zero at x", "").cause
            'zero gradient'
        """
        return degenerate_cause(self.degenerate)

    @property
    def checklist_md(self) -> str:
        """The checklist as a markdown table (what the widget's copy button copies)."""
        return Checklist(self.checklist).to_markdown()


def compute_grid(trace: xr.Dataset, recipe: Recipe) -> GridResult:
    """``vc.cam(trace, recipe, grid=True)`` with its report; the degenerate warning becomes a field.

    Example:
        >>> compute_grid(tr, Recipe()).grid.dtype  # doctest: +SKIP
        dtype('float32')
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateMapWarning)
        m = cam(trace, recipe, grid=True)
    grid = np.ascontiguousarray(m.values, dtype="<f4")
    # The grid is computed with upsample="none"; the report describes the recipe as chosen (its upsampling).
    return GridResult(recipe=recipe, grid=grid, checklist=json.loads(recipe.checklist(trace).to_json()),
                      methods=recipe.describe(trace), degenerate=str(m.attrs.get("degenerate", "")),
                      notes=str(m.attrs.get("degenerate_layers", "")))


def error_text(exc: BaseException) -> str:
    """The message shown in a widget for a refused change (no traceback).

    Example:
        >>> error_text(KeyError("x"))
        "KeyError: 'x'"
    """
    if isinstance(exc, RecipeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
