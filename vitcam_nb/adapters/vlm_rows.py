"""Which rows of a generative VLM's projector output are the image tokens a layout keeps: the projector runs on
the tower's tokens of every crop (one crop for most families), before the LM's sequence places them.

Example:
    >>> a = np.arange(8.0).reshape(4, 2)  # a class token row, then three patch tokens
    >>> proj_rows([1, 9, 9, 9, 9, 2], 9, np.array([2, 3, 4]), a, a[None])[0][:, 0].tolist()
    [2.0, 4.0, 6.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["proj_rows"]


def proj_rows(ids: Any, image_id: int, pos: np.ndarray, act: np.ndarray, grad: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """The projector's rows (and gradients) of the kept image tokens at ``pos``: its output (tokens, channels),
    the crops' tokens one crop after the other. Each placeholder of the sequence takes the next row when the
    counts match (a dropped class token, a later image of the prompt are skipped), else the last ``pos.size``
    rows are the kept tokens.

    Example:
        >>> a = np.arange(6.0).reshape(3, 2)
        >>> proj_rows([1, 9, 9, 9, 2], 9, np.array([2, 3]), a, a[None])[0].tolist()
        [[2.0, 3.0], [4.0, 5.0]]
    """
    slots = np.flatnonzero(np.asarray(ids) == image_id)
    rows = np.searchsorted(slots, pos)
    if slots.size != act.shape[0] or not np.array_equal(slots[np.minimum(rows, slots.size - 1)], pos):
        rows = np.arange(act.shape[0] - pos.size, act.shape[0])
    return act[rows], grad[:, rows]
