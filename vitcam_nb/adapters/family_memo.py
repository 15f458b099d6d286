"""Which family row reads a model's class, remembered per class: the lookup walks the class's MRO once per row,
and a trace asks it dozens of times (every adapter method of a generative VLM starts with it: issue 55's trace-cost
row). A remembered answer is given only while the table holds the very rows, in the same order, it was found among;
a refusal (an exception) is never remembered.

Example:
    >>> rows = {"a": ("A",)}
    >>> by_class(3, rows, lambda m: rows["a"])
    ('A',)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["by_class"]

R = TypeVar("R")

#: per lookup function: class -> (the rows it was found among, what it found); at most :data:`_MAX` classes each
#: (the oldest forgotten first), so classes made on the fly are not all held
_MEMOS: dict[Callable[[object], Any], dict[type, tuple[tuple[Any, ...], Any]]] = {}
_MAX = 64


def by_class(model: object, table: Mapping[str, Any], find: Callable[[object], R]) -> R:
    """``find(model)``, remembered for ``type(model)`` together with the rows of ``table`` it was found among (held,
    so their identities stay theirs); looked up again when any row was added, removed, replaced or moved. ``find``
    must depend on the model's class and the table's rows only.

    Example:
        >>> calls, table = [], {"x": object()}
        >>> def find(m):
        ...     calls.append(m)
        ...     return table["x"]
        >>> by_class(1, table, find) is by_class(2, table, find), len(calls)
        (True, 1)
        >>> table["y"] = object()
        >>> _ = by_class(1, table, find); len(calls)
        2
    """
    memo = _MEMOS.get(find)
    if memo is None:
        memo = _MEMOS.setdefault(find, {})
    rows = tuple(table.values())
    hit = memo.get(type(model))
    if hit is not None and len(hit[0]) == len(rows) and all(map(operator.is_, hit[0], rows)):
        return hit[1]
    found = find(model)
    if len(memo) >= _MAX:
        memo.pop(next(iter(memo)))
    memo[type(model)] = (rows, found)
    return found
