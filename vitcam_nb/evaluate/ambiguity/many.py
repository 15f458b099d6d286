"""Ambiguity over many images: the analysis of one description on each image of a list of traces or an
``open_traces`` store, or of a map store (``open_maps``: over the recipes it holds; lazily: one dask task per
image, each reading only its image's chunks), and the distribution of its spread, sensitivity and chance to
localise across images.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> trs = [vc.trace(m, np.full((32, 32, 3), v, np.uint8)) for v in (40, 200)]
    >>> many = vc.ambiguity(trs, reported=dict(site="F1", layer=0, weighting="gradcam"))
    >>> many.sensitivity.dims
    ('image', 'factor')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.capture.reader import image_trace, is_store
from vitcam_nb.capture.worker_model import active_client
from vitcam_nb.compute.many import image_blocks, is_lazy
from vitcam_nb.compute.map_store import image_maps, is_map_store
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError
from vitcam_nb.core.escape import escape_markdown
from vitcam_nb.core.progress import progress_bar as tqdm

__all__ = ["AmbiguityMany", "ambiguity_many"]


class AmbiguityMany:
    """One :class:`~vitcam_nb.evaluate.ambiguity.analysis.Ambiguity` per image (``results``) and their distribution:
    ``median_spearman`` and ``localises`` (image,), ``sensitivity`` (image, factor: each open field, each
    checklist category and the field interaction remainder), :meth:`summary`, :meth:`report`, :meth:`plot`.

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> trs = [vc.trace(m, np.full((32, 32, 3), v, np.uint8)) for v in (40, 200)]
        >>> vc.ambiguity(trs, reported=dict(site="F1", layer=0)).median_spearman.shape
        (2,)
    """

    def __init__(self, results: list) -> None:
        self.results = results
        first = results[0].sensitivity
        factors = [*first.fields, *first.categories, "interaction"]
        rows = [[*r.sensitivity.fields.values(), *r.sensitivity.categories.values(), r.sensitivity.interaction]
                for r in results]
        self.sensitivity = xr.DataArray(np.array(rows), dims=("image", "factor"), coords={"factor": factors},
                                        name="first_order_share")
        self.median_spearman = np.array([r.spread.median_spearman for r in results])
        self.localises = np.array([np.nan if r.localises is None else r.localises for r in results])

    def summary(self) -> dict[str, Any]:
        """Quartiles across images of the median Spearman, of each share, and of the chance to localise.

        Example:
            >>> import timm, numpy as np, vitcam_nb as vc
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
            >>> trs = [vc.trace(m, np.full((32, 32, 3), v, np.uint8)) for v in (40, 200)]
            >>> many = vc.ambiguity(trs, reported=dict(site="F1", layer=0, weighting="gradcam"))
            >>> many.summary()["images"]
            2
        """
        def quartiles(x: np.ndarray) -> list[float] | None:
            x = x[np.isfinite(x)]
            return [float(v) for v in np.percentile(x, [25, 50, 75])] if x.size else None

        return {"images": len(self.results), "recipes": len(self.results[0].recipes),
                "median_spearman_quartiles": quartiles(self.median_spearman),
                "share_quartiles": {str(f): quartiles(self.sensitivity.sel(factor=f).values)
                                    for f in self.sensitivity["factor"].values},
                "localises_quartiles": quartiles(self.localises),
                "localises_mean": float(np.nanmean(self.localises)) if np.isfinite(self.localises).any() else None}

    def report(self) -> str:
        """A paragraph over the images, for a paper or a review.

        Example:
            >>> import timm, numpy as np, vitcam_nb as vc
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
            >>> trs = [vc.trace(m, np.full((32, 32, 3), v, np.uint8)) for v in (40, 200)]
            >>> many = vc.ambiguity(trs, reported=dict(site="F1", layer=0, weighting="gradcam"))
            >>> many.report()[:14]
            'Over 2 images,'
        """
        s = self.summary()
        opened = self.results[0].open
        text = (f"Over {s['images']} images, the description leaves {len(opened)} choice(s) open "
                f"({', '.join(opened) or 'none'}), allowing {s['recipes']} distinct recipes. ")
        if s["median_spearman_quartiles"]:
            q = s["median_spearman_quartiles"]
            text += f"Consistent maps agree at median Spearman rho = {q[1]:.2f} (quartiles {q[0]:.2f}-{q[2]:.2f}). "
        fields = list(self.results[0].sensitivity.fields)
        if fields:
            med = {f: s["share_quartiles"][f][1] for f in fields if s["share_quartiles"][f]}
            top = max(med, key=med.get)
            text += f"The {top} choice explains a median {med[top]:.0%} of the map variance. "
        if s["localises_mean"] is not None:
            text += (f"A reader following the description has a {s['localises_mean']:.0%} chance of reproducing a "
                     "map that points at the object.")
        return text.strip()

    def plot(self) -> Any:
        """Box plots of the first-order shares across images; returns the matplotlib Figure.

        Example:
            >>> import timm, numpy as np, vitcam_nb as vc
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
            >>> trs = [vc.trace(m, np.full((32, 32, 3), v, np.uint8)) for v in (40, 200)]
            >>> many = vc.ambiguity(trs, reported=dict(site="F1", layer=0, weighting="gradcam"))
            >>> len(many.plot().axes)
            1
        """
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 0.4 * self.sensitivity.sizes["factor"] + 1.2))
        names = [str(f) for f in self.sensitivity["factor"].values]
        ax.boxplot(self.sensitivity.values[:, ::-1], vert=False)
        ax.set_yticks(range(1, len(names) + 1), names[::-1])
        ax.set_xlim(0, 1)
        ax.set_xlabel(f"first-order share of map variance over {len(self.results)} images")
        fig.tight_layout()
        return fig

    def _repr_markdown_(self) -> str:
        return escape_markdown(self.report())


def _read(store: xr.Dataset, i: int) -> xr.Dataset:
    """Image ``i`` of a trace store (its trace) or of a map store (its maps, which the analysis reads)."""
    return image_maps(store, i) if is_map_store(store) else image_trace(store, i)


def _image(one: xr.Dataset, run: Callable[..., Any], reported: Any, space: Any, mask: Any, *args: Any) -> Any:
    # ``one`` keeps a length-1 image dimension, so reading its image 0 gives exactly what the loop over the store gives.
    return run(_read(one, 0), reported, space, mask, *args)


def _compute(tasks: list, scheduler: str | None, show: bool) -> list:
    """Compute the per-image tasks on the active distributed Client (unless ``scheduler`` is named) or on dask's
    scheduler, with a tqdm bar counting finished images."""
    import dask
    from dask.callbacks import Callback

    client = active_client() if scheduler is None else None
    if client is not None:
        from distributed import as_completed

        futures = client.compute(tasks)
        for _ in tqdm(as_completed(futures), total=len(futures), desc="ambiguity", disable=not show):
            pass
        return client.gather(futures)
    keys = {t.key for t in tasks}
    bar = tqdm(total=len(tasks), desc="ambiguity", disable=not show)

    class _Bar(Callback):
        def _posttask(self, key: Any, result: Any, dsk: Any, state: Any, worker_id: Any) -> None:
            if key in keys:
                bar.update()

    with bar, _Bar():
        return list(dask.compute(*tasks, scheduler=scheduler))


def ambiguity_many(traces: Any, one: Callable[..., Any], reported: Any, space: Any, masks: Any, *args: Any,
                   progress: bool | None = None, scheduler: str | None = None) -> AmbiguityMany:
    """Run ``one`` (the single-trace analysis) on each trace of a list or store, or on each image of a map store
    (``vc.open_maps``: the analysis over the recipes the store holds); ``masks`` is None (a store's masks are used
    when it has them) or one mask per image.

    A lazy (``open_traces``) store becomes one dask task per image, computed on the active dask.distributed
    Client if there is one, else on dask's default scheduler (or ``scheduler``); a list of traces, already in
    memory, is a plain loop. Either way a tqdm bar counts the images (shown from 9 images, or per ``progress``).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> from vitcam_nb.evaluate.ambiguity.analysis import ambiguity
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> trs = [vc.trace(m, np.full((32, 32, 3), v, np.uint8)) for v in (40, 200)]
        >>> one = lambda tr, reported, space, mask, *a: ambiguity(tr, reported, space=space)
        >>> len(ambiguity_many(trs, one, dict(site="F1", layer=0), None, None).results)
        2
    """
    import dask

    store = is_store(traces)
    if store:
        n = traces.sizes["image"]
    elif isinstance(traces, Sequence) and not isinstance(traces, str) and traces:
        n = len(traces)
    else:
        raise ArgumentTypeError(f"trace: expected a trace Dataset, a non-empty list of them or an open_traces store, "
                                f"got {type(traces).__name__}")
    if masks is not None and len(masks) != n:
        raise ArgumentError(f"mask: over {n} images give one mask per image (a list), got {len(masks)}")
    show = n > 8 if progress is None else bool(progress)
    mask = [None] * n if masks is None else list(masks)
    if store and is_lazy(traces):
        blocks = image_blocks(traces)
        tasks = [dask.delayed(_image)(blocks.isel(image=[i]), one, reported, space, mask[i], *args)
                 for i in range(n)]
        return AmbiguityMany(_compute(tasks, scheduler, show))
    get = (lambda i: _read(traces, i)) if store else traces.__getitem__
    return AmbiguityMany([one(get(i), reported, space, mask[i], *args)
                          for i in tqdm(range(n), desc="ambiguity", disable=not show)])
