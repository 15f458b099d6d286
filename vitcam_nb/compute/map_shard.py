""":func:`vitcam_nb.map_many` sharded over a dask.distributed Client: each worker loads the model once, computes
whole batches and writes their chunks of the store; the calling process computes the first batch (it shapes the
store) while the workers load the model, then holds the store's lock and writes the per-image facts and ``done``
flags as batches finish.

How the model travels (not pickled: a timm spec and safetensors weights, one device pinned per worker where
GPUs exist) is :mod:`vitcam_nb.capture.worker_model`'s, shared with ``trace_many``. A batch that raises is retried
(twice) on any worker, and one whose worker dies is run again on another (the scheduler's
``distributed.scheduler.allowed-failures`` deaths, default 3); either way its chunks are rewritten whole, and it
is marked done only once written. A batch writes only while the call that sent it holds the store's lock
(:func:`~vitcam_nb.capture.worker_model.check_sender`): one still running after its call stopped writes nothing.

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
from vitcam_nb.capture.worker_model import ModelSending, active_client, check_sender, loaded_model
from vitcam_nb.compute.map_recipes import Entry, compute_batch
from vitcam_nb.compute.map_torch import compute_batch_torch
from vitcam_nb.compute.map_writer import BIG, write_region
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.provenance import settings_id

__all__ = ["COMPUTE", "Sharder", "active_client"]

#: Each ``map_many(backend=...)``'s batch computation: the pass and every image's maps.
COMPUTE = {"numpy": compute_batch, "torch": compute_batch_torch}


def _worker_batch(key: str, entries: list[Entry], n_parts: int, plan_args: dict, settings_id_: str, path: str,
                  start: int, prepared: list, token: str) -> dict[str, np.ndarray]:
    """One batch on a worker: the pass, the maps, this batch's chunks written (while the call of lock ``token``
    still holds the store); the small arrays returned."""
    model, device, lock = loaded_model(key)
    with lock:
        plan = TracePlan.for_store(model, plan_args["targets"], sites=plan_args["sites"], layers=plan_args["layers"],
                                   dtype=plan_args["dtype"], device=device, labels=plan_args["labels"])
        if settings_id(store_settings(plan)) != settings_id_:
            raise TraceError("worker_model: the model on this worker gives other store settings than the caller's")
        with exclusive(plan.model), on_device(plan.model, plan.run_device):
            arrays, _, _ = COMPUTE[plan_args.get("backend", "numpy")](plan, entries, n_parts, prepared)
    check_sender(path, token)
    write_region(path, start, arrays)
    return {k: v for k, v in arrays.items() if k not in BIG}


class Sharder:
    """Submits batches to the Client's workers and records each finished batch in the store.

    Example:
        >>> shard = Sharder(client, model, plan, entries, 0, "top1", "float32", None, path, None,
        ...                 get_writer, bar, lock.token)  # doctest: +SKIP
    """

    def __init__(self, client: Any, model: torch.nn.Module, plan: TracePlan, entries: list[Entry], n_parts: int,
                 targets: Any, dtype: str, labels: Sequence[str] | None, path: Path, worker_model: dict | None,
                 get_writer: Callable[[], Any], bar: Any, lock_token: str, backend: str = "numpy") -> None:
        from distributed import as_completed

        # The workers load the model while this process computes the first batch (it shapes the store).
        self.sending = ModelSending(client, model, worker_model, str(plan.run_device), "map_many")
        self.client, self.entries, self.n_parts, self.path = client, entries, n_parts, str(path)
        self.plan_args = {"targets": targets, "sites": plan.site_ids, "layers": plan.layer_ids, "dtype": dtype,
                          "labels": None if labels is None else list(labels), "backend": backend}
        self.settings_id = settings_id(store_settings(plan))
        self.get_writer, self.bar = get_writer, bar
        self.token = lock_token  # the caller's store lock: a batch writes only while it is held
        self.queue = as_completed()
        self.meta: dict[Any, tuple[int, np.ndarray, np.ndarray]] = {}
        self.limit = 2 * max(1, len(client.scheduler_info(n_workers=-1).get("workers", {})) or 1)

    def submit(self, start: int, prepared: list, labels: np.ndarray, sources: np.ndarray) -> None:
        key, _ = self.sending.names()
        future = self.client.submit(_worker_batch, key, self.entries, self.n_parts, self.plan_args,
                                    self.settings_id, self.path, start, prepared, self.token, retries=2,
                                    pure=False)
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
        self.sending.drop()
