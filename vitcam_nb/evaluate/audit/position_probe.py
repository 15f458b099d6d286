"""How well each token site still says where its token is: a cross-validated ridge probe from a patch token's
stored activations to its own grid position (``patch_row``, ``patch_col``).

Every map is a raster reshape: token t is drawn at (patch_row[t], patch_col[t]). That assumes the token still
stands for its own patch. Where a linear probe recovers the positions from the features (R^2 near 1), the
features at least still carry them; where it cannot (R^2 near 0 or below), the reshape is an assumption the
features no longer support. The checklist quotes the result when the trace holds it as ``position_r2``.

The probe, for each (site, layer) of the trace's token sites (``act``; F2 and the other attention sites hold
attention matrices, not token features, and are not probed):

* features X: the activations of the patch tokens (prefix tokens have no grid position), tokens x channels;
* targets Y: each token's (patch_row, patch_col); a coordinate constant over the grid (one row) is left out;
* K-fold cross-validation over tokens (shuffled with ``seed``); in each fold the features are standardised with
  the training tokens' mean and standard deviation (a constant channel stays 0) and ridge regression with an
  unpenalised intercept is fitted in closed form (NumPy SVD, no scikit-learn);
* ``alpha``: a fixed penalty, or by default chosen per fold from :data:`RELATIVE_ALPHAS` times the mean
  squared singular value of the training features (a scale-free grid), by the exact leave-one-out error of the
  training tokens (no test token is seen);
* R^2 = 1 - SS_res / SS_tot of the out-of-fold predictions of all tokens, per coordinate, averaged over row
  and column. It can be negative: a probe worse than predicting the mean position.

A generative VLM's answer trace (``vc.targets.answer``) adds its LM-side token sites ``projector`` and
``lm_resid``: their image tokens are the tokens and each one's cell in the trace's image-token layout
(``image_token_row``, ``image_token_col``, the family's own layout code, not an assumed raster) is its position; their
``layer`` is the LM decoder layer (the projector has one, 0). So the raster assumption of the LM-side maps is
measured, site by site, as the tower's is. On a layout of several tiles (LLaVA-NeXT/OneVision, Idefics3/SmolVLM) the
position is the token's cell centre on the image through its tile's box (``frame="image"``, where the map draws it)
or within its tile (``frame="tile"``): :mod:`vitcam_nb.evaluate.audit.probe_cells`.

A trace whose tower ran on several crops (a ``crop`` dim) is probed per crop at its tower sites: crop k's patch
tokens for their grid in crop k, exactly the probe of ``trace.isel(crop=k)``; the answer gets a leading ``crop``
dim (coords ``crop_tile``, ``crop_group``) where the LM-side sites, which have no crop, repeat one value. Stored in
the trace, ``trace.isel(crop=k)`` holds crop k's ``(site, layer)`` values, which a checklist of a map on that crop's
trace quotes.

The probe is linear and sees as many tokens as the grid has: features may still carry the positions in a way no
linear map of row and column reads (a learned position embedding need not be linear in them), and a wide site on
a small grid leaves few tokens per channel. A low R^2 therefore says the positions are not linearly recoverable
here, not that they are absent; a high one says they are, which raster order needs but does not prove.

Example:
    >>> import numpy as np, xarray as xr
    >>> rows, cols = np.divmod(np.arange(16), 4)
    >>> act = np.stack([rows, cols, np.ones(16)], -1)[None, None].astype(float)  # features = the position
    >>> tr = xr.Dataset({"act": (("layer", "site", "token", "channel"), act)},
    ...                 coords={"layer": [0], "site": ["F1"], "token_kind": ("token", ["patch"] * 16),
    ...                         "patch_row": ("token", rows), "patch_col": ("token", cols)})
    >>> float(position_probe(tr).sel(site="F1", layer=0)) > 0.99
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError
from vitcam_nb.core.schema import POSITION_R2
from vitcam_nb.evaluate.audit.probe_cells import lm_positions

__all__ = ["LM_TOKEN_SITES", "RELATIVE_ALPHAS", "position_probe"]

#: A generative VLM's LM-side token sites (image tokens x channels) the probe reads at the layout's cells.
LM_TOKEN_SITES = ("projector", "lm_resid")

#: The penalty grid, relative to the mean squared singular value of a fold's standardised training features.
RELATIVE_ALPHAS = tuple(10.0 ** np.arange(-4, 3))


def _standardise(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both sets scaled by the training tokens' mean and standard deviation (a constant channel becomes 0)."""
    mean, std = train.mean(0), train.std(0)
    std = np.where(std > 0, std, 1.0)
    return (train - mean) / std, (test - mean) / std


def _ridge_fit(x: np.ndarray, y: np.ndarray, alpha: float | None) -> tuple[np.ndarray, np.ndarray, float]:
    """(weights, intercept, alpha) of ridge regression min |y - x w - b|^2 + alpha |w|^2, b unpenalised, in closed
    form from the centred features' SVD U S V^T (exact for any shape): w = V diag(s / (s^2 + alpha)) U^T (y - mean y).
    ``alpha`` None picks it from the relative grid by the exact leave-one-out error (one SVD serves both)."""
    xm, ym = x.mean(0), y.mean(0)
    u, s, vt = np.linalg.svd(x - xm, full_matrices=False)
    uty = u.T @ (y - ym)
    if alpha is None:
        alpha = _loo_alpha(u, s, uty, y - ym)
    w = vt.T @ ((s / (s**2 + alpha))[:, None] * uty)
    return w, ym - xm @ w, alpha


def _loo_alpha(u: np.ndarray, s: np.ndarray, uty: np.ndarray, yc: np.ndarray) -> float:
    """The alpha of the relative grid with the smallest exact leave-one-out squared error: the residual of token i
    left out is r_i / (1 - H_ii), H = 11^T/n + U diag(s^2 / (s^2 + alpha)) U^T the hat matrix (intercept included).
    """
    scale = float(np.mean(s**2)) or 1.0
    best, best_err = RELATIVE_ALPHAS[0] * scale, np.inf
    for rel in RELATIVE_ALPHAS:
        shrink = s**2 / (s**2 + rel * scale)
        leverage = 1.0 / len(yc) + (u**2) @ shrink
        residual = (yc - u @ (shrink[:, None] * uty)) / np.maximum(1.0 - leverage, 1e-12)[:, None]
        err = float(np.sum(residual**2))
        if err < best_err:
            best, best_err = rel * scale, err
    return best


def _probe_r2(x: np.ndarray, y: np.ndarray, folds: list[np.ndarray], alpha: float | None) -> float:
    """Out-of-fold R^2 of the ridge probe, averaged over the target columns."""
    pred = np.empty_like(y)
    everyone = np.arange(len(x))
    for test in folds:
        train = np.setdiff1d(everyone, test)
        xtr, xte = _standardise(x[train], x[test])
        w, b, _ = _ridge_fit(xtr, y[train], alpha)
        pred[test] = xte @ w + b
    ss_res = ((y - pred) ** 2).sum(0)
    ss_tot = ((y - y.mean(0)) ** 2).sum(0)
    return float(np.mean(1.0 - ss_res / ss_tot))


def _check(trace: object, folds: object, alpha: object, seed: object) -> xr.Dataset:
    if isinstance(trace, xr.DataTree):
        raise ArgumentTypeError("trace: a hierarchical (Swin) trace has one grid per stage; probe one stage's Dataset")
    if not isinstance(trace, xr.Dataset):
        raise ArgumentTypeError(f"trace: expected an xarray.Dataset from vitcam_nb.trace(), got {type(trace).__name__}")
    missing = [k for k in ("act", "token_kind", "patch_row", "patch_col") if k not in trace.variables]
    if missing and not _lm_sites(trace):
        raise ArgumentError(f"trace: missing {missing}; the probe needs the token sites' activations ('act') and each "
                            "token's kind and grid position (trace with sites=['F1', ...])")
    if any("image" in trace[k].dims for k in ("act", *_lm_sites(trace)) if k in trace.variables):
        raise ArgumentError("trace: a store of many images; probe one image's trace (vitcam_nb.image_trace(store, i))")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
        raise ArgumentError(f"seed: expected an int >= 0 (numpy's default_rng seed), got {seed!r:.80}")
    if isinstance(folds, bool) or not isinstance(folds, (int, np.integer)) or folds < 2:
        raise ArgumentError(f"folds: expected an int >= 2, got {folds!r}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.number))
                              or not np.isfinite(alpha) or alpha <= 0):
        raise ArgumentError(f"alpha: expected None (chosen per fold by leave-one-out) or a finite number > 0, "
                            f"got {alpha!r}")
    return trace


def _lm_sites(trace: xr.Dataset) -> list[str]:
    """The generative-VLM token sites the trace holds (``projector``, ``lm_resid``) with their image-token layout."""
    if not all(k in trace.variables for k in ("image_token_row", "image_token_col", "image_token_tile")):
        return []
    return [s for s in LM_TOKEN_SITES if s in trace.variables]


def _lm_features(trace: xr.Dataset, site: str, layer: int) -> np.ndarray | None:
    """(image tokens, channels) of an LM-side site at LM layer ``layer`` (``projector``: layer 0 only), or None."""
    values = trace[site].values
    if site == "projector":
        return values if layer == 0 else None
    return values[layer] if 0 <= layer < values.shape[0] else None


def _chosen(name: str, asked: Sequence | None, have: list) -> list:
    if asked is None:
        return have
    kind, what = (str, "a site name") if name == "sites" else ((int, np.integer), "a block index")
    one = isinstance(asked, kind) and not isinstance(asked, (bool, np.bool_))
    if not one and (isinstance(asked, (str, bool, np.bool_)) or not isinstance(asked, (Sequence, np.ndarray))):
        raise ArgumentTypeError(f"{name}: expected {what} or a list of them, got {asked!r:.80}")
    asked = [asked] if one else list(asked)
    wrong = [a for a in asked if not isinstance(a, kind) or isinstance(a, (bool, np.bool_))]
    if wrong:  # 1.0 == 1 and True == 1 would otherwise pass the membership test below
        raise ArgumentTypeError(f"{name}: {wrong[0]!r:.80} is not {what}")
    unknown = [a for a in asked if a not in have]
    if unknown or not asked:
        raise ArgumentError(f"{name}: {unknown or asked} not in the trace; it has {have}")
    return asked


def position_probe(trace: xr.Dataset, *, sites: Sequence[str] | str | None = None,
                   layers: Sequence[int] | int | None = None, folds: int = 5, seed: int = 0,
                   alpha: float | None = None, frame: str = "image") -> xr.DataArray:
    """For each token site and traced block, the cross-validated R^2 with which a ridge probe predicts a patch
    token's grid position (patch_row, patch_col) from its stored activations (see the module docstring).

    ``sites`` / ``layers`` default to every token site and traced block (global block indices); on a generative
    VLM's answer trace ``projector`` and ``lm_resid`` too, over their image tokens at the layout's cells, their
    layers the LM's (NaN where a site has no such layer); on a multi-tile layout at the position ``frame`` names
    (``"image"``: the cell's centre on the image through its tile's box; ``"tile"``: within its tile). ``alpha`` None
    chooses the penalty per fold by leave-one-out on the training tokens; a number fixes it (on standardised
    features). Returns a DataArray ``(site, layer)`` named ``position_r2`` (``(crop, site, layer)`` on a trace whose
    tower ran on crops, the tower sites probed per crop), with the probe's settings and the trace id in its attrs;
    store it in the trace (``tr["position_r2"] = ...``) and every checklist and methods paragraph of a map on that
    trace quotes it.

    Example:
        >>> import numpy as np, xarray as xr
        >>> rng = np.random.default_rng(0)
        >>> rows, cols = np.divmod(np.arange(36), 6)
        >>> tr = xr.Dataset({"act": (("layer", "site", "token", "channel"), rng.normal(size=(1, 1, 36, 8)))},
        ...                 coords={"layer": [3], "site": ["F6"], "token_kind": ("token", ["patch"] * 36),
        ...                         "patch_row": ("token", rows), "patch_col": ("token", cols)})
        >>> float(position_probe(tr).sel(site="F6", layer=3)) < 0.2  # noise features: no position
        True
    """
    trace = _check(trace, folds, alpha, seed)
    if frame not in ("image", "tile"):
        raise ArgumentError(f"frame: expected 'image' or 'tile', got {frame!r:.80}")
    lm = _lm_sites(trace)
    tower = "act" in trace.variables and all(k in trace.variables for k in ("token_kind", "patch_row", "patch_col"))
    have_sites = ([str(s) for s in trace["act"]["site"].values] if tower else []) + lm
    have_layers = sorted(({int(v) for v in trace["act"]["layer"].values} if tower else set())
                         | {v for s in lm for v in range(1 if s == "projector" else trace[s].shape[0])})
    sites = _chosen("sites", sites, have_sites)
    layers = _chosen("layers", layers, have_layers)
    fixed = None if alpha is None else float(alpha)
    crops = tower and "crop" in trace["act"].dims
    words = ""
    lm_out = np.full((len(sites), len(layers)), np.nan)
    for i, site in enumerate(sites):
        if site not in lm:
            continue
        y, words = lm_positions(trace, site, frame)
        fit = _fitter(np.arange(len(y)), y, "image", folds, seed, fixed)
        for j, layer in enumerate(layers):
            x = _lm_features(trace, site, layer)
            if x is not None:  # the LM has no such layer (projector: one): no value, not a zero
                lm_out[i, j] = fit(np.asarray(x, np.float64), site, layer)
    if crops:
        out = np.stack([_tower_r2(trace.isel(crop=k), sites, layers, lm, lm_out, folds, seed, fixed)
                        for k in range(int(trace.sizes["crop"]))])
    else:
        out = _tower_r2(trace, sites, layers, lm, lm_out, folds, seed, fixed) if tower else lm_out
    attrs = {"method": "ridge probe from patch-token activations (standardised per fold) to (patch_row, "
                       "patch_col); R^2 of out-of-fold predictions, averaged over row and column",
             "alpha": "per fold by exact leave-one-out over " + ", ".join(f"{a:g}" for a in RELATIVE_ALPHAS)
                      + " x mean squared singular value" if alpha is None else float(alpha),
             "folds": int(folds), "seed": int(seed), "trace_id": str(trace.attrs.get("trace_id", ""))}
    if lm:
        where = words or "image tokens at their layout cells"
        attrs["lm_sites"] = (f"{', '.join(s for s in lm if s in sites)}: {where}; their layer is the LM decoder "
                             "layer (projector: 0), not a tower block; NaN where the "
                             "site has no such layer")
        attrs["frame"] = frame
    coords: dict = {"site": sites, "layer": layers}
    dims: tuple[str, ...] = ("site", "layer")
    if crops:
        dims = ("crop", *dims)
        coords["crop"] = trace["crop"].values if "crop" in trace.coords else np.arange(out.shape[0])
        for name in ("crop_tile", "crop_group"):
            if name in trace.coords:
                coords[name] = ("crop", trace[name].values)
        attrs["crops"] = ("tower sites probed per crop (each crop's patch tokens for their grid in that crop, the "
                          "probe of trace.isel(crop=k)); LM-side sites have no crop and repeat one value per crop")
    return xr.DataArray(out, dims=dims, coords=coords, name=POSITION_R2, attrs=attrs)


def _fitter(rows: np.ndarray, y: np.ndarray, kind: str, folds: int, seed: int, alpha: float | None):
    """The R^2 of features (tokens ``rows`` x channels) for positions ``y``, after the refusals of a grid too
    small or constant (a one-row grid has no row to predict: that coordinate is left out)."""
    y = np.asarray(y, np.float64)
    y = y[:, y.std(0) > 0]
    if y.shape[1] == 0 or len(rows) < 2 * folds:
        raise ArgumentError(f"trace: {len(rows)} {kind} tokens on a {'constant' if y.shape[1] == 0 else 'small'} "
                            f"grid; the probe needs positions that vary and at least 2 tokens per fold "
                            f"(folds={folds})")
    parts = np.array_split(np.random.default_rng(seed).permutation(len(rows)), folds)

    def fit(x: np.ndarray, site: str, layer: int) -> float:
        x = x[:, ~np.isnan(x).all(0)]  # channels this site does not have (padding) are not features
        if x.size == 0 or np.isnan(x).any():
            raise ArgumentError(f"trace: act at site {site}, layer {layer} has missing values; cannot probe it")
        return _probe_r2(x, y, parts, alpha)
    return fit


def _tower_r2(trace: xr.Dataset, sites: list, layers: list, lm: list, lm_out: np.ndarray, folds: int, seed: int,
              alpha: float | None) -> np.ndarray:
    """(sites, layers): the LM rows as given, the tower rows probed on this (one crop's) trace."""
    out = lm_out.copy()
    tower = [s for s in sites if s not in lm]
    if not tower:
        return out
    patch = np.flatnonzero(np.asarray(trace["token_kind"].values) == "patch")
    y = np.stack([trace["patch_row"].values[patch], trace["patch_col"].values[patch]], -1)
    fit = _fitter(patch, y, "patch", folds, seed, alpha)
    values = trace["act"].transpose("layer", "site", "token", "channel")
    have = [int(v) for v in trace["act"]["layer"].values]
    for i, site in enumerate(sites):
        if site in lm:
            continue
        for j, layer in enumerate(layers):
            if layer in have:
                out[i, j] = fit(np.asarray(values.sel(site=site, layer=layer).values, np.float64)[patch], site,
                                layer)
    return out
