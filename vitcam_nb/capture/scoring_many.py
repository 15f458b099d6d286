"""``vc.score`` on a :func:`vitcam_nb.trace_many` store: lazily, one image at a time, resumably.

Each image's trace is read from the store (dask, only that image's chunks), scored by
:func:`vitcam_nb.capture.scoring.score`, and its ``score`` / ``ablation`` values are written into the store at
once, one image per chunk (zarr's chunk writes are atomic). The call holds the store's lock (the one
``trace_many`` takes) from before it reads the store until it returns: a store another call is writing is
refused with the lock's ``TraceFileError`` and left as it is. An image whose scores are all stored already is
skipped without preparing its input or calling the model, so a rerun after an interruption continues where it
stopped. The store's arrays have a leading ``image`` dimension, NaN where nothing was scored; ``open_traces``
and ``image_trace`` read them like every other variable.

Example:
    >>> import numpy as np, tempfile, timm, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> imgs = [np.full((32, 32, 3), v, np.uint8) for v in (0, 90)]
    >>> p = vc.trace_many(m, imgs, tempfile.mkdtemp() + "/t.zarr", targets="top1", sites=["F1"], progress=False)
    >>> ds = vc.score(p, m, "ablationcam", imgs, layer=1, progress=False)
    >>> ds["ablation"].dims[0], vc.cam(vc.image_trace(ds, 1), vc.Recipe(weighting="ablationcam", layer=1)).shape
    ('image', (32, 32))
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from vitcam_nb.capture.inputs import iter_items
from vitcam_nb.capture.reader import image_trace, is_store, open_traces
from vitcam_nb.capture.scoring import pending, refuse_unscorable
from vitcam_nb.capture.scoring import score as score_one
from vitcam_nb.capture.store import Store
from vitcam_nb.capture.store_lock import StoreLock
from vitcam_nb.core.errors import ArgumentTypeError, TraceError, TraceFileError
from vitcam_nb.core.schema import SCORE_VARIABLES, VARIABLES
from vitcam_nb.targets.base import Target

__all__ = ["score", "score_store"]


def _store_path(store: Any) -> Path:
    if isinstance(store, (str, os.PathLike)):
        return Path(store)
    source = store.encoding.get("source") if isinstance(store, xr.Dataset) else None
    if not source:
        raise ArgumentTypeError("trace: this many-image Dataset does not say which store it was opened from (a "
                                "selection loses that); pass the store's path, as returned by vc.trace_many")
    return Path(source)


def _array(st: Store, name: str, like: xr.Dataset) -> Any:
    """The store's ``name`` array (image, layer, site, target, channel), created NaN-filled on first use."""
    if name in st.arrays:
        return st.arrays[name]
    dims = ("image", *VARIABLES[name].dims)
    shape = (len(st.done), *(int(like.sizes[d]) for d in VARIABLES[name].dims))
    arr = st.group.create_array(name, shape=shape, chunks=(1, *shape[1:]), dtype="float32", fill_value=np.nan,
                                dimension_names=dims, attributes={"meaning": VARIABLES[name].meaning})
    st.arrays[name] = arr
    return arr


def _score_locked(store: Any, path: Path, model: torch.nn.Module, recipes_or_method: Any, images: Any,
                  batch_size: int, device: Any, progress: bool | None, fields: dict) -> None:
    """:func:`score_store`'s work, while the caller holds the store's lock."""
    from vitcam_nb.core.progress import progress_bar as tqdm

    ds = open_traces(path)
    if isinstance(store, xr.Dataset) and not np.array_equal(store["image"].values, ds["image"].values):
        raise ArgumentTypeError("trace: a selection of a store's images cannot be scored in place; pass the store's "
                                "path (every done image is scored, and a rerun skips those already scored)")
    if images is None:
        raise TraceError("images: vc.score on a store needs the images given to trace_many, in the same order (the "
                         "store keeps only uint8 display copies of the model inputs)")
    if ds.sizes["image"] == 0:
        raise TraceFileError(f"trace: {path} holds no finished image; run trace_many first")
    pending(image_trace(ds, 0), recipes_or_method, **fields)  # refuse bad recipes before any image is read
    positions = {int(v): pos for pos, v in enumerate(ds["image"].values)}
    items, n = iter_items(images, None, None)
    expected = int(ds.attrs.get("n_expected", -1))
    if n is not None and expected >= 0 and n != expected:
        raise TraceFileError(f"images: {n} images, but {path} was traced from {expected}; pass the same images")
    st = Store(path)
    bar = tqdm(total=len(positions), disable=progress is False, unit="img", desc="vc.score")
    try:
        for i, item in enumerate(items):
            if i not in positions:  # not traced (yet): nothing to score
                continue
            one = image_trace(ds, positions[i])
            if pending(one, recipes_or_method, **fields):
                try:
                    scored = score_one(one, model, recipes_or_method, item.image, batch_size=batch_size, device=device,
                                       progress=False, **fields)
                except TraceError as exc:
                    raise TraceError(f"images: image {i}: {exc}") from exc
                for name in SCORE_VARIABLES:
                    if name in scored.variables:
                        _array(st, name, scored)[i] = scored[name].values.astype(np.float32)
            bar.update(1)
    finally:
        bar.close()


def score_store(store: str | os.PathLike | xr.Dataset, model: torch.nn.Module, recipes_or_method: Any = "scorecam",
                images: Any = None, *, batch_size: int = 32, device: str | torch.device | None = None,
                progress: bool | None = None, **fields: Any) -> xr.Dataset:
    """Score every done image of a trace_many store and write the scores into it, image by image; returns the
    store reopened with :func:`vitcam_nb.open_traces`. A rerun skips the images already scored.

    Args:
        store: the store's path, or the Dataset :func:`vitcam_nb.open_traces` returned.
        model: the traced model (its weights hash must be the store's, its scores on each image the stored ones).
        recipes_or_method, batch_size, device, fields: as in :func:`vitcam_nb.capture.scoring.score`.
        images: the images given to ``trace_many``, in the same order (a list, an array, a folder, ...); each
            must hash to the input its image index was traced from.
        progress: a tqdm bar over images (default: on).

    Example:
        >>> import numpy as np, tempfile, timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> imgs = np.zeros((2, 32, 32, 3), np.uint8)
        >>> p = vc.trace_many(m, imgs, tempfile.mkdtemp() + "/t.zarr", targets="top1", sites=["F4"], progress=False)
        >>> ds = score_store(p, m, "scorecam", imgs, site="F4", progress=False)  # layer -1: block 1
        >>> int(np.isnan(ds["score"].sel(layer=1)).sum()), int(np.isnan(ds["score"].sel(layer=0)).sum())
        (0, 768)
    """
    refuse_unscorable(store)
    path = _store_path(store)
    lock = StoreLock(path, writer="vc.score")
    if path.is_dir():  # no folder: open_traces says what is wrong with the path
        lock.acquire()  # before anything is read: a store being written by trace_many is refused, unchanged
    try:
        _score_locked(store, path, model, recipes_or_method, images, batch_size, device, progress, fields)
    finally:
        lock.release()
    return open_traces(path)


def score(trace: Any, model: torch.nn.Module, recipes_or_method: Any = "scorecam", image: Any = None, *,
          batch_size: int = 32, device: str | torch.device | None = None, progress: bool | None = None,
          targets: Target | None = None, **fields: Any) -> xr.Dataset:
    """``vc.score``: :func:`vitcam_nb.capture.scoring.score` on a single trace, :func:`score_store` on a
    trace_many store (its path or opened Dataset; ``image`` is then the sequence of images).

    Example:
        >>> import numpy as np, timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> img = np.zeros((32, 32, 3), np.uint8)
        >>> tr = score(vc.trace(m, img, targets="top1"), m, "ablationcam", img, layer=0, progress=False)
        >>> tr["ablation"].dims
        ('layer', 'site', 'target', 'channel')
    """
    if isinstance(trace, (str, os.PathLike)) or is_store(trace):
        if targets is not None:
            raise TraceError("targets: trace_many stores hold class targets; leave targets at None")
        return score_store(trace, model, recipes_or_method, image, batch_size=batch_size, device=device,
                           progress=progress, **fields)
    return score_one(trace, model, recipes_or_method, image, batch_size=batch_size, device=device, progress=progress,
                     targets=targets, **fields)
