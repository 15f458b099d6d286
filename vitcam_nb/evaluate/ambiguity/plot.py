"""The figure of an ambiguity analysis (:meth:`vitcam_nb.evaluate.ambiguity.analysis.Ambiguity.plot`): the input
image with
the object outlined beside the mean and spread of the consistent maps, the two that agree least, and the share of
the map variance each open choice explains. Every title says how all-zero (degenerate) maps were counted.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> tr = vc.trace(m, np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8))
    >>> fig = plot_ambiguity(vc.ambiguity(tr, reported=dict(site="F1", layer=0, weighting="gradcam")))
    >>> fig.axes[0].get_title()
    'input image'
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["DEFAULT_CMAP", "plot_ambiguity"]

DEFAULT_CMAP = "inferno"  # perceptually uniform: equal steps in value look like equal steps in colour


def _outline(ax: Any, mask: np.ndarray | None, shape: tuple[int, int]) -> None:
    if mask is None:
        return
    h, w = shape
    ys = (np.arange(mask.shape[0]) + 0.5) * h / mask.shape[0] - 0.5
    xs = (np.arange(mask.shape[1]) + 0.5) * w / mask.shape[1] - 0.5
    ax.contour(xs, ys, mask.astype(float), levels=[0.5], colors="cyan", linewidths=1.2)


def _differ(a: dict, b: dict) -> str:
    return ", ".join(f"{k}={a[k]}" for k in a if a[k] != b[k]) or f"site={a['site']}"


def plot_ambiguity(amb: Any, cmap: str = DEFAULT_CMAP, image: Any = None, mask: Any = None) -> Any:
    """Two rows: the input image, the mean and the spread of the consistent maps; the least-agreeing pair and
    the variance shares. ``image`` and ``mask`` default to the ones the analysis kept (``amb.image``,
    ``amb.mask``); maps are drawn on their grid (token or image) over the image's extent, the object outlined
    in cyan.

    Example:
        >>> fig = plot_ambiguity(amb)  # doctest: +SKIP
    """
    import matplotlib.pyplot as plt

    image = getattr(amb, "image", None) if image is None else image
    mask = getattr(amb, "mask", None) if mask is None else mask
    mask = None if mask is None else np.asarray(mask, bool)
    maps = np.asarray(amb.maps.values, dtype=np.float64)
    n, zeros = len(maps), int(amb.degenerate)
    shape = np.asarray(image).shape[:2] if image is not None else (mask.shape if mask is not None else maps.shape[1:])
    extent = (-0.5, shape[1] - 0.5, shape[0] - 0.5, -0.5)
    fig, axes = plt.subplots(2, 3, figsize=(13, 8.6))
    ax = axes[0, 0]
    if image is not None:
        ax.imshow(np.asarray(image), extent=extent)
    else:
        ax.imshow(np.ones((*shape, 3)), extent=extent)
        ax.text(0.5, 0.5, "no input image kept", transform=ax.transAxes, ha="center")
    _outline(ax, mask, shape)
    ax.set_title("input image" + (" (object outlined)" if mask is not None else ""), fontsize=10)
    counted = f"{zeros} all-zero map(s) counted as zeros" if zeros else "no all-zero maps"
    i, j = amb.most_different()
    a, b = amb.recipes[i].to_dict(), amb.recipes[j].to_dict()
    rho = "" if i == j or not np.isfinite(amb.rho[i, j]) else f" (Spearman rho = {amb.rho[i, j]:.2f})"
    hi = max(float(maps.max()), 1e-12)
    panels = [
        (axes[0, 1], maps.mean(axis=0), f"mean of the {n} maps\n({counted})", (0, hi)),
        (axes[0, 2], np.asarray(amb.spread.std.values), f"spread: std per token over the {n} maps\n({counted})",
         (0, None)),
        (axes[1, 0], maps[i], f"least-agreeing pair{rho}, A:\n{_differ(a, b)}", (0, hi)),
        (axes[1, 1], maps[j], f"B:\n{_differ(b, a)}\n(all-zero maps left out of the pair choice)", (0, hi)),
    ]
    for ax, values, title, (lo, top) in panels:
        im = ax.imshow(values, cmap=cmap, vmin=lo, vmax=top, extent=extent, interpolation="nearest")
        _outline(ax, mask, shape)
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
    for ax in axes.ravel()[:5]:
        ax.set_xticks([])
        ax.set_yticks([])
    s = amb.sensitivity
    names, shares = list(s.fields) + ["interactions"], list(s.fields.values()) + [s.interaction]
    bars = axes[1, 2]
    bars.barh(names[::-1], shares[::-1], color="tab:orange")
    bars.set_xlim(0, 1)
    bars.set_xlabel("share of the map variance (first order)")
    bars.set_title(f"which open choice matters\n({s.design.split(':')[0]} design; all-zero maps included)",
                   fontsize=9)
    sampled = "" if s.design.startswith("exact") else " sampled"
    skipped = f"; {amb.skipped} more name no recipe" if amb.skipped else ""
    fig.suptitle(f"{n} distinct recipes fit the description: {s.cells}{sampled} combinations of its open choices "
                 f"({', '.join(amb.open) or 'none'}) name them{skipped}\n(several combinations are one recipe when "
                 f"a choice does not apply, e.g. heads at F1); median Spearman rho "
                 f"{amb.spread.median_spearman:.2f} over {amb.spread.pairs} pairs of non-constant maps", fontsize=10)
    fig.tight_layout()
    return fig
