"""An ordered table of named entries, defined low and filled by the modules that implement them.

The layered design extends by registration: a lower layer defines the table and the interface of its
entries, a higher layer registers implementations, and nothing low ever imports what fills it.

Example:
    >>> table = Registry("colour")
    >>> table.register("red", 1)
    >>> table.register("blue", 2, first=True)
    >>> table.names()
    ['blue', 'red']
    >>> table.get("red")
    1
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Generic, TypeVar

from vitcam_nb.core.errors import ArgumentError

T = TypeVar("T")

__all__ = ["Registry", "fill_from"]

# Modules that register built-in entries, imported before any registry is first read or written. ``import vitcam_nb``
# imports its layers lazily (the command line answers --help without torch), so the package names here the layer
# that fills the tables; a lookup through a directly imported submodule then still finds the built-ins, first.
_PENDING: list[str] = []


def fill_from(module: str) -> None:
    """Import ``module`` (by name, so that no lower layer imports a higher one) before the first use of any registry.

    Example:
        >>> fill_from("vitcam_nb.core.errors")
    """
    if module not in _PENDING:
        _PENDING.append(module)


def _fill() -> None:
    # Popped before importing: the module's own registrations read the tables while it is being imported.
    while _PENDING:
        module = _PENDING.pop(0)
        try:
            importlib.import_module(module)
        except BaseException:
            _PENDING.insert(0, module)
            raise


class Registry(Generic[T]):
    """Named entries in lookup order; ``what`` names the kind of entry in error messages.

    Example:
        >>> r = Registry("shape"); r.register("circle", object())
        >>> "circle" in r, len(r)
        (True, 1)
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._table: dict[str, T] = {}
        # name -> declared lookup priority (smaller first); the table is kept sorted by it, ties in order of
        # registration, so the order does not depend on which module happened to be imported first
        self._priorities: dict[str, float] = {}

    @property
    def _entries(self) -> dict[str, T]:
        _fill()
        return self._table

    @_entries.setter
    def _entries(self, table: dict[str, T]) -> None:
        self._table = table

    def register(self, name: str, entry: T, *, first: bool = False, replace: bool = False,
                 priority: float | None = None) -> None:
        """Add ``entry`` under ``name``. ``priority`` declares its place in lookup order (smaller first, equal
        priorities in order of registration), whatever order the registering modules are imported in; without
        one, ``first`` puts it before every entry registered so far, else after them.

        A name that is taken is refused unless ``replace`` (then the entry keeps its place, or takes the new
        ``priority`` if one is given).

        Example:
            >>> r = Registry("x"); r.register("a", 1); r.register("a", 2, replace=True); r.get("a")
            2
            >>> r = Registry("x"); r.register("late", 1, priority=20); r.register("early", 2, priority=10)
            >>> r.names(), r.priority("early")
            (['early', 'late'], 10.0)
        """
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"name: expected a non-empty string naming the {self.what}, got {name!r}")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, (int, float))
                                     or priority != priority):
            raise ArgumentError(f"priority: expected a number (smaller is looked up first), got {priority!r}")
        table = self._entries
        if name in table and not replace:
            raise ArgumentError(f"name: a {self.what} named {name!r} is registered already; "
                                f"registered: {self.names()}")
        if priority is None:
            if name in self._priorities:
                priority = self._priorities[name]
            elif not self._priorities:
                priority = 0.0
            elif first:
                priority = min(self._priorities.values()) - 1
            else:
                priority = max(self._priorities.values()) + 1
        if name not in table or self._priorities.get(name) != float(priority):
            table.pop(name, None)  # re-registered at a new priority: it moves, after the entries of equal priority
        table[name] = entry
        self._priorities[name] = float(priority)
        # sorted() is stable: entries of one priority keep their order of registration
        self._entries = {n: table[n] for n in sorted(table, key=self._priorities.__getitem__)}

    def priority(self, name: str) -> float:
        """The lookup priority ``name`` was registered at (smaller is looked up first).

        Example:
            >>> r = Registry("x"); r.register("a", 1, priority=5); r.priority("a")
            5.0
        """
        self.get(name)  # an unknown name is refused with the registered ones
        return self._priorities[name]

    def unregister(self, name: str) -> T:
        """Remove and return the entry ``name``.

        Example:
            >>> r = Registry("x"); r.register("a", 1); r.unregister("a"), r.names()
            (1, [])
        """
        if name not in self._entries:
            raise ArgumentError(f"name: no {self.what} named {name!r} is registered; registered: {self.names()}")
        self._priorities.pop(name, None)
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        """The entry ``name``; an unknown name is a ValueError listing the registered ones.

        Example:
            >>> r = Registry("x"); r.register("a", 1); r.get("a")
            1
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ArgumentError(f"name: no {self.what} named {name!r}; registered: {self.names()}") from None

    def names(self) -> list[str]:
        """Names in lookup order.

        Example:
            >>> Registry("x").names()
            []
        """
        return list(self._entries)

    def values(self) -> list[T]:
        """Entries in lookup order.

        Example:
            >>> r = Registry("x"); r.register("a", 1); r.values()
            [1]
        """
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
