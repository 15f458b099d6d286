"""Score cards: every recipe x every registered metric over many images, as a mean with a seeded bootstrap 95 %
interval and a count.

Over a :func:`vitcam_nb.trace_many` store (opened with :func:`vitcam_nb.open_traces`) the work is one dask task
per image (that image's chunks only, every recipe and metric inside the task), computed on the active
``dask.distributed`` Client if there is one, else on dask's local scheduler, with a progress bar. Over a list of
single traces it runs eagerly, image by image; both give the same numbers.

The interval is a paired percentile bootstrap: ``n_boot`` resamples of the images drawn with replacement from
``numpy.random.default_rng(seed)`` (the same resamples for every recipe and metric), the statistic the mean of the
finite values of a resample; the interval is the 2.5th and 97.5th percentile of those means. ``count`` is the
number of images with a finite value (a degenerate map or a NaN metric is left out). One image gives no interval:
where ``count`` is below 2 ``low`` and ``high`` are NaN, and a :class:`~vitcam_nb.evaluate.MetricWarning` says
so; another names each recipe whose scores are NaN on every image.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> trs = [vc.trace(m, np.random.default_rng(i).integers(0, 256, (32, 32, 3), np.uint8)) for i in range(3)]
    >>> card = scorecard(trs, [vc.Recipe(layer=0), vc.Recipe(layer=1)], metrics=["sparseness"], progress=False)
    >>> card["mean"].dims, card["count"].values.ravel().tolist()
    (('recipe', 'metric'), [3, 3])
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

import vitcam_nb.evaluate.metrics_builtin  # noqa: F401  (fills the registry with the kit's metrics)
from vitcam_nb.capture.budget import BUDGET_FRACTION, available_bytes
from vitcam_nb.capture.reader import image_trace, is_store
from vitcam_nb.capture.worker_model import active_client
from vitcam_nb.compute.map_store import MAPS, image_maps, is_map_store
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, DegenerateMapWarning, RecipeError
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.evaluate._common import MetricWarning, warn
from vitcam_nb.evaluate.metric_registry import METRICS, Metric, MetricInputs

__all__ = ["MAP_CATEGORIES", "bootstrap_interval", "image_scores", "scorecard"]

_TARGETS = ("recipe", "label")
#: The metric categories a map store can be scored with: they read the maps (and the mask) only.
MAP_CATEGORIES = ("localisation", "complexity")


def bootstrap_interval(values: np.ndarray, n_boot: int = 1000, seed: int = 0, level: float = 0.95
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap interval of the mean over the first axis (images), NaN values left out of each mean;
    the same ``n_boot`` resamples (``default_rng(seed).integers(0, n, (n_boot, n))``) for every other position.

    Example:
        >>> lo, hi = bootstrap_interval(np.array([[0.0], [1.0], [2.0], [3.0]]), n_boot=200)
        >>> bool(lo[0] < 1.5 < hi[0])
        True
    """
    values = np.asarray(values, np.float64)
    n = len(values)
    if n == 0:
        nan = np.full(values.shape[1:], np.nan)
        return nan, nan.copy()
    idx = np.random.default_rng(seed).integers(0, n, size=(int(n_boot), n))
    means = np.empty((int(n_boot), *values.shape[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a resample with no finite value: NaN mean
        for b in range(int(n_boot)):
            means[b] = np.nanmean(values[idx[b]], axis=0)
        tail = (1.0 - level) / 2.0 * 100.0
        lo, hi = np.nanpercentile(means, [tail, 100.0 - tail], axis=0)
    return lo, hi


def _resolve_class(recipe: Recipe, trace: xr.Dataset, target: str) -> Recipe:
    if recipe.layer_fusion == "rollout":  # attention rollout uses no class
        return recipe
    if target == "label":
        label = trace.attrs.get("image_label", -1)
        if label is None or int(label) < 0:
            raise ArgumentError("target: 'label' needs each image's ground-truth class (trace_many image_labels); "
                                f"image {trace.attrs.get('image_index', '?')} has none")
        traced = [int(c) for c in trace["target_class"].values] if "target_class" in trace.coords else []
        if traced and int(label) not in traced:  # its map would need a gradient the trace does not hold
            raise ArgumentError(f"target: 'label' explains image {trace.attrs.get('image_index', '?')}'s class "
                                f"{int(label)}, which its trace does not hold (traced classes {traced}); trace with "
                                "targets that include every label (e.g. 'topN' with N the number of classes)")
        return recipe.replace(class_=int(label))
    if isinstance(recipe.class_, str):  # "topN": the N-th highest logit of this image
        order = np.argsort(-np.asarray(trace["logits"].values, np.float64), kind="stable")
        return recipe.replace(class_=int(order[int(recipe.class_[3:]) - 1]))
    return recipe


def _map(trace: xr.Dataset, recipe: Recipe) -> np.ndarray | None:
    try:
        out = kind_for(trace, recipe).cam(trace, recipe)
    except RecipeError:
        return None
    return None if out.attrs.get("degenerate") else np.asarray(out.values, np.float64)


def image_scores(trace: xr.Dataset, recipes: Sequence[Recipe], metrics: Sequence[Metric], *, mask: Any = None,
                 model: Any = None, target: str = "recipe", seed: int = 0, settings: dict | None = None
                 ) -> np.ndarray:
    """Every metric of every recipe on one image's trace: ``(recipe, metric)``; NaN where a map is degenerate or
    the trace cannot compute the recipe.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8))
        >>> image_scores(tr, [vc.Recipe(layer=0)], [METRICS.get("sparseness")]).shape
        (1, 1)
    """
    # A map store holds the maps of its recipes as named, "topN" resolved per image when they were computed (the
    # N-th traced class: the N-th highest logit); they are read by those recipes.
    read = list(recipes) if is_map_store(trace) else None
    recipes = [_resolve_class(r, trace, target) for r in recipes]
    read = read or recipes
    if mask is None and "mask" in trace:
        mask = np.asarray(trace["mask"].values, bool)
    classes = {r.class_ for r in recipes if r.layer_fusion != "rollout"}
    inputs = MetricInputs(
        trace=trace, recipes=recipes, maps=[_map(trace, r) for r in read],
        grids=[_map(trace, r.replace(upsample="none")) for r in read], mask=mask, model=model,
        target=int(next(iter(classes))) if len(classes) == 1 else None, seed=seed, settings=dict(settings or {}))
    out = np.full((len(recipes), len(metrics)), np.nan)
    for j, metric in enumerate(metrics):
        out[:, j] = np.asarray(metric.func(inputs), np.float64)
    return out


def _metrics(metrics: Sequence[str] | None, has_mask: bool, model: Any, maps_only: bool = False) -> list[Metric]:
    if metrics is None:
        return [METRICS.get(n) for n in METRICS.names()
                if METRICS.get(n).by_default and (has_mask or "mask" not in METRICS.get(n).needs)
                and (model is not None or "model" not in METRICS.get(n).needs)
                and (not maps_only or METRICS.get(n).category in MAP_CATEGORIES)]
    if isinstance(metrics, str) or not metrics:
        raise ArgumentError(f"metrics: expected a non-empty list of metric names from {METRICS.names()}, got "
                            f"{metrics!r}")
    chosen = [METRICS.get(n) for n in metrics]
    other = [m.name for m in chosen if maps_only and m.category not in MAP_CATEGORIES]
    if other:
        raise ArgumentError(f"metrics: {other} read the trace or call the model; a map store holds maps only, which "
                            f"the {' and '.join(MAP_CATEGORIES)} metrics read (score traces for the others)")
    for m in chosen:
        if "model" in m.needs and model is None:
            raise ArgumentError(f"model: metric {m.name!r} calls the model; pass model=")
        if "mask" in m.needs and not has_mask:
            raise ArgumentError(f"masks: metric {m.name!r} needs a ground-truth mask per image; pass masks= or trace "
                                "the store with masks")
    return chosen


def _run(source: Any, n: int, masks: Sequence[Any] | None, kw: dict, progress: bool) -> np.ndarray:
    from vitcam_nb.core.progress import progress_bar as tqdm

    def one(i: int, trace: xr.Dataset) -> np.ndarray:
        return image_scores(trace, mask=None if masks is None else np.asarray(masks[i], bool), **kw)

    if not is_store(source):
        return np.stack([one(i, tr) for i, tr in enumerate(tqdm(source, desc="scorecard", disable=not progress))])
    import dask

    def task(block: xr.Dataset, i: int) -> np.ndarray:
        return one(i, image_maps(block, 0) if is_map_store(block) else image_trace(block, 0))

    tasks = [dask.delayed(task, pure=False)(source.isel(image=[i]), i) for i in range(n)]
    client = active_client()
    if client is not None:
        from distributed import as_completed

        futures = client.compute(tasks)
        for _ in tqdm(as_completed(futures), total=n, desc="scorecard", disable=not progress):
            pass
        return np.stack(client.gather(futures))
    with _TaskBar({t.key for t in tasks}, progress):
        return np.stack(dask.compute(*tasks))


def _check_stored(store: xr.Dataset, recipes: Sequence[Recipe], target: str) -> None:
    """Refuse, before any image is scored, what a map store cannot give: another class than its recipes name,
    and a recipe it does not hold (named)."""
    if target != "recipe":
        raise ArgumentError("target: a map store's maps explain the classes its recipes name; target='label' needs "
                            "traces (vc.trace_many with image_labels)")
    first = image_maps(store, 0)
    missing = []
    for recipe in recipes:
        try:
            MAPS.compute(first, recipe)
        except RecipeError:
            missing.append(recipe.to_string())
    if missing:
        raise RecipeError(f"recipes: {missing} are not in this map store; score the recipes it holds, or traces")


def _warn_gaps(recipes: list[Recipe], metrics: list[str], count: np.ndarray, n: int) -> None:
    """A MetricWarning per recipe with scores that are NaN on every image, and one for the intervals one image
    cannot give."""
    for r, row in zip(recipes, count):
        empty = [m for m, c in zip(metrics, row) if c == 0]
        if empty:
            what = "every metric" if len(empty) == len(metrics) else ", ".join(empty)
            warn(f"scorecard: recipe {r.id} ({r.site}, layer {r.layer}, {r.weighting}) is NaN for {what} on all "
                 f"{n} image(s): its maps are degenerate, the traces cannot compute it or the metric is undefined "
                 "there")
    single = int((count == 1).sum())
    if single:
        warn(f"scorecard: {single} (recipe, metric) score(s) have a finite value on one image only; one image gives "
             "no 95 % interval, so their low and high are NaN (score more images)")


class _TaskBar:
    """A tqdm bar over the image tasks of a local dask computation."""

    def __init__(self, keys: set, show: bool) -> None:
        from dask.callbacks import Callback

        from vitcam_nb.core.progress import progress_bar as tqdm

        bar = tqdm(total=len(keys), desc="scorecard", disable=not show)
        self.bar = bar

        class _Posttask(Callback):
            def _posttask(self, key, result, dsk, state, worker_id):  # noqa: ANN001
                if key in keys:
                    bar.update(1)

        self.callback = _Posttask()

    def __enter__(self) -> _TaskBar:
        self.callback.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.callback.__exit__(*exc)
        self.bar.close()


def scorecard(
    store_or_traces: Any,
    recipes: Sequence[Recipe],
    metrics: Sequence[str] | None = None,
    *,
    masks: Sequence[Any] | None = None,
    model: Any = None,
    target: str = "recipe",
    n_boot: int = 1000,
    seed: int = 0,
    settings: dict | None = None,
    progress: bool | None = None,
) -> xr.Dataset:
    """Score every recipe with every metric on every image: mean, bootstrap 95 % interval and count over images.

    Args:
        store_or_traces: a many-image Dataset (:func:`vitcam_nb.open_traces`; lazy, one dask task per image), or a
            sequence of single traces (eager). A map store (:func:`vitcam_nb.open_maps`) is scored with the
            metrics that read maps only (:data:`MAP_CATEGORIES`: localisation, with ``masks=``, and complexity)
            for the recipes it holds, each map read as ``vc.cam`` reads it.
        recipes: the recipes (distinct ids); their class is resolved per image (``"topN"``: the N-th highest logit)
            or, with ``target="label"``, replaced by the image's ground-truth label.
        metrics: names from the metric registry (``vc.evaluate.METRICS.names()``); default every registered metric
            whose needs (mask, model) are met, but those registered ``by_default=False`` (``shapley_agreement``:
            2^16 model calls per image), which run when named.
        masks: one boolean mask per image at the input size (default the store's ``mask`` variable if any).
        model: the model, for the metrics that call it (faithfulness, robustness).
        n_boot, seed: bootstrap resamples and their seed (the seed also seeds seeded metrics).
        settings: per-category or per-metric settings given to the metrics, e.g. ``{"robustness": {"n": 5}}``.
        progress: progress bar (default: more than 4 images).

    Returns:
        Dataset over ``(recipe, metric)``: ``mean``, ``low``, ``high``, ``count`` and the per-image ``values``
        ``(image, recipe, metric)``; coordinates ``category``, ``higher_is_better`` (per metric) and
        ``recipe_json``; attrs the settings. ``card.scorecard.plot()`` and ``card.scorecard.agreement()`` (see
        :mod:`~vitcam_nb.evaluate.scorecard.plot`).

    Example:
        >>> card = scorecard(vc.open_traces("t.zarr"), [vc.presets.get("gradcam")], model=m)  # doctest: +SKIP
    """
    try:
        recipes = list(recipes)
    except TypeError:
        raise ArgumentTypeError(f"recipes: expected a non-empty sequence of vitcam_nb.Recipe, got "
                                f"{type(recipes).__name__}") from None
    if not recipes or not all(isinstance(r, Recipe) for r in recipes):
        raise ArgumentError("recipes: expected a non-empty sequence of vitcam_nb.Recipe")
    ids = [r.id for r in recipes]
    if len(set(ids)) != len(ids):
        raise ArgumentError("recipes: two recipes are the same recipe (equal ids); give each once")
    if target not in _TARGETS:
        raise ArgumentError(f"target: expected one of {_TARGETS}, got {target!r}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ArgumentError(f"n_boot: expected a positive int, got {n_boot!r}")
    lazy = is_store(store_or_traces)
    source = store_or_traces if lazy else ([store_or_traces] if isinstance(store_or_traces, xr.Dataset)
                                           else list(store_or_traces))
    bad = [] if lazy else [type(t).__name__ for t in source if not isinstance(t, (xr.Dataset, xr.DataTree))]
    if bad:
        raise ArgumentTypeError(f"store_or_traces: expected an open_traces store or a list of traces, got a {bad[0]} "
                                f"in it")
    n = int(source.sizes["image"]) if lazy else len(source)
    if n == 0:
        raise ArgumentError("store_or_traces: no images")
    if masks is not None and len(masks) != n:
        raise ArgumentError(f"masks: expected one mask per image ({n}), got {len(masks)}")
    has_mask = masks is not None or ("mask" in source if lazy else all("mask" in t for t in source))
    chosen = _metrics(metrics, has_mask, model, maps_only=is_map_store(source))
    if is_map_store(source):
        _check_stored(source, recipes, target)
    # The bootstrap holds every resample's image indices and means at once: refused before any image is scored.
    need, free = int(n_boot) * 8 * (n + 2 * len(recipes) * len(chosen)), available_bytes()
    if free is not None and need > BUDGET_FRACTION * free:
        raise ArgumentError(f"n_boot: {n_boot} resamples of {n} images would hold about {need / 1e9:.1f} GB, over the "
                            f"budget ({BUDGET_FRACTION:.0%} of the {free / 1e9:.1f} GB available); lower n_boot")
    kw = {"recipes": recipes, "metrics": chosen, "model": model, "target": target, "seed": int(seed),
          "settings": settings}
    with warnings.catch_warnings():
        # Why a value is NaN is counted, not printed once per image: the tasks' warnings would flood the output.
        for cat in (MetricWarning, DegenerateMapWarning, RuntimeWarning):
            warnings.simplefilter("ignore", cat)
        values = _run(source, n, masks, kw, n > 4 if progress is None else bool(progress))
        mean = np.nanmean(values, axis=0)
    count = np.isfinite(values).sum(axis=0)
    low, high = bootstrap_interval(values, n_boot, seed)
    low[count < 2] = high[count < 2] = np.nan  # a resample of one value is that value: a width of 0, no interval
    _warn_gaps(recipes, [m.name for m in chosen], count, n)
    image_ids = source["image"].values if lazy else np.arange(n)
    return xr.Dataset(
        {"mean": (("recipe", "metric"), mean), "low": (("recipe", "metric"), low),
         "high": (("recipe", "metric"), high),
         "count": (("recipe", "metric"), count),
         "values": (("image", "recipe", "metric"), values)},
        coords={"recipe": ids, "metric": [m.name for m in chosen], "image": image_ids,
                "category": ("metric", [m.category for m in chosen]),
                "higher_is_better": ("metric", [m.higher_is_better for m in chosen]),
                "recipe_json": ("recipe", [r.to_json() for r in recipes])},
        attrs={"n_images": n, "n_boot": int(n_boot), "seed": int(seed), "level": 0.95, "target": target,
               "interval": "paired percentile bootstrap of the mean over images (default_rng(seed)); NaN where "
                           "fewer than two images have a finite value",
               "settings": json.dumps(settings or {}, sort_keys=True), "lazy": int(lazy)},
    )
