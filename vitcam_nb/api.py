"""The public map functions: :func:`cam` and :func:`gallery` take any trace (flat, hierarchical, vision-language,
many images), normalise the recipe arguments once, and hand the work to the trace kind that accepts it, with
numpy's BLAS pools held to one thread meanwhile (the user's settings are restored afterwards).

Example:
    >>> import timm, numpy as np
    >>> from vitcam_nb.capture.trace import trace
    >>> tr = trace(timm.create_model("vit_tiny_patch16_224"), np.zeros((224, 224, 3), np.uint8), targets="top1")
    >>> cam(tr, site="F4", layer=0, grid=True).dims
    ('patch_row', 'patch_col')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import xarray as xr

from vitcam_nb.compute.threads import small_array_threads
from vitcam_nb.core.errors import ArgumentTypeError
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import Recipe, recipe_arguments

__all__ = ["cam", "gallery"]


def cam(trace: xr.Dataset, recipe: Recipe | None = None, *, grid: bool = False, **fields: Any) -> xr.DataArray:
    """Compute the heatmap of ``recipe`` from ``trace`` — no model call.

    Returns a DataArray (y, x) at the input size (or (patch_row, patch_col) with ``upsample="none"`` or
    ``grid=True``) whose attrs hold the recipe JSON, recipe id, trace id, the checklist (JSON), a methods
    paragraph and ``degenerate`` (empty, or why the map was returned as zeros). Keyword fields build or
    modify the recipe: ``cam(tr, site="F4")``. On a many-image Dataset (``vc.open_traces``) the result is
    lazy, (image, y, x), one task per image.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), np.zeros((224, 224, 3), np.uint8))
        >>> m = vc.cam(tr, vc.Recipe(site="F1", layer=-1))
        >>> m.dims, m.shape, m.attrs["recipe_id"]
        (('y', 'x'), (224, 224), '36db00aafece')
    """
    recipe = recipe_arguments(recipe, grid, fields)
    with small_array_threads():
        return kind_for(trace, recipe).cam(trace, recipe)


def gallery(trace: xr.Dataset, recipe: Recipe | None = None,
            vary: Mapping[str, Any] | Sequence[str] = ("layer", "site")) -> xr.DataArray:
    """Many variants at once: the recipe with some fields varied, as one labeled DataArray.

    ``vary`` maps field names to value lists (or "all" for layer and site); a sequence of field names
    means "all" of each. On a flat trace, layers and token sites are computed together in one array
    expression; other fields loop over their values. Each map's recipe id and degeneracy are coordinates.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), np.zeros((224, 224, 3), np.uint8))
        >>> g = vc.gallery(tr, vc.Recipe(), vary={"layer": "all", "site": ["F1", "F4"]})
        >>> g.dims
        ('layer', 'site', 'y', 'x')
    """
    base = recipe if recipe is not None else Recipe()
    if not isinstance(base, Recipe):
        raise ArgumentTypeError(f"recipe: expected a vitcam_nb.Recipe, got {type(base).__name__}")
    with small_array_threads():
        return kind_for(trace, base).gallery(trace, base, vary)
