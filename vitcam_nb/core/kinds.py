"""Trace forms (named "trace kinds" before 0.4; the old names stay as aliases): how one form of trace turns
recipes into maps, and the table that picks the form. "Kind" is kept for the schema's target kind
(``attrs["target_kind"]``) and token kind (the ``token_kind`` coordinate); a trace's computation is its form.

A single-image trace, a hierarchical (Swin) tree, a cross-attention recipe on a vision-language trace and
a many-image store each need their own computation. Each is a :class:`TraceForm` registered in
:data:`TRACE_FORMS` by its module in :mod:`vitcam_nb.compute`; none knows the others. The public
functions (``vc.cam``, ``vc.gallery``, ``Recipe.checklist``) ask :func:`form_for` which one applies.

Example:
    >>> import vitcam_nb as vc
    >>> form_for(None, vc.Recipe()).name
    'flat'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import ArgumentTypeError, RecipeError, TraceError
from vitcam_nb.core.registry import Registry

__all__ = ["TRACE_FORMS", "TRACE_KINDS", "MapValues", "TraceForm", "TraceKind", "form_for", "kind_for"]

#: What :meth:`TraceKind.compute` returns: the map, why it is degenerate (empty: it is not), and which
#: fused layers were degenerate and left out.
MapValues = tuple[np.ndarray, list[str], list[str]]


class TraceKind:
    """The interface every trace form implements (``TraceForm``; ``TraceKind`` is its 0.3 name). ``recipe`` is
    always a :class:`vitcam_nb.Recipe` (typed ``Any`` here: the recipe module dispatches through this one, so this
    one cannot import it).

    Example:
        >>> class Nothing(TraceKind):
        ...     name = "nothing"
        ...     def accepts(self, trace, recipe): return False
        >>> Nothing().accepts(None, None)
        False
    """

    name: str = "kind"

    def accepts(self, trace: Any, recipe: Any) -> bool:
        """Whether this kind computes ``recipe`` on ``trace`` (``trace`` may be None: report only)."""
        raise NotImplementedError

    def compute(self, trace: Any, recipe: Any) -> MapValues:
        """The map's values and degeneracy, with no warning raised and no attributes attached."""
        raise NotImplementedError

    def cam(self, trace: Any, recipe: Any) -> xr.DataArray:
        """The map as ``vc.cam`` returns it: values, recipe, ids, checklist, methods, degeneracy."""
        raise NotImplementedError

    def gallery(self, trace: Any, recipe: Any, vary: Mapping[str, Any] | Sequence[str]) -> xr.DataArray:
        """Many variants of ``recipe`` as one labelled DataArray (see ``vc.gallery``)."""
        raise NotImplementedError

    def checklist(self, recipe: Any, trace: Any) -> Checklist:
        """The reporting checklist of ``recipe`` on ``trace``: the one its maps carry."""
        raise NotImplementedError

    def describe(self, recipe: Any, trace: Any) -> str:
        """The methods paragraph of ``recipe`` on ``trace``."""
        raise NotImplementedError

    def layer_count(self, trace: Any) -> int:
        """How many layers ``recipe.layer`` indexes on ``trace`` (its blocks; a kind with other layers says so)."""
        return int(trace.attrs["num_layers"])

    def traced_layers(self, trace: Any) -> list[int]:
        """The blocks ``layer="all"`` names on ``trace``: those it holds (a trace of some blocks holds only those)."""
        if "layer" in getattr(trace, "coords", {}):
            return [int(v) for v in trace["layer"].values]
        return list(range(self.layer_count(trace)))

    def resolve(self, trace: Any, recipe: Any) -> Any:
        """``recipe`` with every layer an absolute block of ``trace`` (``"all"``: the blocks it holds), so that
        equivalent spellings become one recipe; refuses layers the trace does not hold, in ``cam``'s words."""
        n, traced = self.layer_count(trace), self.traced_layers(trace)

        def absolute(v: Any) -> int:
            if isinstance(v, str):
                raise RecipeError(f"layer: {v!r} is a 'stage.block' address, which only hierarchical (Swin) traces "
                                  "have; this trace's blocks are numbered by int")
            if not -n <= v < n:
                raise RecipeError(f"layer: {v} is out of range for a model with {n} blocks (allowed -{n}..{n - 1})")
            if int(v) % n not in traced:
                raise RecipeError(f"layer: block {int(v) % n} was not traced (traced: {traced}); trace again "
                                  "with layers=None or include it")
            return int(v) % n

        if recipe.layer == "all":
            return recipe.replace(layer=tuple(traced))
        if isinstance(recipe.layer, tuple):
            layers: list[int] = []
            for v in recipe.layer:
                if absolute(v) in layers:
                    raise RecipeError(f"layer: {recipe.layer!r} names block {absolute(v)} twice on a model with {n} "
                                      "blocks; list each block once")
                layers.append(absolute(v))
            return recipe.replace(layer=tuple(layers))
        return recipe.replace(layer=absolute(recipe.layer))


#: The trace forms in lookup order; each module of :mod:`vitcam_nb.compute` registers its own. ``TRACE_KINDS`` is
#: the same table under its 0.3 name.
TRACE_FORMS: Registry[TraceKind] = Registry("trace kind")
TRACE_KINDS = TRACE_FORMS
#: The interface of a trace form (``TraceKind`` is its 0.3 name).
TraceForm = TraceKind


def form_for(trace: Any, recipe: Any = None) -> TraceKind:
    """The first registered trace form that accepts ``trace`` and ``recipe`` (``kind_for``: its 0.3 name).

    Anything but an xarray Dataset or DataTree (or None, for reports without a trace) is a TypeError; an
    xarray object no form accepts is a TraceError naming the registered forms (in the words of 0.3: "kinds").

    Example:
        >>> form_for([1, 2])  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        vitcam_nb.core.errors.ArgumentTypeError: trace: expected an xarray.Dataset from vitcam_nb.trace(), got list
    """
    if trace is not None and not isinstance(trace, (xr.Dataset, xr.DataTree)):
        raise ArgumentTypeError(f"trace: expected an xarray.Dataset from vitcam_nb.trace(), got {type(trace).__name__}")
    for form in TRACE_FORMS.values():
        if form.accepts(trace, recipe):
            return form
    raise TraceError(f"trace: no registered trace kind accepts this {type(trace).__name__}"
                     f"{f' with site {recipe.site!r}' if recipe is not None else ''}; registered kinds: "
                     f"{TRACE_FORMS.names()}")


#: :func:`form_for` under its 0.3 name.
kind_for = form_for
