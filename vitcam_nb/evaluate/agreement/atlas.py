"""Agreement atlas: the pairwise agreement of many recipes on one trace (or its mean and spread over
many traces), and a plot that clusters the variants that agree."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.capture.reader import is_store
from vitcam_nb.capture.store_layout import single_trace
from vitcam_nb.compute.many import image_blocks, is_lazy, subset
from vitcam_nb.compute.map_store import is_map_store
from vitcam_nb.compute.spatial import upsample
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.evaluate._common import MetricWarning, grid_map, warn
from vitcam_nb.evaluate.agreement.metrics import AGREEMENT_METRICS, SIGNED_METRICS

__all__ = ["aggregate", "atlas", "atlas_many", "plot_atlas", "recipe_labels"]


def recipe_labels(recipes: Sequence[object]) -> list[str]:
    """Short labels naming only the recipe fields that differ between ``recipes``.

    Example:
        >>> recipe_labels([Recipe(site="F1"), Recipe(site="F4", weighting="layercam")])
        ['F1 gradcam', 'F4 layercam']
    """
    dicts = [r.to_dict() for r in recipes]
    if not dicts:
        return []
    varying = [k for k in dicts[0] if len({json.dumps(d[k]) for d in dicts}) > 1]
    short = {"site", "weighting", "target", "layer_fusion", "heads", "attn_rows"}
    always = {"site", "layer", "weighting", "target"}
    defaults = {f.name: f.default for f in dataclasses.fields(type(recipes[0]))}
    labels = []
    for d in dicts:
        parts = []
        for k in varying:
            v = d[k]
            if k not in always and v == defaults.get(k):
                continue  # e.g. layer_fusion="none" next to a rollout: only the exception is named
            if k == "layer":
                parts.append(f"L{v}" if isinstance(v, int) else f"L{'+'.join(map(str, v))}"
                             if isinstance(v, list) else f"L{v}")
            elif k in short:
                parts.append(str(v))
            else:
                parts.append(f"{k}={v}")
        labels.append(" ".join(parts) or "recipe")
    return labels


def _normalise_recipes(recipes: object) -> tuple[list, list[str]]:
    if isinstance(recipes, Mapping):
        labels, items = [str(k) for k in recipes], list(recipes.values())
    elif isinstance(recipes, Sequence) and not isinstance(recipes, str):
        items, labels = list(recipes), None
    else:
        raise ArgumentError("recipes: expected a list of Recipes or a dict label -> Recipe, "
                            f"got {type(recipes).__name__}")
    if len(items) < 2:
        raise ArgumentError(f"recipes: an atlas needs at least 2 recipes, got {len(items)}")
    for r in items:
        if not isinstance(r, Recipe):
            raise ArgumentError(f"recipes: expected vitcam_nb.Recipe values, got {type(r).__name__}")
    ids = [r.id for r in items]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ArgumentError(f"recipes: the same recipe appears more than once (ids {dup})")
    return items, labels or recipe_labels(items)


def _metric(metric: str | Callable[..., float]) -> tuple[str, Callable[..., float]]:
    if callable(metric):
        return getattr(metric, "__name__", "custom"), metric
    if metric not in AGREEMENT_METRICS:
        raise ArgumentError(f"metric: expected one of {list(AGREEMENT_METRICS)} or a callable, got {metric!r}")
    return metric, AGREEMENT_METRICS[metric]


def _one(tr: xr.Dataset, recipes: list, labels: list[str], name: str, fn: Callable[..., float], signed: bool,
         kwargs: dict) -> xr.DataArray:
    maps, degenerate = [], {}
    for r, label in zip(recipes, labels, strict=True):
        m = grid_map(tr, r.replace(relu="none", normalize="none") if signed else r)
        if m.attrs.get("degenerate"):
            degenerate[label] = f"{r.id}: {m.attrs['degenerate']}"
        maps.append(m)
    finest = max((m.shape for m in maps), key=lambda shape: shape[0] * shape[1])
    if any(m.shape != finest for m in maps):
        # Hierarchical traces: stages have different grids; compare on the finest, as gallery() shows them.
        maps = [m if m.shape == finest else xr.DataArray(upsample(m.values, finest, "bilinear"), dims=m.dims,
                                                         attrs=m.attrs) for m in maps]
    n = len(recipes)
    values = np.full((n, n), np.nan)
    undefined = []
    for i in range(n):
        for j in range(i, n):
            if labels[i] in degenerate or labels[j] in degenerate:
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", MetricWarning)
                v = float(fn(maps[i], maps[j], **kwargs))
            if np.isnan(v):
                undefined.append(f"{labels[i]} / {labels[j]}: " + "; ".join(str(w.message) for w in caught))
            values[i, j] = values[j, i] = v
    if degenerate:
        warn(f"atlas: {len(degenerate)} recipe(s) give a degenerate map (all zeros) on trace "
             f"{tr.attrs.get('trace_id', '?')}; their rows and columns are NaN: "
             + "; ".join(f"{k} ({v})" for k, v in degenerate.items()))
    if undefined:
        warn(f"atlas: {name} is undefined (NaN) for {len(undefined)} pair(s): "
             + " | ".join(undefined[:5]) + (" ..." if len(undefined) > 5 else ""))
    ids = [r.id for r in recipes]
    degenerate_flags = [labels[i] in degenerate for i in range(n)]
    coords = {
        "recipe_a": ids, "label_a": ("recipe_a", labels), "degenerate_a": ("recipe_a", degenerate_flags),
        "recipe_b": ids, "label_b": ("recipe_b", labels), "degenerate_b": ("recipe_b", degenerate_flags),
    }
    attrs = {
        "metric": name,
        "metric_kwargs": json.dumps(kwargs, sort_keys=True, default=str),
        "grid": "token grid (upsample='none')",
        "signed": int(signed),
        "recipes": json.dumps({r.id: r.to_json() for r in recipes}),
        "trace_id": str(tr.attrs.get("trace_id", "")),
        "degenerate": json.dumps(degenerate),
    }
    return xr.DataArray(values, dims=("recipe_a", "recipe_b"), coords=coords, name=name, attrs=attrs)


def atlas(
    tr: xr.Dataset | Sequence[xr.Dataset],
    recipes: Sequence[object] | Mapping[str, object],
    metric: str | Callable[..., float] = "spearman",
    *,
    signed: bool | None = None,
    **metric_kwargs: object,
) -> xr.DataArray | xr.Dataset:
    """Pairwise agreement of ``recipes`` on the token grid.

    Each map is ``vc.cam(tr, recipe, grid=True)``; for sign measures (``signed``, default True for
    ``sign_agreement`` and ``signed_rank_agreement``) the maps are taken with
    ``relu="none", normalize="none"``. A recipe whose map is degenerate (``attrs["degenerate"]``) gets
    NaN rows and columns, and a :class:`MetricWarning` names it; pairs where the metric is undefined
    are NaN with a warning too.

    Args:
        tr: one trace, or a list of traces (one per image).
        recipes: a list of Recipes (labels made from the fields that differ) or a dict label -> Recipe.
        metric: a name from ``AGREEMENT_METRICS`` or a callable ``f(a, b, **kw) -> float``.
        signed: use maps before the ReLU and normalisation.
        metric_kwargs: passed to the metric (e.g. ``k=0.2``).

    Returns:
        one trace: DataArray ``(recipe_a, recipe_b)`` with recipe ids as coordinates and
        ``label_a``/``label_b`` labels. Many traces: Dataset with ``mean`` and ``std`` (NaN-aware,
        population std) and ``count`` (images where the pair was defined), same dims.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> img = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
        >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), img)
        >>> da = atlas(tr, [vc.Recipe(site="F1", layer=0), vc.Recipe(site="F4", layer=0)])
        >>> da.dims, da["label_a"].values.tolist()
        (('recipe_a', 'recipe_b'), ['F1', 'F4'])
    """
    if is_store(tr):
        return atlas_many(tr, recipes, metric, signed=signed, **metric_kwargs)
    items, labels = _normalise_recipes(recipes)
    name, fn = _metric(metric)
    signed = name in SIGNED_METRICS if signed is None else bool(signed)
    if isinstance(tr, (xr.Dataset, xr.DataTree)):
        return _one(tr, items, labels, name, fn, signed, metric_kwargs)
    if not isinstance(tr, Sequence) or isinstance(tr, str) or len(tr) == 0:
        raise ArgumentError(f"tr: expected a trace or a non-empty list of traces, got {type(tr).__name__}")
    for i, t in enumerate(tr):
        if not isinstance(t, xr.Dataset):
            raise ArgumentError(f"tr: item {i} is a {type(t).__name__}, not a trace")
    per = [_one(t, items, labels, name, fn, signed, metric_kwargs) for t in tr]
    return aggregate(per)


def aggregate(per: Sequence[xr.DataArray]) -> xr.Dataset:
    """Mean, std and count over images of per-image atlases (NaN-aware; population std).

    Example:
        >>> ds = aggregate([atlas(t, recipes) for t in traces])  # doctest: +SKIP
    """
    stack = np.stack([p.values for p in per])
    count = np.sum(~np.isnan(stack), axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN pairs: NaN mean, counted as 0
        mean = np.nanmean(stack, axis=0)
        std = np.nanstd(stack, axis=0)
    coords = {k: v for k, v in per[0].coords.items() if not k.startswith("degenerate")}
    degenerate_count = np.sum([p["degenerate_a"].values for p in per], axis=0)
    coords["degenerate_a"] = ("recipe_a", degenerate_count)
    coords["degenerate_b"] = ("recipe_b", degenerate_count)
    dims = ("recipe_a", "recipe_b")
    attrs = {**per[0].attrs, "n_images": len(per),
             "trace_ids": json.dumps([p.attrs["trace_id"] for p in per]),
             "std": "population std (ddof=0) over images where the pair is defined"}
    attrs.pop("trace_id", None)
    attrs["degenerate"] = json.dumps([json.loads(p.attrs["degenerate"]) for p in per])
    return xr.Dataset({"mean": (dims, mean), "std": (dims, std), "count": (dims, count)}, coords=coords,
                      attrs=attrs)


def _atlas_image(one: xr.Dataset, recipes: Any, metric: Any, signed: bool | None, metric_kwargs: dict) -> xr.DataArray:
    one = one.load()
    # An image of a map store (vc.map_many) is read as it is: vc.cam reads its maps as it computes a trace's.
    return atlas(one if is_map_store(one) else single_trace(one), recipes, metric, signed=signed, **metric_kwargs)


def atlas_many(
    ds: xr.Dataset,
    recipes: Sequence[Recipe] | Mapping[str, Recipe],
    metric: str | Callable[..., float] = "spearman",
    *,
    signed: bool | None = None,
    scheduler: str | None = None,
    **metric_kwargs: Any,
) -> xr.Dataset:
    """Agreement atlas over every image of a many-image Dataset, computed one task per image.

    Each task reads one image's chunks and runs :func:`vitcam_nb.evaluate.agreement.atlas` on it; the per-image
    matrices are combined into ``mean``, ``std`` and ``count`` exactly as the atlas of a list of traces.
    Runs on the active dask.distributed Client if there is one (else dask's default scheduler, or
    ``scheduler``).

    Example:
        >>> import timm, numpy as np, tempfile, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224")
        >>> p = vc.trace_many(m, [np.zeros((224, 224, 3), np.uint8)] * 2, tempfile.mkdtemp() + "/t.zarr",
        ...                   targets="top1", sites=["F1", "F4"], progress=False)
        >>> at = atlas_many(vc.open_traces(p), [vc.Recipe(site="F1", layer=0), vc.Recipe(site="F4", layer=0)])
        >>> int(at.attrs["n_images"]), at["mean"].dims
        (2, ('recipe_a', 'recipe_b'))
    """
    import dask

    if not is_store(ds):
        raise ArgumentTypeError("ds: expected a many-image Dataset from vc.open_traces (with an 'image' dimension)")
    items, _ = _normalise_recipes(recipes)
    _metric(metric)
    n = ds.sizes["image"]
    if n == 0:
        raise ArgumentError("ds: the store holds no finished images")
    sub = subset(ds, items)
    if is_lazy(sub):
        blocks = image_blocks(sub)
        tasks = [dask.delayed(_atlas_image)(blocks.isel(image=i), recipes, metric, signed, metric_kwargs)
                 for i in range(n)]
        per = dask.compute(*tasks, scheduler=scheduler)
    else:
        per = [_atlas_image(sub.isel(image=i), recipes, metric, signed, metric_kwargs) for i in range(n)]
    return aggregate(per)


def _cluster_order(values: np.ndarray) -> tuple[list[int], object]:
    """Leaf order of average-linkage clustering of 1 - agreement. Variants with no defined agreement
    (degenerate maps) go last, unclustered; other undefined pairs count as distance 1 (no agreement)."""
    from scipy.cluster import hierarchy
    from scipy.spatial.distance import squareform

    n = values.shape[0]
    off = values.copy()
    np.fill_diagonal(off, np.nan)
    bad = [i for i in range(n) if np.isnan(off[i]).all()]
    good = [i for i in range(n) if i not in bad]
    if len(good) < 3:
        return good + bad, None
    sub = np.nan_to_num(off[np.ix_(good, good)], nan=0.0)
    dist = np.clip(1.0 - (sub + sub.T) / 2.0, 0.0, None)
    np.fill_diagonal(dist, 0.0)
    link = hierarchy.linkage(squareform(dist, checks=False), method="average", optimal_ordering=True)
    leaves = hierarchy.leaves_list(link)
    return [good[i] for i in leaves] + bad, link


def _blank_reasons(da: xr.DataArray, values: np.ndarray, labels: list[str]) -> dict[int, str]:
    """Why a variant's row holds no value: its map is all zeros (with the reason the atlas recorded), or every
    pair with it is undefined."""
    recorded = json.loads(da.attrs["degenerate"]) if isinstance(da.attrs.get("degenerate"), str) else {}
    recorded = recorded if isinstance(recorded, dict) else {}  # a multi-image atlas records one dict per image
    flags = np.asarray(da["degenerate_a"].values) if "degenerate_a" in da.coords else np.zeros(len(labels))
    out = {}
    for i, label in enumerate(labels):
        if not np.isnan(values[i]).all():
            continue  # a variant degenerate on some images only still has a mean over the others
        if label in recorded or flags[i]:
            reason = str(recorded.get(label, "")).split(": ", 1)[-1].split(" (")[0]
            out[i] = "map is all zeros" + (f": {reason}" if reason else "") + " → no agreement defined"
        else:
            out[i] = "agreement undefined with every other variant"
    return out


def plot_atlas(
    da: xr.DataArray | xr.Dataset,
    *,
    cluster: bool = True,
    annotate: bool | None = None,
    cmap: str = "RdBu_r",
    figsize: tuple[float, float] | None = None,
):
    """Heatmap of an atlas, variants ordered by hierarchical clustering of 1 - agreement.

    Average linkage with optimal leaf ordering (scipy), the dendrogram drawn above the matrix.
    Degenerate or undefined variants (NaN) are placed last; their rows say why they hold no value. A Dataset
    from a multi-image atlas is drawn from its ``mean``, annotated with mean ± std.

    Returns:
        the matplotlib Figure.

    Example:
        >>> import numpy as np, xarray as xr
        >>> labels = {"label_a": ("recipe_a", list("abc")), "label_b": ("recipe_b", list("abc"))}
        >>> da = xr.DataArray(np.eye(3), dims=("recipe_a", "recipe_b"), coords=labels)
        >>> fig = plot_atlas(da)
    """
    import matplotlib.pyplot as plt
    from scipy.cluster import hierarchy

    std = None
    if isinstance(da, xr.Dataset):
        if "mean" not in da:
            raise ArgumentError("da: expected an atlas DataArray or a Dataset with 'mean' (and 'std')")
        std = da["std"].values if "std" in da else None
        da = da["mean"].assign_attrs(da.attrs)
    if not isinstance(da, xr.DataArray) or da.ndim != 2 or da.shape[0] != da.shape[1]:
        raise ArgumentError("da: expected a square (recipe_a, recipe_b) atlas, "
                            f"got {getattr(da, 'dims', type(da))}")
    values = np.asarray(da.values, dtype=float)
    n = values.shape[0]
    labels = [str(v) for v in (da["label_a"].values if "label_a" in da.coords else range(n))]
    order, link = _cluster_order(values) if cluster else (list(range(n)), None)
    mat = values[np.ix_(order, order)]
    blank = _blank_reasons(da, values, labels)
    annotate = n <= 12 if annotate is None else annotate
    size = figsize or (2.6 + 0.42 * n, 1.6 + 0.42 * n)
    fig = plt.figure(figsize=size, constrained_layout=True)
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 6], width_ratios=[30, 1])
    ax = fig.add_subplot(grid[1, 0])
    cax = fig.add_subplot(grid[1, 1])
    top = fig.add_subplot(grid[0, 0])
    metric = da.attrs.get("metric", da.name or "agreement")
    lo = -1.0 if np.nanmin(values, initial=0.0) < 0 else 0.0
    cm = plt.get_cmap(cmap).with_extremes(bad="0.85")
    im = ax.imshow(np.ma.masked_invalid(mat), cmap=cm, vmin=lo, vmax=1.0, aspect="auto")
    # A blank row says why in its own cells; a blank column has no room for it, so its label does.
    ax.set_xticks(range(n), [labels[i] + (" (all zeros)" if i in blank else "") for i in order], rotation=60,
                  ha="right", fontsize=8)
    ax.set_yticks(range(n), [labels[i] for i in order], fontsize=8)
    for row, i in enumerate(order):
        if i in blank:  # say why the row is empty instead of leaving it grey
            ax.text((n - 1) / 2, row, blank[i], ha="center", va="center", fontsize=7, color="0.15", clip_on=True)
    if annotate:
        for i in range(n):
            for j in range(n):
                v = mat[i, j]
                if order[i] in blank or order[j] in blank:
                    continue
                text = "n/a" if np.isnan(v) else f"{v:.2f}"
                if std is not None and not np.isnan(v):
                    text += f"\n±{std[order[i], order[j]]:.2f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=6,
                        color="white" if not np.isnan(v) and abs(v) > 0.6 else "black")
    fig.colorbar(im, cax=cax, label=f"{metric} (1 = same ranking)" if metric in ("spearman", "kendall") else metric)
    top.axis("off")
    if link is not None:
        hierarchy.dendrogram(link, ax=top, no_labels=True, color_threshold=0, above_threshold_color="0.3")
        top.set_xlim(0, 10 * n)  # dendrogram leaf i sits at x = 10 i + 5, over heatmap cell i
        top.axis("off")
    title = f"How far {n} variants agree: {metric} between their token-grid maps"
    if "n_images" in da.attrs:
        title += f", mean over {da.attrs['n_images']} images"
    if blank:
        title += (f"\n{len(blank)} variant(s) give an all-zero map, so no agreement is defined for them "
                  "(last rows and columns)")
    top.set_title(title + ("\nclustered: variants that agree sit together" if link is not None else ""),
                  fontsize=10)
    return fig
