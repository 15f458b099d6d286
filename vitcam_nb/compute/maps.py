"""The map as the user receives it: the DataArray every trace kind returns (values, recipe, ids, checklist,
methods, degeneracy), with the warning that says when it was returned as zeros.

Example:
    >>> import numpy as np, vitcam_nb as vc
    >>> m = map_array(np.zeros((2, 2)), vc.Recipe(upsample="none"), "abc", "{}", "methods", "", [])
    >>> m.dims, m.attrs["trace_id"]
    (('patch_row', 'patch_col'), 'abc')
    >>> degenerate_cause("gradients are exactly zero at these tokens")
    'zero gradient'
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Iterable

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import DegenerateMapWarning, user_stacklevel
from vitcam_nb.core.recipe import Recipe

__all__ = ["DEGENERATE_CAUSES", "NOTHING_AFTER_RELU", "cause_counts", "degenerate_cause", "map_array", "map_dims",
           "warn_degenerate"]

#: The start of the reason of a map the ReLU left empty (every value <= 0 before it).
NOTHING_AFTER_RELU = "the map is constant: nothing is left after the ReLU"

#: The short cause of a degenerate map, by a phrase of its reason: (phrase, label). Phrases are found left to
#: right, so the ReLU's ("the map is constant: ...") wins over the "map is constant" inside it. The widgets
#: read this table too: their badges name the cause.
DEGENERATE_CAUSES: tuple[tuple[str, str], ...] = (
    ("the softmax is saturated", "softmax saturated"),
    ("a softmax over one score is constant", "softmax over one score"),
    ("gradients are exactly zero", "zero gradient"),
    (NOTHING_AFTER_RELU, "nothing left after ReLU"),
    ("map is constant", "constant map"),
)
_CAUSE_RE = re.compile("|".join(f"({re.escape(phrase)})" for phrase, _ in DEGENERATE_CAUSES))


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
               "methods": methods, "degenerate": reason, "degenerate_cause": degenerate_cause(reason),
               "degenerate_layers": "; ".join(partial), **attrs},
    )


def degenerate_cause(reason: str) -> str:
    """The short cause of a degenerate map from its reason (``attrs["degenerate"]``): one label of
    :data:`DEGENERATE_CAUSES` per distinct cause named in it (a fused map's reason has a note per layer), in
    the order they appear, joined by " + "; "" for a map that is not degenerate, "other" when no phrase names
    its cause.

    Example:
        >>> degenerate_cause("layer 1: gradients are exactly zero at these tokens; the fused map is constant")
        'zero gradient + constant map'
        >>> degenerate_cause("")
        ''
    """
    causes: list[str] = []
    for match in _CAUSE_RE.finditer(str(reason)):
        label = DEGENERATE_CAUSES[match.lastindex - 1][1]
        if label not in causes:
            causes.append(label)
    if reason and not causes:
        causes.append("other")
    return " + ".join(causes)


def cause_counts(reasons: Iterable[str]) -> str:
    """How many degenerate maps each cause accounts for, most first: the start of a gallery's warning.

    Example:
        >>> cause_counts(["gradients are exactly zero at these tokens", "", "the fused map is constant",
        ...               "gradients are exactly zero at these tokens"])
        '2 zero gradient, 1 constant map'
    """
    counts = Counter(degenerate_cause(str(r)) for r in reasons if str(r))
    return ", ".join(f"{n} {cause}" for cause, n in counts.most_common())


def warn_degenerate(recipe: Recipe, notes: list[str]) -> str:
    """Warn that ``recipe``'s map is degenerate and was returned as zeros; returns the joined reason.

    Example:
        >>> import warnings, vitcam_nb as vc
        >>> with warnings.catch_warnings(record=True):
        ...     warn_degenerate(vc.Recipe(), ["the map is constant"])
        'the map is constant'
    """
    reason = "; ".join(notes)
    # The warning starts with the cause, so that a list of warnings reads as a list of causes.
    warnings.warn(f"{degenerate_cause(reason)}: recipe {recipe.id} ({recipe.site}, layer {recipe.layer}, "
                  f"{recipe.weighting}) is degenerate and was returned as zeros: {reason}", DegenerateMapWarning,
                  stacklevel=user_stacklevel())
    return reason
