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

__all__ = ["MetricWarning", "as_map", "as_mask", "as_pair", "grid_map", "nan_because", "order_desc", "recipe_fields",
           "resolve_k", "warn"]


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


def as_map(value: object, name: str) -> np.ndarray:
    """A finite 2-D float64 array from a numpy array, a DataArray or a torch tensor.

    Example:
        >>> as_map([[0, 1], [2, 3]], "a").dtype
        dtype('float64')
    """
    if isinstance(value, xr.DataArray):
        value = value.values
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
    """Two maps of the same shape (agreement metrics compare them cell by cell).

    Example:
        >>> [m.shape for m in as_pair([[1, 2]], [[3, 4]])]
        [(1, 2), (1, 2)]
    """
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
        value = value.values
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
