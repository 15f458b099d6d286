"""Spatial reconstruction in torch, beside :mod:`vitcam_nb.compute.spatial`: token maps placed on the patch grid,
normalised, and upsampled with the same interpolation matrices (torch's rules, half-pixel centres), on the
tensors' device. :func:`read_map` applies a recipe's upsampling and normalisation to a map stored on the token
grid exactly as ``vc.cam`` applies them, chosen by the array type: NumPy arrays through the NumPy functions
``vc.cam`` itself runs (bitwise its values), torch tensors through these (within float32 rounding).

Example:
    >>> import torch
    >>> upsample(torch.eye(2), (4, 4), "nearest")[0]
    tensor([1., 1., 0., 0.])
"""

from __future__ import annotations

import numpy as np
import torch

from vitcam_nb.compute import spatial
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, RecipeError
from vitcam_nb.core.recipe import NORMALIZES, UPSAMPLES, Recipe

__all__ = ["grid_reads_exactly", "normalise", "read_map", "to_grid", "upsample"]


def normalise(x: torch.Tensor, how: str) -> torch.Tensor:
    """Normalise the trailing (h, w) maps as ``spatial.normalise``: "minmax" to [0, 1], "max" divided by the
    maximum, "none" as is; a constant map becomes zeros.

    Example:
        >>> normalise(torch.tensor([[1.0, 3.0]]), "minmax")
        tensor([[0., 1.]])
    """
    if how not in NORMALIZES:
        raise RecipeError(f"normalize: {how!r} is not one of {list(NORMALIZES)}")
    if how == "none":
        return x
    x = x.to(torch.float32)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    hi = x.amax(dim=(-2, -1), keepdim=True)
    if how == "max":
        return torch.where(hi > 0, x / torch.where(hi > 0, hi, 1), zero)
    lo = x.amin(dim=(-2, -1), keepdim=True)
    span = hi - lo
    return torch.where(span > 0, (x - lo) / torch.where(span > 0, span, 1), zero)


def upsample(grid: torch.Tensor, size: tuple[int, int], mode: str, pad: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Upsample (..., h, w) maps to ``size`` by the interpolation matrices ``spatial.upsample`` uses (bilinear,
    bicubic, nearest; "none" returns the grid); ``pad`` as there (a margin upsampled with the image, then
    cropped).

    Example:
        >>> upsample(torch.tensor([[0.0, 1.0]]), (1, 4), "bilinear")
        tensor([[0.0000, 0.2500, 0.7500, 1.0000]])
    """
    if mode not in UPSAMPLES:
        raise RecipeError(f"upsample: {mode!r} is not one of {list(UPSAMPLES)}")
    if mode == "none":
        return grid
    wy = spatial.interp_matrix(grid.shape[-2], size[0] + pad[0], mode)[:size[0]]
    wx_t = spatial.interp_matrix(grid.shape[-1], size[1] + pad[1], mode, transpose=True)[:, :size[1]]
    on = {"device": grid.device, "dtype": torch.float32}
    return torch.as_tensor(wy, **on) @ grid.to(torch.float32) @ torch.as_tensor(np.ascontiguousarray(wx_t), **on)


def to_grid(raw: torch.Tensor, flat: np.ndarray | torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(..., patch token) values placed on the (..., grid_h, grid_w) raster grid; ``flat`` is each patch token's
    raster position (``row * grid_w + col``, a view's ``flat``).

    Example:
        >>> to_grid(torch.tensor([1.0, 2.0]), np.array([1, 0]), (1, 2))
        tensor([[2., 1.]])
    """
    flat = np.asarray(flat.cpu() if isinstance(flat, torch.Tensor) else flat)
    if np.sort(flat).tolist() != list(range(grid[0] * grid[1])):
        raise ArgumentError(f"flat: expected each of the {grid[0]}x{grid[1]} raster positions once (a view's patch "
                            f"tokens cover the grid), got {flat.size} positions")
    # Every cell has one token: a gather, or no copy at all in raster order, instead of a scatter into zeros.
    order = np.argsort(flat)
    raw = raw.to(torch.float32)
    if not np.array_equal(order, np.arange(order.size)):
        raw = raw[..., torch.as_tensor(order, device=raw.device)]
    return raw.reshape(*raw.shape[:-1], *grid)


def grid_reads_exactly(recipe: Recipe) -> bool:
    """Whether ``recipe``'s map can be stored on the token grid and read back (:func:`read_map`) as ``vc.cam``
    computes it at full size. ``vc.cam`` upsamples each layer's map before fusing them: for one layer, a rollout,
    or a linear fusion (mean, sum) the order does not matter; the maximum over several upsampled layers is not the
    upsampled maximum, so such a recipe is stored at full size or computed by ``vc.cam``.

    Example:
        >>> grid_reads_exactly(Recipe(layer=(0, 1), layer_fusion="max")), grid_reads_exactly(Recipe())
        (False, True)
    """
    several = isinstance(recipe.layer, tuple) and len(recipe.layer) > 1 or recipe.layer == "all"
    return not (several and recipe.layer_fusion == "max" and recipe.upsample != "none")


def read_map(grid: np.ndarray | torch.Tensor, recipe: Recipe, size: tuple[int, int], pad: tuple[int, int] = (0, 0)
             ) -> np.ndarray | torch.Tensor:
    """A map stored on the token grid (..., gh, gw), as ``vc.cam`` returns it: upsampled to ``size`` (the image's
    (height, width)) by the recipe's ``upsample`` and normalised by its ``normalize``. A NumPy grid goes through
    the NumPy functions ``vc.cam`` runs (its values bit for bit); a torch tensor stays on its device.

    Example:
        >>> g = np.array([[0.0, 1.0], [1.0, 0.0]], np.float32)
        >>> read_map(g, Recipe(upsample="nearest"), (4, 4))[0]
        array([0., 0., 1., 1.], dtype=float32)
    """
    if isinstance(grid, torch.Tensor):
        return normalise(upsample(grid, size, recipe.upsample, pad), recipe.normalize)
    if not isinstance(grid, np.ndarray):
        raise ArgumentTypeError(f"grid: expected a numpy array or a torch tensor, got {type(grid).__name__}")
    return spatial.normalise(spatial.upsample(grid, size, recipe.upsample, pad), recipe.normalize)
