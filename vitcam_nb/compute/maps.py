"""What a computed map looks like to the user: the DataArray every trace kind returns (values, recipe, ids,
checklist, methods, degeneracy) and the warning that a degenerate map was returned as zeros.

Example:
    >>> import numpy as np, vitcam_nb as vc
    >>> m = map_array(np.zeros((2, 2)), vc.Recipe(upsample="none"), "abc", "{}", "methods", "", [])
    >>> m.dims, m.attrs["trace_id"]
    (('patch_row', 'patch_col'), 'abc')
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import DegenerateMapWarning
from vitcam_nb.core.recipe import Recipe

__all__ = ["map_array", "map_dims", "user_stacklevel", "warn_degenerate"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    it is degenerate ("" if it is not) and which fused layers were left out; ``attrs`` adds kind facts."""
    return xr.DataArray(
        values.astype(np.float32, copy=False), dims=map_dims(recipe), name="cam",
        attrs={"recipe": recipe.to_json(), "recipe_id": recipe.id, "trace_id": trace_id, "checklist": checklist,
               "methods": methods, "degenerate": reason, "degenerate_layers": "; ".join(partial), **attrs},
    )


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised here point at the first caller outside vitcam_nb.

    Example:
        >>> user_stacklevel()  # called from outside the package: the caller itself
        1
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame, level = frame.f_back, level + 1
    return level


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
