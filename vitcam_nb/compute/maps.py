"""The map as the user receives it: the DataArray every trace kind returns (values, recipe, ids, checklist,
methods, degeneracy), with the warning that says when it was returned as zeros.

Example:
    >>> import numpy as np, vitcam_nb as vc
    >>> m = map_array(np.zeros((2, 2)), vc.Recipe(upsample="none"), "abc", "{}", "methods", "", [])
    >>> m.dims, m.attrs["trace_id"]
    (('patch_row', 'patch_col'), 'abc')
"""

from __future__ import annotations

import warnings

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import DegenerateMapWarning, user_stacklevel
from vitcam_nb.core.recipe import Recipe

__all__ = ["map_array", "map_dims", "warn_degenerate"]


def map_dims(recipe: Recipe) -> tuple[str, str]:
    """The map's dimensions: the token grid with ``upsample="none"``, else the input's pixels.

    Example:
        >>> import vitcam_nb as vc
        >>> map_dims(vc.Recipe())
        ('y', 'x')
    """
    # Dimensions without coordinate indexes: building pandas indexes would cost more than the map itself.
    return ("patch_row", "patch_col") if recipe.upsample == "none" else ("y", "x")


def map_array(values: np.ndarray, recipe: Recipe, trace_id: str, checklist: str, methods: str, reason: str,
              partial: list[str], **attrs: str) -> xr.DataArray:
    """The map DataArray with its report: recipe JSON and id, trace id, checklist JSON, methods paragraph, why
    it is degenerate ("" if it is not) and which fused layers were left out; ``attrs`` adds kind facts.

    Example:
        >>> import vitcam_nb as vc
        >>> m = map_array(np.ones((2, 2)), vc.Recipe(), "t1", "{}", "", "", ["layer 3: dead"], stage="stage_1")
        >>> m.dims, m.dtype, m.attrs["degenerate_layers"], m.attrs["stage"]
        (('y', 'x'), dtype('float32'), 'layer 3: dead', 'stage_1')
    """
    return xr.DataArray(
        values.astype(np.float32, copy=False), dims=map_dims(recipe), name="cam",
        attrs={"recipe": recipe.to_json(), "recipe_id": recipe.id, "trace_id": trace_id, "checklist": checklist,
               "methods": methods, "degenerate": reason, "degenerate_layers": "; ".join(partial), **attrs},
    )


def warn_degenerate(recipe: Recipe, notes: list[str]) -> str:
    """Warn that ``recipe``'s map is degenerate and was returned as zeros; returns the joined reason.

    Example:
        >>> import warnings, vitcam_nb as vc
        >>> with warnings.catch_warnings(record=True):
        ...     warn_degenerate(vc.Recipe(), ["the map is constant"])
        'the map is constant'
    """
    reason = "; ".join(notes)
    warnings.warn(f"recipe {recipe.id} ({recipe.site}, layer {recipe.layer}, {recipe.weighting}) is degenerate "
                  f"and was returned as zeros: {reason}", DegenerateMapWarning, stacklevel=user_stacklevel())
    return reason
