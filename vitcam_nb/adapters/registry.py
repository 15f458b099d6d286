"""The table of adapters: which one reads a model, and how families are added.

Every family is one class that declares itself with :func:`declare_family` (a decorator): the optional package it
needs (``open_clip`` for the open_clip adapter, ``transformers`` for BLIP and the Hugging Face families), its place
in the lookup order (``priority``, smaller first; ``before``: families it must precede, e.g. a subclass family
before its parent's). The built-in families are found by walking this package (every module is imported the first
time the table is used; a class whose package is not installed is left out), so adding one is adding a module.
Third-party packages add families through the ``vitcam_nb.adapters`` entry point group
(``name = "package.module:AdapterClass"``), looked up before the built-ins (a plugin for a subclass of a built-in
family must win over it); a user adds one at run time with :func:`register_adapter`, by default in front of all.
The first adapter whose ``matches`` accepts the model reads it. :data:`BUILTIN_ADAPTERS` is the declared built-ins
as ``(family, "module:Class", needs)`` in lookup order, computed from the declarations.

Example:
    >>> import timm
    >>> find_adapter(timm.create_model("vit_tiny_patch16_224", pretrained=False)).family
    'vit'
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import operator
import pkgutil
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, TypeVar

from vitcam_nb.adapters.base import Adapter
from vitcam_nb.adapters.wrappers import unsupported_message
from vitcam_nb.core import module_walk
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError

__all__ = ["BUILTIN_ADAPTERS", "ENTRY_POINT_GROUP", "FamilySpec", "declare_family", "declared_families",  # noqa: F822
           "find_adapter", "lookup_scope", "register_adapter", "scoped", "supported_families", "unregister_adapter"]

ENTRY_POINT_GROUP = "vitcam_nb.adapters"
#: The package whose modules declare the built-in families (walked, every module imported, on first use).
BUILTIN_PACKAGE = "vitcam_nb.adapters"
#: The priority of a family that declares none: after every built-in.
DEFAULT_PRIORITY = 1000

A = TypeVar("A", bound=type)
R = TypeVar("R")


@dataclass(frozen=True)
class FamilySpec:
    """One declared family: its adapter class, the package it needs (None: none beyond the kit's own) and its
    place in the lookup order.

    Example:
        >>> from vitcam_nb.adapters.vit import VitAdapter
        >>> FamilySpec("vit", VitAdapter, None, 100).target
        'vitcam_nb.adapters.vit:VitAdapter'
    """

    family: str
    cls: type
    needs: str | None
    priority: int
    before: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        """``"module:Class"``, as an entry point names a class."""
        return f"{self.cls.__module__}:{self.cls.__qualname__}"


# family -> spec, in order of declaration
_DECLARED: dict[str, FamilySpec] = {}
_ADAPTERS: list[Adapter] = []
_LOADED = False
_LOCK = threading.RLock()


def declare_family(*, needs: str | None = None, priority: int = DEFAULT_PRIORITY,
                   before: tuple[str, ...] = ()) -> Any:
    """Class decorator: declare the decorated :class:`Adapter` subclass (its ``family`` attribute) as a family,
    read when its package ``needs`` is installed, at ``priority`` in the lookup order (smaller first; equal
    priorities keep the order of declaration) and before every family named in ``before``. Declared again (a
    reloaded module), the family's entry is replaced.

    Example:
        >>> @declare_family(priority=5000)
        ... class Mine(Adapter):
        ...     family = "mine_demo"
        >>> declared_families()[-1].family
        'mine_demo'
        >>> _forget("mine_demo")
    """
    if needs is not None and (not isinstance(needs, str) or not needs):
        raise ArgumentError(f"needs: expected a package name or None, got {needs!r}")
    if isinstance(before, str) or not all(isinstance(f, str) for f in before):
        raise ArgumentError(f"before: expected a tuple of family names, got {before!r}")

    def declare(cls: A) -> A:
        if not (isinstance(cls, type) and issubclass(cls, Adapter)):
            raise ArgumentTypeError(f"cls: declare_family decorates an Adapter subclass, got {cls!r}")
        family = getattr(cls, "family", None)
        if not isinstance(family, str) or not family or family == Adapter.family:
            raise ArgumentError(f"family: {cls.__name__} must set its own family name (got {family!r})")
        with _LOCK:
            _DECLARED[family] = FamilySpec(family, cls, needs, int(priority), tuple(before))
        return cls

    return declare


def _forget(family: str) -> None:
    """Drop a declaration (examples and tests that declare a family of their own)."""
    with _LOCK:
        _DECLARED.pop(family, None)


def _discover() -> None:
    """Import every module of :data:`BUILTIN_PACKAGE`, so that each declares its families."""
    package = importlib.import_module(BUILTIN_PACKAGE)
    for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        importlib.import_module(f"{BUILTIN_PACKAGE}.{module.name}")


def _ordered(specs: list[FamilySpec]) -> list[FamilySpec]:
    """``specs`` by priority (stable), then each moved in front of the first family its ``before`` names."""
    order = sorted(specs, key=lambda s: s.priority)
    for spec in [s for s in order if s.before]:
        names = [s.family for s in order]
        ahead = [names.index(f) for f in spec.before if f in names]
        if ahead and min(ahead) < names.index(spec.family):
            order.remove(spec)
            order.insert(min(ahead), spec)
    return order


def declared_families() -> list[FamilySpec]:
    """Every declared family (the built-ins, found by walking the package, and any module imported that declares
    one) in lookup order, whether or not its package is installed.

    Example:
        >>> declared_families()[0].family
        'vit'
    """
    with _LOCK:
        _discover()
        return _ordered(list(_DECLARED.values()))


def _builtin_adapters() -> tuple[tuple[str, str, str | None], ...]:
    return tuple((s.family, s.target, s.needs) for s in declared_families())


def __getattr__(name: str) -> Any:
    # BUILTIN_ADAPTERS is computed from the declarations (PEP 562), so no tuple is kept by hand
    if name == "BUILTIN_ADAPTERS":
        return _builtin_adapters()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _table() -> list[Adapter]:
    """The adapters in lookup order, the declared and entry-point ones loaded on first use."""
    global _LOADED
    with _LOCK:
        if not _LOADED:
            plugins = []
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                try:
                    plugins.append(ep.load()())
                except Exception as exc:  # a broken plugin must not take the built-in families down
                    warnings.warn(f"adapter entry point {ep.name!r} ({ep.value}) failed to load: {exc}",
                                  RuntimeWarning, stacklevel=3)
            # a plugin class that also declares itself is read once, as a plugin
            taken = {type(p) for p in plugins}
            builtins = [s.cls() for s in declared_families() if s.cls not in taken
                        and (s.needs is None or importlib.util.find_spec(s.needs) is not None)]
            _ADAPTERS[:] = plugins + builtins
            _LOADED = True
    return _ADAPTERS


def register_adapter(adapter: Adapter, *, first: bool = True) -> None:
    """Register an adapter for a model family; ``first=True`` lets it take precedence over built-ins.

    Example:
        >>> from vitcam_nb.adapters import register_adapter, unregister_adapter, VitAdapter
        >>> extra = VitAdapter()
        >>> register_adapter(extra, first=False)
        >>> unregister_adapter(extra)
    """
    if not isinstance(adapter, Adapter):
        raise ArgumentTypeError(f"adapter: expected a vitcam_nb.adapters.Adapter, got {type(adapter).__name__}")
    table = _table()
    if first:
        table.insert(0, adapter)
    else:
        table.append(adapter)


def unregister_adapter(adapter: Adapter | str) -> None:
    """Remove an adapter added with :func:`register_adapter`: the instance itself, or every adapter of a family
    name. Built-in adapters can be removed too (e.g. to test a replacement); a name or instance that is not
    registered raises a ValueError.

    Example:
        >>> from vitcam_nb.adapters import register_adapter, unregister_adapter, VitAdapter, supported_families
        >>> before = supported_families()
        >>> mine = VitAdapter()
        >>> register_adapter(mine)
        >>> try:
        ...     pass  # trace models here
        ... finally:
        ...     unregister_adapter(mine)
        >>> supported_families() == before
        True
    """
    table = _table()
    if isinstance(adapter, str):
        keep = [a for a in table if a.family != adapter]
        if len(keep) == len(table):
            raise ArgumentError(f"adapter: no registered adapter of family {adapter!r}; "
                                f"registered: {', '.join(supported_families())}")
        table[:] = keep
        return
    for i, registered in enumerate(table):
        if registered is adapter:  # identity: a user's second instance of a built-in class stays distinct
            del table[i]
            return
    raise ArgumentError(f"adapter: {type(adapter).__name__} (family {getattr(adapter, 'family', '?')!r}) is not "
                        "registered")


def supported_families() -> list[str]:
    """Names of the model families that have an adapter (built-ins whose package is installed included).

    Example:
        >>> "vit" in supported_families()
        True
    """
    return [a.family for a in _table()]


#: inside :func:`lookup_scope`: id(model) -> (model, the table's adapters when it was looked up, its adapter), and
#: :func:`scoped`'s (name, id(owner), id(model)) -> (owner, model, answer)
_SCOPE: contextvars.ContextVar[dict[object, tuple[Any, ...]] | None] = \
    contextvars.ContextVar("vitcam_nb_adapter_scope", default=None)


@contextlib.contextmanager
def lookup_scope() -> Any:
    """Inside, :func:`find_adapter` looks each model up once (one ``vitcam_nb.trace`` call asks for the same
    model's adapter several times, each a walk of every family's ``matches``); the answer holds while the table holds
    the same adapters in the same order, and is forgotten on exit. The model's module tree is walked once inside it
    too (:func:`vitcam_nb.core.module_walk.walk_scope`).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> with lookup_scope():
        ...     find_adapter(m) is find_adapter(m)
        True
    """
    token = _SCOPE.set({})
    try:
        with module_walk.walk_scope():  # the module tree is as stable for the call as the adapter lookups
            yield
    finally:
        _SCOPE.reset(token)


def scoped(owner: object, model: object, name: str, compute: Callable[[], R]) -> R:
    """``compute()``, once per ``owner``, ``model`` and ``name`` inside :func:`lookup_scope` (each call outside one):
    for an answer that depends only on the model's module tree, which one trace call does not change where it is
    asked (an adapter's layer-list path, found by trying paths and catching their failures). An exception is never
    remembered.

    Example:
        >>> calls = []
        >>> with lookup_scope():
        ...     [scoped(1, 2, "x", lambda: calls.append(0) or "v") for _ in range(3)], len(calls)
        (['v', 'v', 'v'], 1)
    """
    memo = _SCOPE.get()
    if memo is None:
        return compute()
    key = (name, id(owner), id(model))
    hit = memo.get(key)
    if hit is not None and hit[0] is owner and hit[1] is model:
        return hit[2]
    value = compute()
    memo[key] = (owner, model, value)  # both held: their ids stay theirs meanwhile
    return value


def find_adapter(model: object) -> Adapter:
    """Return the adapter for ``model`` or raise a TypeError naming its class, the supported families and the
    three ways forward (an adapter, a wrapper to unwrap, a family to request).

    Example:
        >>> find_adapter(object())  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        vitcam_nb.core.errors.ArgumentTypeError: model: ...
    """
    table = _table()
    memo = _SCOPE.get()
    if memo is not None:
        hit = memo.get(id(model))
        # the model itself is held, so its id stays its own while the scope lasts
        if hit is not None and hit[0] is model and len(hit[1]) == len(table) and all(map(operator.is_, hit[1], table)):
            return hit[2]
    for adapter in table:
        if adapter.matches(model):
            if memo is not None:
                memo[id(model)] = (model, tuple(table), adapter)
            return adapter
    raise ArgumentTypeError(unsupported_message(model, supported_families()))
