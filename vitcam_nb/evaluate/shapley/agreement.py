"""How well a heatmap ranks the patch groups as their exact Shapley values do: the map pooled (mean) over each
group of :func:`~vitcam_nb.evaluate.shapley.values.shapley_patches`'s grid, then the Spearman rank correlation of
the pooled map with the values (1 = the same order, -1 = the reverse).

Example:
    >>> phi = xr.DataArray([[1.0, 2.0], [3.0, 4.0]], dims=("gy", "gx"))
    >>> shapley_agreement(np.arange(16.0).reshape(4, 4), phi).attrs["value"]
    1.0
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate._common import as_map, nan_because
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


def shapley_agreement(saliency: object, values: object) -> xr.DataArray:
    """Spearman rank correlation between ``saliency`` pooled per group and exact Shapley ``values``.

    Args:
        saliency: a 2-D map: at the model input's size, on the token grid, or already one value per group.
        values: the ``(gy, gx)`` Shapley values (a :func:`~vitcam_nb.evaluate.shapley.values.shapley_patches`
            result, whose ``input_size`` attr lets a token map that does not tile the groups be pooled by pixels).

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
    sal = as_map(saliency, "saliency")
    phi = as_map(values, "values")
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
             **{f"shapley_{k}": v for k, v in attrs_in.items() if k != "metric"}}
    if isinstance(saliency, xr.DataArray) and "recipe_id" in saliency.attrs:
        attrs["saliency_recipe_id"] = str(saliency.attrs["recipe_id"])
    return xr.DataArray(pooled, dims=("gy", "gx"), coords={"gy": np.arange(grid[0]), "gx": np.arange(grid[1])},
                        name="pooled_map", attrs=attrs)
