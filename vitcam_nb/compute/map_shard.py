""":func:`vitcam_nb.map_many` sharded over a dask.distributed Client: each worker loads the model once, computes
whole batches and writes their chunks of the store; the calling process holds the store's lock and writes the
per-image facts and ``done`` flags as batches finish.

How the model travels: not pickled. Its architecture is rebuilt on each worker by ``timm.create_model`` from a
spec (``{"timm": name, **kwargs}``; default the model's timm name), its weights are sent once per worker as
safetensors bytes (a worker plugin, so a worker that joins or restarts loads them too), and the weights hash of
the rebuilt model must equal the caller's, or the batch is refused. Where GPUs exist each worker pins one:
``cuda:0`` of what ``CUDA_VISIBLE_DEVICES`` leaves it (dask-cuda's LocalCUDACluster gives each worker its own),
else the GPU numbered by the worker's name modulo the GPU count. A failed batch is retried (twice) on any
worker and its chunks rewritten whole; it is marked done only once written.

Example:
    >>> active_client() is None  # no Client running here
    True
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitcam_nb.capture.plan import TracePlan, model_name
from vitcam_nb.capture.runtime import exclusive, on_device
from vitcam_nb.capture.trace_many import store_settings
from vitcam_nb.compute.map_recipes import Entry, compute_batch
from vitcam_nb.compute.map_torch import compute_batch_torch
from vitcam_nb.compute.map_writer import BIG, write_region
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.provenance import settings_id, weights_sha256

try:  # the plugin's base class; without distributed there is no Client to shard over
    from distributed import WorkerPlugin as _PluginBase
except ImportError:  # pragma: no cover
    _PluginBase = object

__all__ = ["COMPUTE", "Sharder", "active_client"]

#: Each ``map_many(backend=...)``'s batch computation: the pass and every image's maps.
COMPUTE = {"numpy": compute_batch, "torch": compute_batch_torch}

#: Models loaded on this worker process, by key: (model, device, lock).
_MODELS: dict[str, tuple[torch.nn.Module, str, threading.Lock]] = {}


def active_client() -> Any:
    """The active dask.distributed Client, or None (none running, or distributed not installed).

    Example:
        >>> active_client() is None
        True
    """
    try:
        from distributed import get_client
    except ImportError:
        return None
    try:
        return get_client()
    except ValueError:
        return None


def _pin(device: str, worker_name: Any) -> str:
    """The device a worker computes on: the caller's, with one GPU per worker where there are several."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return device
    count = torch.cuda.device_count()
    if count <= 1:  # one GPU visible (dask-cuda gives each worker its own): that one
        return "cuda:0"
    try:
        return f"cuda:{int(worker_name) % count}"
    except (TypeError, ValueError):
        return f"cuda:{sum(map(ord, str(worker_name))) % count}"


def _build(spec: dict, weights: bytes, sha: str, training: bool) -> torch.nn.Module:
    import timm
    from safetensors.torch import load

    kwargs = {k: v for k, v in spec.items() if k != "timm"}
    model = timm.create_model(spec["timm"], pretrained=False, **kwargs)
    try:
        model.load_state_dict(load(weights), strict=True)
    except RuntimeError as exc:
        raise TraceError(f"worker_model: {spec} builds a model whose weights do not fit the caller's ({exc}); pass "
                         "worker_model={'timm': name, **the create_model kwargs the model was built with}") from exc
    model.train(training)
    if weights_sha256(model) != sha:
        raise TraceError(f"worker_model: the model rebuilt from {spec} has other weights than the caller's "
                         f"(sha256 {weights_sha256(model)[:12]}…, caller {sha[:12]}…)")
    return model


class _ModelPlugin(_PluginBase):
    """A worker plugin that loads the model once on each worker (and on workers that join later)."""

    def __init__(self, key: str, spec: dict, weights: bytes, sha: str, training: bool, device: str) -> None:
        self.key, self.spec, self.weights, self.sha, self.training, self.device = key, spec, weights, sha, training, \
            device
        self.name = f"vitcam_nb-model-{key}"

    def setup(self, worker: Any) -> None:
        if self.key not in _MODELS:
            model = _build(self.spec, self.weights, self.sha, self.training)
            _MODELS[self.key] = (model, _pin(self.device, getattr(worker, "name", 0)), threading.Lock())

    def teardown(self, worker: Any) -> None:
        _MODELS.pop(self.key, None)


def _worker_batch(key: str, entries: list[Entry], n_parts: int, plan_args: dict, settings_id_: str, path: str,
                  start: int, prepared: list) -> dict[str, np.ndarray]:
    """One batch on a worker: the pass, the maps, this batch's chunks written; the small arrays returned."""
    model, device, lock = _MODELS[key]
    with lock:
        plan = TracePlan.for_store(model, plan_args["targets"], sites=plan_args["sites"], layers=plan_args["layers"],
                                   dtype=plan_args["dtype"], device=device, labels=plan_args["labels"])
        if settings_id(store_settings(plan)) != settings_id_:
            raise TraceError("worker_model: the model on this worker gives other store settings than the caller's")
        with exclusive(plan.model), on_device(plan.model, plan.run_device):
            arrays, _, _ = COMPUTE[plan_args.get("backend", "numpy")](plan, entries, n_parts, prepared)
    write_region(path, start, arrays)
    return {k: v for k, v in arrays.items() if k not in BIG}


class Sharder:
    """Submits batches to the Client's workers and records each finished batch in the store.

    Example:
        >>> shard = Sharder(client, model, plan, entries, 0, "top1", "float32", None, path, None,
        ...                 get_writer, bar)  # doctest: +SKIP
    """

    def __init__(self, client: Any, model: torch.nn.Module, plan: TracePlan, entries: list[Entry], n_parts: int,
                 targets: Any, dtype: str, labels: Sequence[str] | None, path: Path, worker_model: dict | None,
                 get_writer: Callable[[], Any], bar: Any, backend: str = "numpy") -> None:
        from distributed import as_completed
        from safetensors.torch import save

        spec = dict(worker_model) if worker_model is not None else {"timm": model_name(model)[0]}
        import timm

        if not isinstance(spec.get("timm"), str) or not timm.is_model(spec["timm"]):
            raise TraceError(f"worker_model: a distributed map_many rebuilds the model on each worker with "
                             f"timm.create_model; expected {{'timm': a timm model name, **its create_model kwargs}}, "
                             f"got {spec!r}")
        sha = weights_sha256(model)
        weights = save({k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()})
        self.key = f"{sha[:16]}-{os.getpid()}"
        plugin = _ModelPlugin(self.key, spec, weights, sha, model.training, str(plan.run_device))
        self.client, self.entries, self.n_parts, self.path = client, entries, n_parts, str(path)
        self.plan_args = {"targets": targets, "sites": plan.site_ids, "layers": plan.layer_ids, "dtype": dtype,
                          "labels": None if labels is None else list(labels), "backend": backend}
        self.settings_id = settings_id(store_settings(plan))
        self.get_writer, self.bar = get_writer, bar
        self.plugin_name = plugin.name
        client.register_plugin(plugin, name=plugin.name)
        self.queue = as_completed()
        self.meta: dict[Any, tuple[int, np.ndarray, np.ndarray]] = {}
        self.limit = 2 * max(1, len(client.scheduler_info(n_workers=-1).get("workers", {})) or 1)

    def submit(self, start: int, prepared: list, labels: np.ndarray, sources: np.ndarray) -> None:
        future = self.client.submit(_worker_batch, self.key, self.entries, self.n_parts, self.plan_args,
                                    self.settings_id, self.path, start, prepared, retries=2, pure=False)
        self.meta[future] = (start, labels, sources)
        self.queue.add(future)
        while self.queue.count() >= self.limit:
            self._record(next(self.queue))

    def _record(self, future: Any) -> None:
        start, labels, sources = self.meta.pop(future)
        arrays = future.result()
        arrays.update(label=labels, source=sources)
        writer = self.get_writer()
        writer.grow(start + len(labels))
        writer.write_meta(start, arrays)
        self.bar.update(len(labels))

    def wait(self) -> None:
        """Record every submitted batch as it finishes (a batch that failed all its tries raises here)."""
        for future in self.queue:
            self._record(future)

    def close(self) -> None:
        for future in list(self.meta):
            future.cancel()
        try:
            self.client.unregister_worker_plugin(self.plugin_name)
        except Exception:  # a Client closing meanwhile: its workers go with their models
            pass
