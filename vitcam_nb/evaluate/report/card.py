"""The localisation scores a report card shows beside a map: the pointing game never alone. A map's maximum can
lie on the object while most of its mass lies outside it (pointing game 1.0, AUROC below 0.5), so each card
shows the AUROC of the map as a detector of the mask's pixels and the audit label
(:func:`vitcam_nb.evaluate.audit.labels.label_map`) read from both.

Example:
    >>> import numpy as np
    >>> mask = np.zeros((16, 16), bool); mask[4:8, 4:8] = True
    >>> scores = card_scores(mask.astype(float), mask)
    >>> list(scores), scores["audit label"]
    (['pointing game', 'AUROC', 'audit label', 'relevance mass'], 'localises')
"""

from __future__ import annotations

import numpy as np

from vitcam_nb.evaluate.audit.labels import label_map
from vitcam_nb.evaluate.localisation.metrics import energy_pointing_game, relevance_mass_accuracy

__all__ = ["card_scores"]


def card_scores(cam_map: object, mask: object) -> dict[str, float | str]:
    """Pointing game, AUROC and the audit label of ``cam_map`` against the boolean ``mask`` (same shape), then the
    relevance mass; the energy pointing game too only where it differs from the relevance mass (it equals it for a
    non-negative map with minimum 0, as min-max normalised maps are). The pointing game and AUROC are those the
    label was read from (default tolerance, :func:`vitcam_nb.evaluate.default_tolerance`).

    Example:
        >>> import numpy as np
        >>> mask = np.zeros((16, 16), bool); mask[4:8, 4:8] = True
        >>> card_scores((~mask).astype(float), mask)["AUROC"]
        0.0
    """
    label, numbers = label_map(cam_map, mask)
    scores: dict[str, float | str] = {"pointing game": _number(numbers["pointing_game"]),
                                      "AUROC": _number(numbers["auroc"]), "audit label": label}
    energy, mass = energy_pointing_game(cam_map, mask), relevance_mass_accuracy(cam_map, mask)
    if not np.isclose(energy, mass, rtol=1e-9, atol=1e-12, equal_nan=True):
        scores["energy pointing game"] = energy
    scores["relevance mass"] = mass
    return scores


def _number(value: float | None) -> float:
    """An empty map has no pointing game or AUROC (the label says 'empty'): NaN on the card, never a number."""
    return float("nan") if value is None else float(value)
