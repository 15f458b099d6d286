"""What every metric shares to receive its inputs: maps and masks checked (a ``ValueError`` naming the argument),
the token-grid map of a recipe, and the :class:`MetricWarning` a metric answers NaN with."""

from __future__ import annotations

import json
import warnings

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentError, DegenerateMapWarning, user_stacklevel
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe import Recipe

__all__ = ["MAP_DIMS", "MetricWarning", "aligned", "as_map", "as_mask", "as_pair", "grid_map", "in_order",
           "nan_because", "order_desc", "recipe_fields", "resolve_k", "warn"]

MAP_DIMS: tuple[tuple[str, str], ...] = (("y", "x"), ("patch_row", "patch_col"), ("gy", "gx"))
"""The (rows, columns) dimension pairs the kit names its 2-D maps and values by; a DataArray with one of them is read
in that order whatever order its dimensions are in."""


class MetricWarning(UserWarning):
    """A metric returned NaN (or a number that needs a caveat) and says why.

    Example:
        >>> import warnings
        >>> warnings.simplefilter("ignore", MetricWarning)
    """


def warn(message: str) -> None:
    """Emit a :class:`MetricWarning` pointing at the user's call, not at this package.

    Example:
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn("ssim: maps are tiny")
        >>> caught[0].category.__name__
        'MetricWarning'
    """
    warnings.warn(message, MetricWarning, stacklevel=user_stacklevel())


def nan_because(metric: str, reason: str) -> float:
    """Warn that ``metric`` is undefined for this input and return NaN.

    Example:
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     nan_because("spearman", "a map is constant")
        nan
    """
    warnings.warn(f"{metric}: returning NaN because {reason}", MetricWarning, stacklevel=user_stacklevel())
    return float("nan")


def _positional(value: xr.DataArray) -> bool:
    """xarray's default names (dim_0, dim_1): a DataArray made from an array without naming its dimensions."""
    return all(str(d).startswith("dim_") for d in value.dims)


def in_order(value: object, name: str, order: tuple | None = None) -> object:
    """A 2-D DataArray in (rows, columns) order by its dimension names (one of :data:`MAP_DIMS`, else ``order``) and
    in ascending order of its coordinates: a map transposed to (x, y), or with x reversed together with its x
    coordinate, is the same map. Duplicate or unsortable coordinates are refused by ``name``. Anything else (a NumPy
    array, a tensor, a DataArray of other rank) is returned as it is: its positions are its meaning.

    Example:
        >>> m = xr.DataArray([[1, 2], [3, 4]], dims=("y", "x"), coords={"x": [0, 1]})
        >>> in_order(m.transpose("x", "y").isel(x=[1, 0]), "a").values.tolist()
        [[1, 2], [3, 4]]
    """
    if not isinstance(value, xr.DataArray) or value.ndim != 2:
        return value
    pair = next((p for p in MAP_DIMS if set(value.dims) == set(p)), None)
    if pair is None and order is not None and set(value.dims) == set(order):
        pair = tuple(order)
    if pair is not None and tuple(value.dims) != pair:
        value = value.transpose(*pair)
    for dim in value.dims:
        if dim not in value.indexes:
            continue
        index = value.indexes[dim]
        if not index.is_unique:
            raise ArgumentError(f"{name}: its {dim} coordinate repeats a value; a map's cells need distinct "
                                "coordinates (or none: pass .values for positional meaning)")
        if not index.is_monotonic_increasing:
            try:
                value = value.sortby(dim)
            except (TypeError, ValueError) as e:
                raise ArgumentError(f"{name}: its {dim} coordinate cannot be sorted ({e})") from e
    return value


def _short(values: np.ndarray) -> str:
    text = np.array2string(np.asarray(values), threshold=6, edgeitems=2)
    return text if len(text) < 60 else text[:57] + "..."


def aligned(*named: tuple[str, object]) -> list[object]:
    """The ``(name, value)`` inputs of one verdict, each DataArray put :func:`in_order` (dimensions not of
    :data:`MAP_DIMS` in the first DataArray's order) and checked against the first: other dimension names or other
    coordinate values on a shared dimension are refused by name. NumPy arrays keep their positional meaning
    (rows, columns), as do DataArrays with xarray's default dimension names.

    Example:
        >>> a = xr.DataArray([[0.0, 1.0]], dims=("y", "x"))
        >>> aligned(("a", a), ("b", a.transpose("x", "y")))[1].dims
        ('y', 'x')
    """
    out: list[object] = []
    ref: tuple[str, xr.DataArray] | None = None
    for name, value in named:
        if isinstance(value, xr.DataArray) and value.ndim == 2 and not _positional(value):
            value = in_order(value, name, None if ref is None else ref[1].dims)
            if ref is None:
                ref = (name, value)
            else:
                _same_frame(ref, name, value)
        out.append(value)
    return out


def _same_frame(ref: tuple[str, xr.DataArray], name: str, value: xr.DataArray) -> None:
    first, other = ref
    if tuple(value.dims) != tuple(other.dims):
        raise ArgumentError(f"{name}: dimensions {tuple(value.dims)} are not {first}'s {tuple(other.dims)}; name them "
                            "alike (.rename) or pass NumPy arrays in the same (rows, columns) order")
    for dim in value.dims:
        if dim in value.indexes and dim in other.indexes:
            mine, theirs = np.asarray(value.indexes[dim]), np.asarray(other.indexes[dim])
            if mine.shape != theirs.shape or not np.array_equal(mine, theirs):
                raise ArgumentError(f"{name}: its {dim} coordinates {_short(mine)} are not {first}'s "
                                    f"{_short(theirs)}; the two are not of the same cells")


def as_map(value: object, name: str) -> np.ndarray:
    """A finite 2-D float64 array from a numpy array, a DataArray or a torch tensor.

    Example:
        >>> as_map([[0, 1], [2, 3]], "a").dtype
        dtype('float64')
    """
    if isinstance(value, xr.DataArray):
        value = in_order(value, name).values
    elif hasattr(value, "detach") and hasattr(value, "cpu"):  # torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"{name}: expected a 2-D numeric map, got {type(value).__name__}") from e
    if arr.ndim != 2:
        raise ArgumentError(f"{name}: expected a 2-D map (y, x), got shape {arr.shape}")
    if arr.size == 0:
        raise ArgumentError(f"{name}: empty map of shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ArgumentError(f"{name}: contains NaN or inf; maps must be finite")
    return arr


def as_pair(a: object, b: object) -> tuple[np.ndarray, np.ndarray]:
    """Two maps of the same shape (agreement metrics compare them cell by cell), DataArrays :func:`aligned` by
    dimension names and coordinates.

    Example:
        >>> [m.shape for m in as_pair([[1, 2]], [[3, 4]])]
        [(1, 2), (1, 2)]
    """
    a, b = aligned(("a", a), ("b", b))
    x, y = as_map(a, "a"), as_map(b, "b")
    if x.shape != y.shape:
        raise ArgumentError(
            f"b: maps of different shapes, a {x.shape} and b {y.shape}; compare maps on the same grid "
            "(vc.cam(tr, recipe, grid=True) gives every recipe of one trace the same token grid)"
        )
    return x, y


def as_mask(value: object, shape: tuple[int, int], name: str = "mask") -> np.ndarray:
    """A non-empty boolean mask of exactly ``shape``.

    Example:
        >>> as_mask([[0, 1]], (1, 2)).tolist()
        [[False, True]]
    """
    if isinstance(value, xr.DataArray):
        value = in_order(value, name).values
    elif hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim != 2:
        raise ArgumentError(f"{name}: expected a 2-D mask (y, x), got shape {arr.shape}")
    if arr.dtype != bool:
        if not np.isin(arr, (0, 1)).all():
            raise ArgumentError(f"{name}: expected a boolean mask (or 0/1 values), got dtype {arr.dtype} "
                                "with other values")
        arr = arr.astype(bool)
    if arr.shape != tuple(shape):
        raise ArgumentError(
            f"{name}: shape {arr.shape} does not match the map's shape {tuple(shape)}; localisation is "
            "measured at the map's resolution (use the upsampled map, vc.cam(tr, recipe), against a "
            "pixel mask)"
        )
    if not arr.any():
        raise ArgumentError(f"{name}: empty mask (no True pixel); localisation against it is undefined")
    return arr


def resolve_k(k: int | float, n: int, name: str = "k") -> int:
    """Number of cells from ``k``: an int is a count (1..n), a float in (0, 1] a fraction of ``n``.

    Example:
        >>> resolve_k(0.25, 16), resolve_k(3, 16)
        (4, 3)
    """
    if isinstance(k, bool) or not isinstance(k, (int, float, np.integer, np.floating)):
        raise ArgumentError(f"{name}: expected an int count or a float fraction in (0, 1], got {k!r}")
    if isinstance(k, (int, np.integer)):
        if not 1 <= k <= n:
            raise ArgumentError(f"{name}: a count must be in 1..{n} (the number of cells), got {k}")
        return int(k)
    if not 0.0 < k <= 1.0:
        raise ArgumentError(f"{name}: a fraction must be in (0, 1], got {k}")
    return max(1, min(n, int(round(k * n))))


def order_desc(values: np.ndarray) -> np.ndarray:
    """Flat indices from the largest value to the smallest; ties keep row-major cell order.

    Example:
        >>> order_desc(np.array([[1, 3], [3, 0]])).tolist()
        [1, 2, 0, 3]
    """
    return np.argsort(-values.ravel(), kind="stable")


def recipe_fields(m: object) -> dict:
    """The recipe a map from ``vc.cam`` carries in its attrs ({} for plain arrays).

    Example:
        >>> recipe_fields(xr.DataArray([0], attrs={"recipe": '{"site": "F4"}'})), recipe_fields(np.zeros(2))
        ({'site': 'F4'}, {})
    """
    if isinstance(m, xr.DataArray) and isinstance(m.attrs.get("recipe"), str):
        try:
            out = json.loads(m.attrs["recipe"])
        except ValueError:
            return {}
        return out if isinstance(out, dict) else {}
    return {}


def grid_map(trace: object, recipe: Recipe) -> xr.DataArray:
    """``vc.cam(trace, recipe, grid=True)`` with no DegenerateMapWarning (the map's attrs say it instead): the
    token-grid map metrics compare.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> tr = vc.trace(timm.create_model("vit_tiny_patch16_224"), np.zeros((224, 224, 3), np.uint8), targets="top1")
        >>> grid_map(tr, vc.Recipe()).shape
        (14, 14)
    """
    recipe = recipe.replace(upsample="none") if recipe.upsample != "none" else recipe
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateMapWarning)
        return kind_for(trace, recipe).cam(trace, recipe)
