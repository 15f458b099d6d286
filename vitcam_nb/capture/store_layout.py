"""The layout of a many-image store: single-image traces stacked along a leading ``image`` dimension, and one
image of a store turned back into exactly the Dataset :func:`vitcam_nb.trace` returns.

Two names differ from a single trace, because a dimension and a variable cannot share a name in xarray: the
uint8 display copy of each input is ``pixels`` (image, y, x, rgb), and the ``target`` dimension holds fixed
positions (``top1`` .. ``topK``, or ``logit_<c>``, then ``expected_logit``) with ``target_class`` /
``target_label`` as (image, target) coordinates. Per-image facts that are attributes of a single trace
(``trace_id``, ``input_sha256``, ...) are (image,) coordinates, next to ``label`` and ``source``.

Example:
    >>> strings(np.array([["a"]])).dtype
    dtype('O')
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.capture.inputs import Item
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.schema import (
    ENV_ATTRS,
    EXPECTED_TARGET,
    PER_IMAGE_ATTRS,
    STORE_ATTRS,
    STORE_PIXELS,
    target_name,
)
from vitcam_nb.targets.classes import ClassTargets

__all__ = ["IMAGE_ATTRS_KEY", "single_trace", "stack_images", "store_target_names", "strings"]


def store_target_names(target: ClassTargets) -> list[str]:
    """The store's fixed ``target`` positions: ``top1`` .. ``topK`` for a top-K store (each image has its own
    classes), ``logit_<c>`` for explicit classes, then ``expected_logit``.

    Example:
        >>> store_target_names(ClassTargets("top2"))
        ['top1', 'top2', 'expected_logit']
    """
    if target.k is not None:
        return [f"top{k + 1}" for k in range(target.k)] + [EXPECTED_TARGET]
    return [target_name(c) for c in target.classes] + [EXPECTED_TARGET]


def strings(values: Any) -> np.ndarray:
    """Variable-length strings of any array of values, shape kept.

    Example:
        >>> strings(["a", 1]).tolist()
        ['a', '1']
    """
    # Variable-length strings: zarr v3 has a specification for them, not for fixed-width unicode.
    return np.array([str(v) for v in np.ravel(values)], dtype=object).reshape(np.shape(values))


def stack_images(per: list[xr.Dataset], indices: list[int], items: list[Item], masks: list[np.ndarray | None],
                 target_names: list[str]) -> xr.Dataset:
    """Stack single-image traces into the store layout (leading ``image`` dimension).

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> per = [vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets=[3], sites="F1")] * 2
        >>> items = [Item(None, -1, None, "")] * 2
        >>> ds = stack_images(per, [0, 1], items, [None, None], store_target_names(ClassTargets([3])))
        >>> ds["act"].dims[0], ds["target"].values.tolist()
        ('image', ['logit_3', 'expected_logit'])
    """
    first = per[0]
    shared = {k: v for k, v in first.attrs.items() if k not in PER_IMAGE_ATTRS}
    for i, ds in zip(indices, per):
        for name in first.data_vars:
            if ds[name].shape != first[name].shape:
                raise TraceError(f"images: image {i} gives {name} of shape {ds[name].shape}, image {indices[0]} "
                                 f"{first[name].shape}; a store holds images of one input size")
        diff = [k for k in shared if k not in ENV_ATTRS and ds.attrs.get(k) != shared[k]]
        if diff:
            raise TraceError(f"images: image {i} differs from image {indices[0]} in {diff}; a store holds images "
                             "traced alike")
    data = {(STORE_PIXELS if name == "image" else name): (("image", *first[name].dims),
                                                     np.stack([ds[name].values for ds in per]))
            for name in first.data_vars}
    if any(m is not None for m in masks):
        if any(m is None for m in masks):
            raise TraceError("masks: give a mask for every image or for none")
        data["mask"] = (("image", "y", "x"), np.stack(masks))
    data["done"] = (("image",), np.zeros(len(per), bool))
    coords: dict[str, Any] = {}
    for name, var in first.coords.items():
        if name in ("target", "target_class", "target_label"):
            continue
        values = var.values
        coords[name] = (var.dims, strings(values) if values.dtype.kind in "UO" else values)
    coords["image"] = ("image", np.asarray(indices, np.int64))
    coords["target"] = ("target", strings(target_names))
    coords["target_class"] = (("image", "target"), np.stack([ds["target_class"].values for ds in per]))
    coords["target_label"] = (("image", "target"), strings(np.stack([ds["target_label"].values for ds in per])))
    for key in PER_IMAGE_ATTRS:
        values = [ds.attrs[key] for ds in per]
        coords[key] = ("image", strings(values) if isinstance(values[0], str) else np.asarray(values, np.int64))
    coords["label"] = ("image", np.array([it.label for it in items], np.int64))
    coords["source"] = ("image", strings([it.source for it in items]))
    return xr.Dataset(data, coords=coords, attrs=shared)


#: The store attribute listing single-trace attributes stored per image beyond PER_IMAGE_ATTRS (a detection
#: store's target attributes), as (image,) coordinates; a store without it has none.
IMAGE_ATTRS_KEY = "image_attrs"


def _plain(value: Any) -> Any:
    value = value.item() if isinstance(value, np.generic) else value
    return str(value) if isinstance(value, (np.str_, str)) else value


def single_trace(one: xr.Dataset) -> xr.Dataset:
    """One image of a store (no ``image`` dimension, in memory) as the Dataset vitcam_nb.trace returns.

    Example:
        >>> ds = vc.open_traces("traces.zarr")  # doctest: +SKIP
        >>> single_trace(ds.isel(image=0).load())["image"].dims  # doctest: +SKIP
        ('y', 'x', 'rgb')
    """
    one = one.drop_vars(["image", "done", "checksum"], errors="ignore")  # checksum: verified as the store is read
    extra = json.loads(one.attrs.get(IMAGE_ATTRS_KEY, "[]"))
    attrs = {k: v for k, v in one.attrs.items() if k not in (*STORE_ATTRS, IMAGE_ATTRS_KEY, "checksums")}
    for key in (*PER_IMAGE_ATTRS, *extra):
        if key in one.coords:
            attrs[key] = _plain(one[key].values[()])
    attrs["image_index"] = int(one.attrs.get("image_index", -1))
    for key, name in (("label", "image_label"), ("source", "image_source")):
        if key in one.coords:
            attrs[name] = _plain(one[key].values[()])
    one = one.drop_vars([k for k in (*PER_IMAGE_ATTRS, *extra, "label", "source") if k in one.coords])
    classes = [int(c) for c in one["target_class"].values]
    one = one.assign_coords(target=np.array([target_name(c) if c >= 0 else EXPECTED_TARGET for c in classes]))
    fixed = {name: (var.dims, np.array(var.values.tolist(), dtype=str).reshape(var.shape))
             for name, var in one.variables.items() if var.dtype.kind in "OT"}
    one = one.assign_coords({k: v for k, v in fixed.items() if k in one.coords})
    one = one.assign({k: v for k, v in fixed.items() if k not in one.coords})
    if STORE_PIXELS in one:
        one = one.rename_vars({STORE_PIXELS: "image"})
    one.attrs = {k: _plain(v) for k, v in attrs.items()}
    return one
