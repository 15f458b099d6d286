"""The metric registry of score cards: a name -> a function of one image's maps with one uniform signature, its
category (localisation, faithfulness, complexity, robustness, randomisation), whether higher is better and what
it needs (a mask, the model).

Every entry's function takes a :class:`MetricInputs` (one image: its trace, the recipes, their upsampled and
token-grid maps, the mask, the model) and returns one float per recipe, so a metric that scores all recipes of an
image at once (robustness: one trace per perturbed copy for every recipe) registers the same way as a per-map
metric. Per-map functions register with a one-line adapter:

* :func:`on_maps` for ``fn(saliency) -> float`` (or ``fn(saliency, mask)`` with ``mask=True``),
* :func:`on_model_maps` for ``fn(model, trace, saliency, target, **settings)`` returning a float or a DataArray
  whose ``attrs[attr]`` is the score (deletion, insertion and the other model-calling curves).

Example:
    >>> from vitcam_nb.evaluate.complexity.metrics import sparseness
    >>> register_metric("gini_example", "complexity", on_maps(sparseness))
    >>> METRICS.get("gini_example").category
    'complexity'
    >>> _ = METRICS.unregister("gini_example")
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.registry import Registry

__all__ = ["CATEGORIES", "METRICS", "MODEL_LOCK", "Metric", "MetricInputs", "metric_names", "on_maps", "on_model_maps",
           "register_metric"]

CATEGORIES = ("localisation", "faithfulness", "complexity", "robustness", "randomisation")
_NEEDS = ("mask", "model")
# Tracing takes a model exclusively and model calls share its state: model-calling metrics run one at a time even
# when dask runs the images in threads; pure metrics run in parallel.
MODEL_LOCK = threading.RLock()


@dataclass
class MetricInputs:
    """One image, as every registered metric sees it.

    Attributes:
        trace: the image's single trace; recipes: the recipes (class fixed), in score-card order.
        maps / grids: each recipe's upsampled map / token-grid map (``None`` where the trace cannot compute it).
        mask: the ground-truth mask (``None`` if none); model: the model (``None`` if not given).
        target: the class the maps explain when every recipe explains one (else ``None``); seed: for seeded metrics.
        settings: per-metric or per-category settings (``{"robustness": {"n": 5}}``) given to the score card.
        cache: shared by the metrics of this image (e.g. one robustness run for all robustness metrics).

    Example:
        >>> MetricInputs(trace=None, recipes=[], maps=[], grids=[]).mask is None
        True
    """

    trace: Any
    recipes: list[Recipe]
    maps: list[np.ndarray | None]
    grids: list[np.ndarray | None]
    mask: np.ndarray | None = None
    model: Any = None
    target: int | None = None
    seed: int = 0
    settings: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` once per image and key.

        Example:
            >>> m = MetricInputs(None, [], [], []); m.cached("a", lambda: 1), m.cached("a", lambda: 2)
            (1, 1)
        """
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


@dataclass(frozen=True)
class Metric:
    """A registered metric: ``func(MetricInputs) -> one float per recipe``.

    Example:
        >>> Metric("x", "complexity", lambda inp: [], ()).higher_is_better
        True
    """

    name: str
    category: str
    func: Callable[[MetricInputs], Sequence[float]]
    needs: tuple[str, ...] = ()
    higher_is_better: bool = True
    description: str = ""
    by_default: bool = True


METRICS: Registry[Metric] = Registry("metric")


def register_metric(name: str, category: str, func: Callable[[MetricInputs], Sequence[float]], *,
                    needs: Sequence[str] = (), higher_is_better: bool = True, description: str = "",
                    by_default: bool = True, replace: bool = False) -> None:
    """Register a score-card metric (see the module docstring for ``func``'s signature and the adapters).
    ``by_default=False``: a score card runs it only when named (a metric too costly to run unasked).

    Example:
        >>> register_metric("peak_example", "complexity", on_maps(lambda m: float(m.max())), higher_is_better=False)
        >>> "peak_example" in metric_names("complexity")
        True
        >>> _ = METRICS.unregister("peak_example")
    """
    if category not in CATEGORIES:
        raise ArgumentError(f"category: expected one of {CATEGORIES}, got {category!r}")
    bad = [n for n in needs if n not in _NEEDS]
    if bad:
        raise ArgumentError(f"needs: expected names from {_NEEDS}, got {bad}")
    if not callable(func):
        raise ArgumentError(f"func: expected a callable taking MetricInputs, got {type(func).__name__}")
    METRICS.register(name, Metric(name, category, func, tuple(needs), bool(higher_is_better), description,
                                  bool(by_default)), replace=replace)


def metric_names(category: str | None = None) -> list[str]:
    """Registered metric names, of one category or all.

    Example:
        >>> metric_names("complexity")[:2]
        ['sparseness', 'complexity']
    """
    return [n for n in METRICS.names() if category is None or METRICS.get(n).category == category]


def on_maps(fn: Callable[..., float], *, mask: bool = False, grid: bool = False
            ) -> Callable[[MetricInputs], list[float]]:
    """Adapt ``fn(saliency)`` (``fn(saliency, mask)`` with ``mask``) to the registry's signature; the upsampled map
    by default, the token-grid map with ``grid``. A recipe the trace cannot compute scores NaN.

    Example:
        >>> f = on_maps(lambda m: float(m.sum()))
        >>> f(MetricInputs(None, [None, None], [np.ones((2, 2)), None], [None, None]))
        [4.0, nan]
    """
    def run(inputs: MetricInputs) -> list[float]:
        maps = inputs.grids if grid else inputs.maps
        if mask:
            return [np.nan if m is None else float(fn(m, inputs.mask)) for m in maps]
        return [np.nan if m is None else float(fn(m)) for m in maps]

    return run


def on_model_maps(fn: Callable[..., Any], *, attr: str = "auc", grid: bool = True, key: str = "faithfulness",
                  **settings: Any) -> Callable[[MetricInputs], list[float]]:
    """Adapt a model-calling ``fn(model, trace, saliency, target, **settings)`` (token-grid map by default) to the
    registry's signature; a DataArray result scores its ``attrs[attr]``. The score card's ``settings[key]`` are
    added to ``settings`` (e.g. ``{"faithfulness": {"step": 4}}``). Calls hold the model lock.

    Example:
        >>> f = on_model_maps(lambda model, tr, m, target: float(m.mean()) + target)
        >>> f(MetricInputs(None, [Recipe(class_=1)], [None], [np.ones((2, 2))], target=1))
        [2.0]
    """
    def run(inputs: MetricInputs) -> list[float]:
        out = []
        maps = inputs.grids if grid else inputs.maps
        kw = {**settings, **inputs.settings.get(key, {})}
        for recipe, m in zip(inputs.recipes, maps, strict=True):
            if m is None:
                out.append(np.nan)
                continue
            target = recipe.class_ if isinstance(recipe.class_, int) else inputs.target
            with MODEL_LOCK:
                value = fn(inputs.model, inputs.trace, m, target, **kw)
            out.append(float(value.attrs[attr]) if isinstance(value, xr.DataArray) else float(value))
        return out

    return run
