"""How well a heatmap ranks the patch groups as their exact Shapley values do: the map pooled (mean) over each
group of :func:`~vitcam_nb.evaluate.shapley.values.shapley_patches`'s grid, then the Spearman rank correlation of
the pooled map with the values (1 = the same order, -1 = the reverse).

Example:
    >>> phi = xr.DataArray([[1.0, 2.0], [3.0, 4.0]], dims=("gy", "gx"))
    >>> shapley_agreement(np.arange(16.0).reshape(4, 4), phi).attrs["value"]
    1.0
"""

from __future__ import annotations

import warnings

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import Recipe, is_int
from vitcam_nb.evaluate._common import MAP_DIMS, as_map, in_order, nan_because, warn
from vitcam_nb.evaluate.agreement.metrics import spearman

__all__ = ["pool_groups", "shapley_agreement"]

_POOLING = "mean of the map over each group's cells (a token-grid map first repeated to the model input's pixels " \
           "when its cells do not tile the groups)"


def pool_groups(saliency: np.ndarray, grid: tuple[int, int], input_size: tuple[int, int] | None = None) -> np.ndarray:
    """Mean of ``saliency`` over each of the ``grid``'s equal groups. A map whose cells do not tile the groups
    (a 6x6 token map, 4x4 groups) is first repeated to ``input_size`` (nearest, each cell its patch's pixels),
    which it must tile.

    Example:
        >>> pool_groups(np.arange(16.0).reshape(4, 4), (2, 2)).tolist()
        [[2.5, 4.5], [10.5, 12.5]]
    """
    gy, gx = grid
    h, w = saliency.shape
    if h % gy or w % gx:
        if input_size is None or input_size[0] % h or input_size[1] % w:
            raise ArgumentError(f"saliency: a {h}x{w} map does not tile the {gy}x{gx} groups"
                                + ("" if input_size is None else f" nor the {input_size[0]}x{input_size[1]} input")
                                + "; give the map at the input size (vc.cam(tr, recipe)) or on the token grid")
        saliency = np.repeat(np.repeat(saliency, input_size[0] // h, axis=0), input_size[1] // w, axis=1)
        h, w = saliency.shape
        if h % gy or w % gx:
            raise ArgumentError(f"saliency: the {h}x{w} input does not tile the {gy}x{gx} groups")
    return saliency.reshape(gy, h // gy, gx, w // gx).mean(axis=(1, 3))


def _input_size(values: xr.DataArray) -> tuple[int, int] | None:
    size = values.attrs.get("input_size")
    if isinstance(size, str) and "x" in size:
        try:
            h, w = (int(v) for v in size.split("x"))
        except ValueError:
            return None
        return h, w
    return None


def _by_name(value: object, name: str, pairs: tuple[tuple[str, str], ...]) -> object:
    """A 2-D DataArray put in (rows, columns) order by its dimension names and in ascending coordinate order
    (:func:`~vitcam_nb.evaluate._common.in_order`: a map transposed to (x, y), or with x reversed with its coordinate,
    is the same map); dimensions it does not name as one of ``pairs`` are refused. Other inputs are (rows, columns)."""
    if not isinstance(value, xr.DataArray) or value.ndim != 2:
        return value
    if not any(set(value.dims) == set(pair) for pair in pairs):
        raise ArgumentError(f"{name}: dimensions {tuple(value.dims)} are none of {[p for p in pairs]}; name them (e.g. "
                            f".rename) or pass the values as a NumPy array in (rows, columns) order")
    return in_order(value, name)


def _group_coords(values: object) -> None:
    """Refuse values whose group coordinates are not the groups 0..g-1 (a crop or a relabelling: pooled against the
    wrong groups)."""
    if not isinstance(values, xr.DataArray):
        return
    for dim in values.dims:
        if dim in values.indexes:
            got = np.asarray(values.indexes[dim])
            if not np.array_equal(got, np.arange(values.sizes[dim])):
                raise ArgumentError(f"values: its {dim} coordinates {got.tolist()[:6]} are not the groups "
                                    f"0..{values.sizes[dim] - 1} of shapley_patches' grid")


def _as_computed(saliency: object, sal: np.ndarray, trace: xr.Dataset | xr.DataTree | None) -> str | None:
    """Refuse a map whose attrs say it is ``vc.cam(trace, recipe)`` of this trace when it is not (flipped, rolled or
    edited after vc.cam kept its attrs); return what could not be checked, or None."""
    attrs = saliency.attrs if isinstance(saliency, xr.DataArray) else {}
    if trace is None or not isinstance(attrs.get("recipe"), str) or "trace_id" not in attrs:
        return None
    if str(attrs["trace_id"]) != str(trace.attrs.get("trace_id")):
        return None  # refused by _together
    from vitcam_nb.core.errors import VitcamError
    try:
        recipe = Recipe.from_json(attrs["recipe"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = as_map(kind_for(trace, recipe).cam(trace, recipe), "saliency")
    except VitcamError:
        return "that the map is its recipe's map on this trace (vc.cam refused to recompute it)"
    # the same kernels on the same trace: equal up to float32 rounding of the stored map
    if again.shape != sal.shape or not np.allclose(again, sal, rtol=1e-5, atol=1e-6 * float(np.abs(again).max())):
        raise ArgumentError("saliency: not the map its attrs name (vc.cam(trace, recipe) of this trace differs: "
                            "flipped, reordered or edited after vc.cam); pass the map as vc.cam gave it, or its values "
                            "as a NumPy array")
    return None


def _map_class(recipe: Recipe, trace: xr.Dataset | xr.DataTree | None) -> int | None:
    """The class ``recipe``'s map is of: its index, or its rank resolved on ``trace`` as vc.cam does; None unknown."""
    if is_int(recipe.class_):
        return int(recipe.class_)
    if trace is None or "logits" not in getattr(trace, "variables", {}):
        return None
    logits = np.asarray(trace["logits"].values, np.float64).ravel()
    rank = int(recipe.class_[3:])
    return int(np.argsort(-logits, kind="stable")[rank - 1]) if rank <= logits.size else None


def _together(saliency: object, sal: np.ndarray, values: object, trace: xr.Dataset | xr.DataTree | None) -> list[str]:
    """Refuse a map and values that are of different images, input sizes or classes (what either states); return
    what could not be checked."""
    facts = values.attrs if isinstance(values, xr.DataArray) else {}
    attrs = saliency.attrs if isinstance(saliency, xr.DataArray) else {}
    unchecked = []
    size = _input_size(values) if isinstance(values, xr.DataArray) else None
    if size is not None and isinstance(saliency, xr.DataArray) and saliency.dims == ("y", "x") and sal.shape != size:
        raise ArgumentError(f"saliency: a {sal.shape[0]}x{sal.shape[1]} map at the input size, but the values are of "
                            f"a {size[0]}x{size[1]} input (values.attrs['input_size']); they are not of one input")
    if trace is not None:
        got = (int(trace.attrs.get("img_height", 0)), int(trace.attrs.get("img_width", 0)))
        if size is not None and all(got) and got != size:
            raise ArgumentError(f"values: of a {size[0]}x{size[1]} input, but the trace's is {got[0]}x{got[1]}")
        if "trace_id" in attrs and str(attrs["trace_id"]) != str(trace.attrs.get("trace_id")):
            raise ArgumentError(f"saliency: computed from trace {attrs['trace_id']}, not from this trace "
                                f"({trace.attrs.get('trace_id')})")
    if "input_sha256" not in facts:
        if facts.get("metric") == "shapley_patches":  # values of an older vitcam_nb: no input hash to compare
            unchecked.append("the values carry no input hash (computed before vitcam_nb recorded it), so their image")
    elif trace is not None and "input_sha256" in trace.attrs:
        theirs, ours = str(facts["input_sha256"]), str(trace.attrs["input_sha256"])
        if theirs != ours:
            raise ArgumentError(f"values: computed on another image than the trace's (their input_sha256 "
                                f"{theirs[:12]}... is not {ours[:12]}...)")
    elif "trace_id" in attrs and str(attrs["trace_id"]) != str(facts.get("trace_id", "")):
        unchecked.append("the map's image (pass trace= the map's trace to compare its input hash with the values')")
    elif "trace_id" not in attrs:  # a plain array (or a map without attrs) says nothing of its image
        unchecked.append("the map's image (it carries no trace id or input hash: pass trace= the map's trace to "
                         "compare its input hash with the values')")
    recipe = Recipe.from_json(attrs["recipe"]) if isinstance(attrs.get("recipe"), str) else None
    if recipe is not None and is_int(facts.get("class")) and recipe.layer_fusion != "rollout":
        cls = _map_class(recipe, trace)
        same_trace = "trace_id" in facts and str(facts["trace_id"]) == str(attrs.get("trace_id"))
        if cls is None and same_trace and is_int(facts.get("class_rank")):  # values of the map's own trace
            cls = int(facts["class"]) if facts["class_rank"] == int(recipe.class_[3:]) else -1
        if cls is None and recipe.class_ == "top1" and facts.get("target") == "predicted class of the intact image":
            cls = int(facts["class"])
        if cls is None:
            unchecked.append(f"the map's class ({recipe.class_}: pass trace= to resolve it)")
        elif cls != int(facts["class"]):
            raise ArgumentError(f"values: Shapley values of class {facts['class']}, but the map is of "
                                f"{'class ' + str(cls) if cls >= 0 else 'another class'} (recipe class_ "
                                f"{recipe.class_!r}); compute them with shapley_patches(..., target=that class)")
    return unchecked


def shapley_agreement(saliency: object, values: object, *,
                      trace: xr.Dataset | xr.DataTree | None = None) -> xr.DataArray:
    """Spearman rank correlation between ``saliency`` pooled per group and exact Shapley ``values``.

    Args:
        saliency: a 2-D map: at the model input's size, on the token grid, or already one value per group. A
            DataArray is read by its dimension names (``(y, x)``, ``(patch_row, patch_col)`` or ``(gy, gx)``, in
            either order) and in ascending order of its coordinates; a NumPy array as (rows, columns). With
            ``trace``, a map whose attrs name a recipe of that trace must be that recipe's map (a map flipped or
            reordered after ``vc.cam`` is refused).
        values: the ``(gy, gx)`` Shapley values (a :func:`~vitcam_nb.evaluate.shapley.values.shapley_patches`
            result, whose ``input_size`` attr lets a token map that does not tile the groups be pooled by pixels), read
            by dimension names and ascending ``gy``/``gx`` coordinates, which must be the groups 0..g-1.
        trace: the map's trace (optional): with it the values' input hash and class are compared with the trace's.

    The map and the values must be of one input: a map of ``vc.cam`` (its recipe and trace id in its attrs) and
    values of ``shapley_patches`` (class, input size and input hash in theirs) of another class, input size or image
    are refused (:class:`~vitcam_nb.core.errors.ArgumentError` naming the argument); what cannot be checked from
    what they state (values of an older vitcam_nb, a ``topN`` class without the trace) is named in a
    :class:`~vitcam_nb.evaluate.MetricWarning` and in ``attrs["unchecked"]``.

    Returns:
        DataArray ``(gy, gx)`` of the pooled map; ``attrs["value"]`` the rank correlation (higher = the map ranks the
        groups as their Shapley values do), ``pooling``, ``method``, the grid and the values' provenance
        (``shapley_*`` attrs). NaN with a :class:`~vitcam_nb.evaluate.MetricWarning` when the pooled map or the
        values are constant (no ranking).

    Example:
        >>> phi = xr.DataArray([[0.0, 1.0], [2.0, 3.0]], dims=("gy", "gx"))
        >>> shapley_agreement([[3.0, 2.0], [1.0, 0.0]], phi).attrs["value"]
        -1.0
    """
    if trace is not None and not isinstance(trace, (xr.Dataset, xr.DataTree)):
        raise ArgumentTypeError(f"trace: expected the map's trace (an xarray.Dataset), got {type(trace).__name__}")
    saliency = _by_name(saliency, "saliency", MAP_DIMS)
    values = _by_name(values, "values", (("gy", "gx"),))
    _group_coords(values)
    sal = as_map(saliency, "saliency")
    phi = as_map(values, "values")
    unchecked = _together(saliency, sal, values, trace)
    recomputed = _as_computed(saliency, sal, trace)
    if recomputed:
        unchecked.append(recomputed)
    if unchecked:
        warn(f"shapley_agreement: not checked that the map and the values are of one input: {'; '.join(unchecked)}")
    grid = (int(phi.shape[0]), int(phi.shape[1]))
    attrs_in = values.attrs if isinstance(values, xr.DataArray) else {}
    pooled = pool_groups(sal, grid, _input_size(values) if isinstance(values, xr.DataArray) else None)
    if np.ptp(pooled) == 0.0:
        rho = nan_because("shapley_agreement", "the map pooled per group is constant (no ranking of the groups)")
    elif np.ptp(phi) == 0.0:
        rho = nan_because("shapley_agreement", "the Shapley values are all equal (no ranking of the groups)")
    else:
        rho = spearman(pooled, phi)
    attrs = {"metric": "shapley_agreement", "value": float(rho), "method": "spearman (ties: mean ranks)",
             "pooling": _POOLING, "grid": f"{grid[0]}x{grid[1]}", "map_shape": f"{sal.shape[0]}x{sal.shape[1]}",
             "unchecked": "; ".join(unchecked),
             **{f"shapley_{k}": v for k, v in attrs_in.items() if k != "metric"}}
    if isinstance(saliency, xr.DataArray) and "recipe_id" in saliency.attrs:
        attrs["saliency_recipe_id"] = str(saliency.attrs["recipe_id"])
    return xr.DataArray(pooled, dims=("gy", "gx"), coords={"gy": np.arange(grid[0]), "gx": np.arange(grid[1])},
                        name="pooled_map", attrs=attrs)
