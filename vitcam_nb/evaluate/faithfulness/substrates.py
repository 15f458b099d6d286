"""Substrates for faithfulness metrics: what a removed region of the input becomes — the model's mean colour,
the image's mean colour, a Gaussian blur of the image, or noisy linear imputation (Rong et al. 2022, ROAD).

Example:
    >>> import torch
    >>> fixed_substrate(torch.ones(1, 3, 4, 4), "mean", 1.0).sum().item()
    0.0
"""

from __future__ import annotations

import numpy as np
import torch

from vitcam_nb.core.errors import ArgumentError

__all__ = ["SUBSTRATES", "blur", "fixed_substrate", "noisy_linear_imputation"]

SUBSTRATES = ("mean", "image_mean", "blur", "nli")


def blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of a (1, C, H, W) input, radius round(sigma), zero padding.

    Example:
        >>> blur(torch.ones(1, 1, 5, 5), 1.0)[0, 0, 2, 2].item() > 0.99
        True
    """
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float, np.integer, np.floating)) \
            or not (np.isfinite(sigma) and sigma > 0):
        raise ArgumentError(f"blur_sigma: expected a positive finite number of pixels, got {sigma!r}")
    radius = max(1, int(round(sigma)))
    t = torch.arange(-radius, radius + 1, dtype=torch.float32)
    k = torch.exp(-(t**2) / (2.0 * sigma**2))
    k = k / k.sum()
    c = x.shape[1]
    horizontal = k.view(1, 1, 1, -1).repeat(c, 1, 1, 1)
    vertical = k.view(1, 1, -1, 1).repeat(c, 1, 1, 1)
    y = torch.nn.functional.conv2d(x, horizontal, padding=(0, radius), groups=c)
    return torch.nn.functional.conv2d(y, vertical, padding=(radius, 0), groups=c)


_NEIGHBOURS = [(-1, 0, 1 / 6), (1, 0, 1 / 6), (0, -1, 1 / 6), (0, 1, 1 / 6),
               (-1, -1, 1 / 12), (-1, 1, 1 / 12), (1, -1, 1 / 12), (1, 1, 1 / 12)]


def noisy_linear_imputation(
    image: np.ndarray, removed: np.ndarray, noise: float = 0.01, seed: int | np.random.SeedSequence = 0
) -> np.ndarray:
    """Fill the ``removed`` pixels of ``image`` (C, H, W) by noisy linear imputation (ROAD).

    Each removed pixel is set to the weighted mean of its 8 neighbours (1/6 for edge, 1/12 for corner
    neighbours, renormalised at the border), removed neighbours being unknowns too: one sparse linear
    system for all channels. Gaussian noise of std ``noise`` is added to the imputed pixels. When every
    pixel is removed there is nothing to interpolate from: they become 0 (the model's mean colour) plus
    noise.

    Example:
        >>> img = np.ones((3, 5, 5)); hole = np.zeros((5, 5), bool); hole[2, 2] = True
        >>> float(noisy_linear_imputation(img, hole, noise=0.0)[0, 2, 2])
        1.0
    """
    from scipy import sparse
    from scipy.sparse.linalg import splu

    x = np.asarray(image, dtype=np.float64)
    rem = np.asarray(removed, dtype=bool)
    if x.ndim != 3 or rem.shape != x.shape[1:]:
        raise ArgumentError(f"removed: expected a mask of shape {x.shape[1:]}, got {rem.shape}")
    out = x.copy()
    n = int(rem.sum())
    if n == 0:
        return out
    rng = np.random.default_rng(seed)
    if n == rem.size:
        return rng.normal(0.0, noise, size=x.shape) if noise > 0 else np.zeros_like(x)
    h, w = rem.shape
    unknown = np.full(rem.shape, -1, dtype=np.int64)
    ys, xs = np.nonzero(rem)
    unknown[ys, xs] = np.arange(n)
    diag = np.zeros(n)
    rhs = np.zeros((n, x.shape[0]))
    rows, cols, vals = [], [], []
    for dy, dx, wgt in _NEIGHBOURS:
        ny, nx = ys + dy, xs + dx
        inside = (ny >= 0) & (ny < h) & (nx >= 0) & (nx < w)
        i = np.nonzero(inside)[0]
        ny, nx = ny[inside], nx[inside]
        diag[i] += wgt
        j = unknown[ny, nx]
        is_unknown = j >= 0
        rows.append(i[is_unknown])
        cols.append(j[is_unknown])
        vals.append(np.full(int(is_unknown.sum()), -wgt))
        known = ~is_unknown
        np.add.at(rhs, i[known], wgt * x[:, ny[known], nx[known]].T)
    ii = np.concatenate([np.arange(n), *rows])
    jj = np.concatenate([np.arange(n), *cols])
    a = sparse.csc_matrix((np.concatenate([diag, *vals]), (ii, jj)), shape=(n, n))
    filled = splu(a).solve(rhs)
    if noise > 0:
        filled = filled + rng.normal(0.0, noise, size=filled.shape)
    out[:, ys, xs] = filled.T
    return out


def fixed_substrate(x: torch.Tensor, substrate: str, blur_sigma: float) -> torch.Tensor | None:
    """The substrate when it does not depend on what is removed ("mean", "image_mean", "blur"); None for "nli".

    Example:
        >>> fixed_substrate(torch.arange(4.0).view(1, 1, 2, 2), "image_mean", 1.0).flatten().tolist()
        [1.5, 1.5, 1.5, 1.5]
    """
    if substrate == "mean":
        return torch.zeros_like(x)
    if substrate == "image_mean":
        return x.mean(dim=(2, 3), keepdim=True).expand_as(x).clone()
    if substrate == "blur":
        return blur(x, blur_sigma)
    return None  # nli depends on what is removed
