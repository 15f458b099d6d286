"""One word per map for the audit's experiment: does a map **localise** the object, show its **context**, point
**inverted** (high off the object, low on it) or is it **empty**? The rule reads three localisation metrics of
:mod:`~vitcam_nb.evaluate.localisation.metrics` against the object mask; its thresholds are the constants below and are
written out in ``docs/audit_figure.md``.

Example:
    >>> import numpy as np
    >>> mask = np.zeros((32, 32), bool); mask[8:16, 8:16] = True
    >>> label_map(mask.astype(float), mask)[0], label_map(np.zeros((32, 32)), mask)[0]
    ('localises', 'empty')
"""

from __future__ import annotations

import numpy as np

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate._common import aligned, as_map, as_mask
from vitcam_nb.evaluate.localisation.metrics import auroc, default_tolerance, energy_pointing_game, pointing_game

__all__ = ["AUROC_INVERTED", "AUROC_LOCALISES", "EMPTY_RTOL", "LABELS", "POINTING_HIT", "label_map", "rule_text",
           "thresholds"]

LABELS = ("localises", "context", "inverted", "empty")
#: A map whose range (max - min) is at most this share of its largest magnitude (or exactly zero) shows nothing.
EMPTY_RTOL = 1e-6
#: The pointing game counts a hit when at least this share of the map's maximal pixels lie near the mask.
POINTING_HIT = 0.5
#: Localises: a pointing-game hit and the mask's pixels ranked above the rest with at least this AUROC.
AUROC_LOCALISES = 0.7
#: Inverted: the mask's pixels ranked below the rest, AUROC at most this.
AUROC_INVERTED = 0.3


def thresholds() -> dict[str, float | str]:
    """The rule's thresholds by name, as written into the experiment's JSON.

    Example:
        >>> thresholds()["auroc_localises"]
        0.7
    """
    return {"empty_rtol": EMPTY_RTOL, "pointing_hit": POINTING_HIT, "auroc_localises": AUROC_LOCALISES,
            "auroc_inverted": AUROC_INVERTED,
            "pointing_tolerance": "15 px at 224x224, scaled by sqrt(H*W)/224 (evaluate.default_tolerance)"}


def rule_text() -> str:
    """The labelling rule in words, with its thresholds (the JSON and the figure quote it).

    Example:
        >>> rule_text().startswith("empty:")
        True
    """
    return (f"empty: the map's range max-min is 0 or at most {EMPTY_RTOL:g} of its largest magnitude (a degenerate "
            f"map, returned as zeros). localises: the pointing game hits (at least {POINTING_HIT:g} of the map's "
            f"maximal pixels within the tolerance of the mask) and AUROC >= {AUROC_LOCALISES:g} (mask pixels ranked "
            f"above the rest). inverted: AUROC <= {AUROC_INVERTED:g} (the map is high off the object and low on "
            "it). context: any other map: it has structure, but it is neither concentrated on the object nor "
            "ranked below it (evidence around or partly outside the object; compare energy_inside with "
            "mask_share). The rules are applied in this order.")


def label_map(map2d: object, mask: object, tolerance: float | None = None) -> tuple[str, dict[str, float | None]]:
    """The label of ``map2d`` against the boolean object ``mask`` (same shape), and the numbers it was read from.

    Returns ``(label, numbers)`` with ``label`` one of :data:`LABELS` and ``numbers`` holding ``range`` (max -
    min), ``pointing_game`` (share of maximal pixels near the mask), ``auroc``, ``energy_inside`` (share of the
    min-max-normalised map's energy inside the mask, :func:`~vitcam_nb.evaluate.energy_pointing_game`) and
    ``mask_share`` (the mask's share of the pixels); the metrics are None for an empty map. ``tolerance`` is the
    pointing game's, in pixels (default :func:`~vitcam_nb.evaluate.default_tolerance`). A mask that is empty or
    covers the whole map raises ``ValueError`` (there is nothing to tell apart).

    Example:
        >>> import numpy as np
        >>> mask = np.zeros((32, 32), bool); mask[8:16, 8:16] = True
        >>> label, numbers = label_map((~mask).astype(float), mask)
        >>> label, numbers["auroc"]
        ('inverted', 0.0)
    """
    map2d, mask = aligned(("map2d", map2d), ("mask", mask))
    m = as_map(map2d, "map2d")
    msk = as_mask(mask, m.shape)
    if msk.all():
        raise ArgumentError("mask: covers the whole map; the labels need pixels outside the object as well")
    span = float(np.ptp(m))
    numbers: dict[str, float | None] = {"range": span, "pointing_game": None, "auroc": None, "energy_inside": None,
                                        "mask_share": float(msk.mean())}
    if span == 0.0 or span <= EMPTY_RTOL * float(np.abs(m).max()):
        return "empty", numbers
    tol = default_tolerance(m.shape) if tolerance is None else tolerance
    numbers["pointing_game"] = pointing_game(m, msk, tolerance=tol)
    numbers["auroc"] = auroc(m, msk)
    numbers["energy_inside"] = energy_pointing_game(m, msk)
    if numbers["pointing_game"] >= POINTING_HIT and numbers["auroc"] >= AUROC_LOCALISES:
        return "localises", numbers
    if numbers["auroc"] <= AUROC_INVERTED:
        return "inverted", numbers
    return "context", numbers
