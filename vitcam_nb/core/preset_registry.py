"""Where presets register themselves: :func:`register_preset` (a decorator on a recipe factory) adds a preset, its
citation and its row of the audit table; :func:`discover_presets` imports every ``vitcam_nb/core/presets_*.py``
module once (a walk of the package, no list to edit) before the presets are first listed or looked up.

Example:
    >>> from vitcam_nb.core.presets import preset_names
    >>> "attention_rollout" in preset_names()
    True
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable
from typing import TypeVar

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.recipe import Recipe

__all__ = ["CITATIONS", "PRESETS", "PRESET_ROWS", "discover_presets", "register_preset", "unregister_preset"]

F = TypeVar("F", bound=Callable[..., Recipe])

#: Every preset: name -> its recipe factory (filled by the preset modules; ``vitcam_nb.core.presets.PRESETS``).
PRESETS: dict[str, Callable[..., Recipe]] = {}
#: Every preset's source: name -> citation (``vitcam_nb.core.presets.CITATIONS``).
CITATIONS: dict[str, str] = {}

#: The audit-table rows of presets registered with one (:func:`register_preset`'s ``taxonomy``); the taxonomy
#: module adds them to its table.
PRESET_ROWS: dict[str, dict[str, str]] = {}
_DISCOVERED = False


def discover_presets() -> None:
    """Import every ``vitcam_nb.core.presets_*`` module once, so that each registers its presets.

    Example:
        >>> discover_presets(); "tokentm" in PRESETS
        True
    """
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True  # first: the modules read the table while they are imported
    core = importlib.import_module("vitcam_nb.core")
    for module in sorted(pkgutil.iter_modules(core.__path__), key=lambda m: m.name):
        if module.name.startswith("presets_"):
            importlib.import_module(f"vitcam_nb.core.{module.name}")
    importlib.import_module("vitcam_nb.core.preset_taxonomy")


def register_preset(citation: str, *, name: str | None = None, taxonomy: dict[str, str] | None = None,
                    replace: bool = False) -> Callable[[F], F]:
    """Decorator: register the decorated recipe factory as preset ``name`` (default: the function's name) with
    its source ``citation`` and, optionally, its row of the audit table (``taxonomy``: paper, code, site, target,
    tokens, aggregation, reconstruction). Put the module in ``vitcam_nb/core/presets_<topic>.py``: it is found
    without a list to edit, and ``vc.presets.<name>`` reaches the function.

    Example:
        >>> @register_preset("a docs example", name="demo_preset")
        ... def demo_preset() -> Recipe:
        ...     return Recipe(weighting="layercam")
        >>> from vitcam_nb.core.presets import citation, get
        >>> get("demo_preset").weighting, citation("demo_preset")
        ('layercam', 'a docs example')
        >>> _forget("demo_preset")
    """
    if not isinstance(citation, str) or not citation:
        raise ArgumentError(f"citation: expected a non-empty string naming the preset's source, got {citation!r}")

    def register(make: F) -> F:
        key = name or make.__name__
        if key in PRESETS and PRESETS[key] is not make and not replace:
            raise ArgumentError(f"name: a preset named {key!r} is registered already; pass replace=True")
        PRESETS[key] = make
        CITATIONS[key] = citation
        if taxonomy is not None:
            PRESET_ROWS[key] = dict(taxonomy)
            # the taxonomy module adds PRESET_ROWS when it is built; built already, its table takes the row now
            table = getattr(sys.modules.get("vitcam_nb.core.preset_taxonomy"), "TAXONOMY", None)
            if table is not None:
                table[key] = dict(taxonomy)
        return make

    return register


def unregister_preset(name: str) -> None:
    """Remove preset ``name``, its citation and its audit-table row (a preset registered at run time: examples and
    tests undo theirs); an unknown name is refused by name.

    Example:
        >>> _ = register_preset("a docs example", name="demo_preset")(lambda: Recipe())
        >>> unregister_preset("demo_preset"); "demo_preset" in PRESETS
        False
    """
    discover_presets()
    if not isinstance(name, str) or name not in PRESETS:
        raise ArgumentError(f"name: no preset named {name!r} is registered; registered: {sorted(PRESETS)}")
    _forget(name)


def _forget(name: str) -> None:
    """Remove a preset registered at run time, whether registered or not (tests)."""
    PRESETS.pop(name, None)
    CITATIONS.pop(name, None)
    PRESET_ROWS.pop(name, None)
    table = getattr(sys.modules.get("vitcam_nb.core.preset_taxonomy"), "TAXONOMY", None)
    if table is not None:
        table.pop(name, None)
