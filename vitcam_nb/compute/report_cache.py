"""The reports vc.cam attaches to its maps, cached: a gallery, a widget repaint or a map store asks for the
report of the same recipe on the same trace many times, and building it (the checklist, then the methods paragraph
from it) costs more than many maps.

Example:
    >>> import vitcam_nb as vc
    >>> cached_report(vc.Recipe(), None) is cached_report(vc.Recipe(), None)  # built once
    True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vitcam_nb.compute.report import build_checklist, describe
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.schema import POSITION_R2

__all__ = ["cached_report", "clear_reports"]

_REPORTS: dict[tuple, tuple[str, str]] = {}


def cached_report(recipe: Recipe, trace: Any) -> tuple[str, str]:
    """(checklist JSON, methods paragraph) of ``recipe`` on ``trace``, cached by the recipe and every attribute
    of the trace the report reads (a store has no trace id, a trace reloaded under a newer version keeps its id but
    not its versions, a store's devices are a coordinate, and a selection of its blocks keeps its attributes but not
    its ``layer`` coordinate): a gallery or widget repaint asks for the same report many times.

    Example:
        >>> import json, vitcam_nb as vc
        >>> checklist, methods = cached_report(vc.Recipe(), None)
        >>> json.loads(checklist)["recipe"]["id"] == vc.Recipe().id
        True
    """
    attrs = getattr(trace, "attrs", {}) or {}
    key = (recipe, tuple(attrs.items()), _probe_key(trace), _coords_key(trace))
    try:
        found = _REPORTS.get(key)
    except TypeError:  # an attribute a user set to a list or dict: report without the cache
        key = found = None
    if found is None:
        if len(_REPORTS) > 4096:
            _REPORTS.clear()
        checklist = build_checklist(recipe, trace)
        found = (checklist.to_json(), describe(recipe, trace, checklist))
        if key is not None:
            _REPORTS[key] = found
    return found


def _coords_key(trace: Any) -> tuple:
    """The coordinates the report reads: the blocks held (``layer``) and a store's per-image ``device``."""
    coords = getattr(trace, "coords", {}) if trace is not None else {}
    layer = tuple(np.asarray(coords["layer"].values).tolist()) if "layer" in coords else None
    # A store has one device per image: the distinct ones are what the report states, a short key for many images.
    device = tuple(sorted({str(v) for v in np.asarray(coords["device"].values).ravel()})) if "device" in coords \
        else None
    return layer, device


def _probe_key(trace: Any) -> tuple | None:
    """The trace's position probe as a cache key (its values as bytes: NaN compares equal to itself there)."""
    probe = getattr(trace, "variables", {}).get(POSITION_R2) if trace is not None else None
    if probe is None:
        return None
    return (probe.dims, np.asarray(probe.values).tobytes(), tuple(trace[POSITION_R2].coords["site"].values.tolist()),
            tuple(trace[POSITION_R2].coords["layer"].values.tolist()), tuple(probe.attrs.items()))


def clear_reports() -> None:
    """Forget every cached report (benchmarks measure cold computations with it).

    Example:
        >>> clear_reports()
    """
    _REPORTS.clear()
