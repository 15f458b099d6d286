""":func:`vitcam_nb.map_many` sharded over a dask.distributed Client: each worker loads the model once, computes
whole batches and writes their chunks of the store; the calling process computes no batch. It holds the store's
lock, creates the store from the first batch's arrays (the batches sent before it exists hand their maps back, and
the calling process writes them), and writes the per-image facts and ``done`` flags as batches finish.

How the model travels (not pickled: a timm spec and safetensors weights, one device pinned per worker where
GPUs exist) is :mod:`vitcam_nb.capture.worker_model`'s, shared with ``trace_many``. A batch that raises is retried
(twice) on any worker, and one whose worker dies is run again on another (the scheduler's
``distributed.scheduler.allowed-failures`` deaths, default 3); either way its chunks are rewritten whole, and it
is marked done only once written. A batch writes only while the call that sent it holds the store's lock
(:func:`~vitcam_nb.capture.worker_model.sender_writes`): one still running after its call stopped writes nothing.

Example:
    >>> active_client() is None  # no Client running here
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.runtime import exclusive, on_device
from vitcam_nb.capture.trace_many import store_settings
from vitcam_nb.capture.worker_model import ModelSending, active_client, loaded_model, sender_writes
from vitcam_nb.compute.map_recipes import Entry, compute_batch
from vitcam_nb.compute.map_torch import compute_batch_torch
from vitcam_nb.compute.map_writer import BIG, write_region
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.provenance import settings_id

__all__ = ["COMPUTE", "Sharder", "active_client"]

#: Each ``map_many(backend=...)``'s batch computation: the pass and every image's maps.
COMPUTE = {"numpy": compute_batch, "torch": compute_batch_torch}


def _worker_batch(key: str, entries: list[Entry], n_parts: int, plan_args: dict, settings_id_: str, path: str,
                  start: int, prepared: list, token: str, write: bool
                  ) -> tuple[dict[str, np.ndarray], dict, np.ndarray]:
    """One batch on a worker: the pass, the maps, and with ``write`` this batch's chunks written (while the call of
    lock ``token`` still holds the store); returned: the arrays not written, the trace attributes and token kinds
    (what shapes a new store)."""
    model, device, lock = loaded_model(key)
    with lock:
        plan = TracePlan.for_store(model, plan_args["targets"], sites=plan_args["sites"], layers=plan_args["layers"],
                                   dtype=plan_args["dtype"], device=device, labels=plan_args["labels"])
        if settings_id(store_settings(plan)) != settings_id_:
            raise TraceError("worker_model: the model on this worker gives other store settings than the caller's")
        with exclusive(plan.model), on_device(plan.model, plan.run_device):
            arrays, attrs, kinds = COMPUTE[plan_args.get("backend", "numpy")](plan, entries, n_parts, prepared)
    if not write:
        return arrays, attrs, kinds
    with sender_writes(path, token):
        write_region(path, start, arrays)
    return {k: v for k, v in arrays.items() if k not in BIG}, attrs, kinds


class Sharder:
    """Submits batches to the Client's workers and records each finished batch in the store.

    ``get_writer()`` is the store's writer, None until the store exists; ``create(arrays, attrs, kinds)`` creates it
    from the first batch's arrays (not written) and returns its writer.

    Example:
        >>> shard = Sharder(client, model, plan, entries, 0, "top1", "float32", None, path, None,
        ...                 get_writer, create, bar, lock.token)  # doctest: +SKIP
    """

    def __init__(self, client: Any, model: torch.nn.Module, plan: TracePlan, entries: list[Entry], n_parts: int,
                 targets: Any, dtype: str, labels: Sequence[str] | None, path: Path, worker_model: dict | None,
                 get_writer: Callable[[], Any], create: Callable[[dict, dict, np.ndarray], Any], bar: Any,
                 lock_token: str, backend: str = "numpy") -> None:
        from distributed import as_completed

        # Sent now: the workers load the model while this process reads and prepares the first images.
        self.sending = ModelSending(client, model, worker_model, str(plan.run_device), "map_many")
        self.client, self.entries, self.n_parts, self.path = client, entries, n_parts, str(path)
        self.plan_args = {"targets": targets, "sites": plan.site_ids, "layers": plan.layer_ids, "dtype": dtype,
                          "labels": None if labels is None else list(labels), "backend": backend}
        self.settings_id = settings_id(store_settings(plan))
        self.get_writer, self.create, self.bar = get_writer, create, bar
        self.first: Any = None  # the first batch sent: the store is created from its arrays
        self.token = lock_token  # the caller's store lock: a batch writes only while it is held
        self.queue = as_completed()
        self.meta: dict[Any, tuple[int, np.ndarray, np.ndarray]] = {}
        self.limit = 2 * max(1, len(client.scheduler_info(n_workers=-1).get("workers", {})) or 1)

    def submit(self, start: int, prepared: list, labels: np.ndarray, sources: np.ndarray) -> None:
        key, _ = self.sending.names()
        # Before the store exists a worker cannot write into it: it hands its maps back, written here.
        write = self.get_writer() is not None
        future = self.client.submit(_worker_batch, key, self.entries, self.n_parts, self.plan_args,
                                    self.settings_id, self.path, start, prepared, self.token, write, retries=2,
                                    pure=False)
        self.first = future if self.first is None else self.first
        self.meta[future] = (start, labels, sources)
        self.queue.add(future)
        while self.queue.count() >= self.limit:
            self._record(next(self.queue))

    def _record(self, future: Any) -> None:
        if self.get_writer() is None and future is not self.first:
            self._record(self.first)  # the store is the first batch's, whichever batch finishes first
        if future not in self.meta:  # the first batch, recorded already
            return
        start, labels, sources = self.meta.pop(future)
        arrays, attrs, kinds = future.result()
        arrays.update(label=labels, source=sources)
        writer = self.get_writer() or self.create(arrays, attrs, kinds)
        if any(name in arrays for name in BIG):
            write_region(self.path, start, arrays)
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
        self.sending.drop()
