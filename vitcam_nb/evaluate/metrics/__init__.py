"""Score-card metrics, one module each (Quantus style): a module here computes its metric, names its public
functions in ``__all__`` and registers itself with :func:`~vitcam_nb.evaluate.metric_registry.register_metric` at
its bottom. Nothing lists them: the modules are found by walking this package when the kit's metrics are registered
(:mod:`vitcam_nb.evaluate.metrics_builtin`, imported with :mod:`vitcam_nb.evaluate`), and each public function is
then reachable as ``vc.evaluate.<name>`` (:func:`exported`, read by ``vitcam_nb.evaluate.__getattr__``).

Adding a metric is adding one module here and its test. A metric written on the model-calling removal engine uses
:mod:`vitcam_nb.evaluate.faithfulness.removal`; the correlation and NaN rules every metric shares are public in
:mod:`vitcam_nb.evaluate.metric_helpers`. Names starting with ``_`` are not walked.

Example:
    >>> from vitcam_nb.evaluate.metric_registry import METRICS
    >>> discover("vitcam_nb.evaluate.metrics")  # walked already when vitcam_nb.evaluate was imported
    ()
    >>> all(name in METRICS for name in registered())
    True
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

from vitcam_nb.evaluate.metric_registry import METRICS

__all__ = ["discover", "exported", "registered"]

_MODULES: list[ModuleType] = []
_REGISTERED: list[str] = []


def discover(package: str) -> tuple[str, ...]:
    """Import every module of ``package`` (a dotted name; names starting with ``_`` skipped), by module name, and
    return the metrics they registered. A package of your own metric modules is found the same way.

    Example:
        >>> discover("vitcam_nb.evaluate.metrics")
        ()
    """
    before = set(METRICS.names())
    path = importlib.import_module(package).__path__
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        name = f"{package}.{info.name}"
        module = importlib.import_module(name)
        if module not in _MODULES:
            _MODULES.append(module)
    found = tuple(n for n in METRICS.names() if n not in before)
    _REGISTERED.extend(found)
    return found


def registered() -> tuple[str, ...]:
    """The metrics the discovered metric modules registered, in discovery order.

    Example:
        >>> isinstance(registered(), tuple)
        True
    """
    return tuple(_REGISTERED)


def exported() -> dict[str, Any]:
    """Every name the discovered metric modules list in ``__all__`` -> its object (``vc.evaluate.<name>``).

    Example:
        >>> isinstance(exported(), dict)
        True
    """
    return {name: getattr(module, name) for module in _MODULES for name in getattr(module, "__all__", ())}
