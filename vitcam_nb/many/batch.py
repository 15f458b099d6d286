"""Batched tracing: one forward and one batched backward pass for a batch of images, stacked into the
store layout (a leading ``image`` dimension)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xarray as xr

from vitcam_nb.errors import TraceError
from vitcam_nb.many.inputs import _Item
from vitcam_nb.preprocess import PreparedInput
from vitcam_nb.tracer import EXPECTED_TARGET, _assemble, _Capture, target_name

# Attributes of a single trace that differ from image to image: (image,) coordinates in a store.
PER_IMAGE_ATTRS = ("trace_id", "input_sha256", "preprocessing", "device", "deterministic")
# Facts about the software that wrote a batch: a resumed run may differ; the store keeps its first run's.
ENV_ATTRS = ("vitcam_nb_version", "torch_version", "timm_version", "numpy_version", "xarray_version")


@dataclass
class _Plan:
    """Everything resolved once for a run of :func:`trace_many`."""

    model: torch.nn.Module
    adapter: Any
    layer_ids: list[int]
    site_ids: list[str]
    target_mode: tuple[str, Any]
    class_labels: list[str]
    run_device: torch.device
    compute_dtype: torch.dtype
    store_dtype: type
    prefix: list[str]


def _trace_batch(plan: _Plan, prepared: list[PreparedInput]) -> list[xr.Dataset]:
    """One forward and one batched backward pass for a batch; returns each image's single-trace Dataset.

    Target j of image b is ``z[b, c_bj]``; images in a batch are independent, so the gradient of
    ``sum_b z[b, c_bj]`` with respect to image b's tensors is that of ``z[b, c_bj]`` alone, and one
    ``is_grads_batched`` call over the K+1 summed targets covers the whole batch.
    """
    model = plan.model
    shapes = {tuple(p.tensor.shape) for p in prepared}
    if len(shapes) > 1:
        raise TraceError(f"images: a store holds images of one input size; this batch has {sorted(shapes)}")
    with _Capture(model, plan.adapter, plan.layer_ids, plan.site_ids) as cap, torch.inference_mode(False), \
            torch.enable_grad():
        x = torch.cat([p.tensor for p in prepared]).to(plan.run_device, plan.compute_dtype).requires_grad_(True)
        z = model(x)
        if z.ndim != 2 or z.shape[0] != len(prepared):
            raise TraceError(f"model: expected logits of shape ({len(prepared)}, classes), got {tuple(z.shape)}")
        missing = [f"{s}@{layer}" for layer in plan.layer_ids for s in plan.site_ids if (layer, s) not in cap.tensors]
        if missing or cap.grid is None:
            raise TraceError(f"sites: hooks never fired for {missing or ['patch grid']}; the adapter's site "
                             "table does not fit this model")
        if plan.target_mode[0] == "top":
            classes = torch.topk(z.detach(), plan.target_mode[1], dim=1).indices
        else:
            classes = torch.tensor(plan.target_mode[1], device=z.device).expand(len(prepared), -1)
        expected = (torch.softmax(z.detach(), dim=1) * z).sum(dim=1)
        outputs = torch.cat([z.gather(1, classes).sum(dim=0), expected.sum()[None]])
        keys = list(cap.tensors)
        grads = torch.autograd.grad(
            outputs, [cap.tensors[k] for k in keys],
            grad_outputs=torch.eye(len(outputs), device=z.device, dtype=z.dtype),
            is_grads_batched=True, allow_unused=True,
        )
        acts = {k: cap.tensors[k].detach().to("cpu", torch.float32) for k in keys}
        grads_cpu = {k: None if g is None else g.detach().to("cpu", torch.float32) for k, g in zip(keys, grads)}
        grid = cap.grid
    logits = z.detach().to("cpu", torch.float32)
    classes_cpu = classes.cpu().tolist()
    return [
        _assemble(
            model=model, adapter=plan.adapter, prepared=p, logits=logits[b], classes=classes_cpu[b],
            class_labels=plan.class_labels, layer_ids=plan.layer_ids, site_ids=plan.site_ids,
            acts={k: t[b:b + 1] for k, t in acts.items()},
            grads={k: None if g is None else g[:, b:b + 1] for k, g in grads_cpu.items()},
            grid=grid, prefix=plan.prefix, store_dtype=plan.store_dtype, run_device=plan.run_device,
            compute_dtype=plan.compute_dtype,
        )
        for b, p in enumerate(prepared)
    ]


def _target_names(target_mode: tuple[str, Any]) -> list[str]:
    if target_mode[0] == "top":
        return [f"top{k + 1}" for k in range(target_mode[1])] + [EXPECTED_TARGET]
    return [target_name(c) for c in target_mode[1]] + [EXPECTED_TARGET]


def _strings(values: Any) -> np.ndarray:
    # Variable-length strings: zarr v3 has a specification for them, not for fixed-width unicode.
    return np.array([str(v) for v in np.ravel(values)], dtype=object).reshape(np.shape(values))


def _store_layout(per: list[xr.Dataset], indices: list[int], items: list[_Item], masks: list[np.ndarray | None],
                  target_names: list[str]) -> xr.Dataset:
    """Stack single-image traces into the store layout (leading ``image`` dimension)."""
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
    data = {("pixels" if name == "image" else name): (("image", *first[name].dims),
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
        coords[name] = (var.dims, _strings(values) if values.dtype.kind in "UO" else values)
    coords["image"] = ("image", np.asarray(indices, np.int64))
    coords["target"] = ("target", _strings(target_names))
    coords["target_class"] = (("image", "target"), np.stack([ds["target_class"].values for ds in per]))
    coords["target_label"] = (("image", "target"), _strings(np.stack([ds["target_label"].values for ds in per])))
    for key in PER_IMAGE_ATTRS:
        values = [ds.attrs[key] for ds in per]
        coords[key] = ("image", _strings(values) if isinstance(values[0], str) else np.asarray(values, np.int64))
    coords["label"] = ("image", np.array([it.label for it in items], np.int64))
    coords["source"] = ("image", _strings([it.source for it in items]))
    return xr.Dataset(data, coords=coords, attrs=shared)
