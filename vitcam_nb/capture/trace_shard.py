""":func:`vitcam_nb.trace_many` sharded over a dask.distributed Client: the first batch runs in the calling
process (it shapes the store); each later batch runs on a worker, which loads the model once
(:mod:`vitcam_nb.capture.worker_model`: a timm spec and safetensors weights, never pickled), traces the batch with
the pass of ``trace_many`` and writes the batch's own chunks of the large arrays (one image per chunk: no two
writers on one chunk). The calling process holds the store's lock, lengthens the store before a batch is sent,
and writes each finished batch's per-image facts and ``done`` flags (their chunks hold many images). A batch that
raises is retried (twice) on any worker, and one whose worker dies is run again on another (the scheduler's
``distributed.scheduler.allowed-failures`` deaths, default 3); either way its chunks are rewritten whole, and it
is marked done only once written, so the store equals, array for array, the one a single process writes. A batch
writes only while the call that sent it holds the store's lock (:func:`vitcam_nb.capture.worker_model.sender_writes`):
one still running after its call stopped writes nothing.

Example:
    >>> from vitcam_nb.capture.worker_model import active_client
    >>> active_client() is None  # no Client running here: trace_many runs in this process
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import xarray as xr

from vitcam_nb.capture.inputs import Item
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.runtime import exclusive, on_device
from vitcam_nb.capture.store import TRACE_VARS, Store, runs
from vitcam_nb.capture.store_layout import stack_images
from vitcam_nb.capture.trace_checksum import with_checksums
from vitcam_nb.capture.worker_model import ModelSending, loaded_model, sender_writes
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.provenance import settings_id

__all__ = ["TraceSharder", "write_traces"]


def write_traces(path: str, batch: xr.Dataset) -> list[str]:
    """Write a batch's large arrays (one image per chunk) at its image indices; the names written.

    Example:
        >>> write_traces("traces.zarr", batch)  # doctest: +SKIP
        ['act', 'grad', 'attn', 'attn_grad', 'logits', 'image_pixels']
    """
    import zarr

    group = zarr.open_group(path, mode="r+")
    indices = [int(i) for i in batch["image"].values]
    names = [k for k in TRACE_VARS if k in batch.variables and "image" in batch[k].dims]
    for name in names:
        values = batch[name].values
        for run in runs(indices):
            start = indices[run[0]]
            group[name][start:start + len(run)] = values[run]
    return names


def _worker_traces(steps: tuple[Callable, Callable], key: str, plan_args: dict, settings_id_: str, path: str,
                   indices: list[int], items: list[Item], masks: list, prepared: list, names: list[str],
                   token: str) -> tuple[xr.Dataset, list[str]]:
    """One batch on a worker: the pass, its large arrays written (while the call of lock ``token`` still holds the
    store); the rest of the batch and what was written.
    ``steps``: trace_many's batch pass and store settings (handed in: trace_many imports this module)."""
    trace_batch, store_settings = steps
    model, device, lock = loaded_model(key)
    with lock:
        plan = TracePlan.for_store(model, plan_args["targets"], sites=plan_args["sites"], layers=plan_args["layers"],
                                   dtype=plan_args["dtype"], device=device, labels=plan_args["labels"],
                                   rule=plan_args["rule"])
        if settings_id(store_settings(plan)) != settings_id_:
            raise TraceError("worker_model: the model on this worker gives other store settings than the caller's")
        # How the pass holds memory, as the caller chose it for this batch against the budget (the same values).
        plan.recompute, plan.target_groups = plan_args["recompute"], plan_args["target_groups"]
        with exclusive(plan.model), on_device(plan.model, plan.run_device):
            per = trace_batch(plan, prepared)
    batch = with_checksums(stack_images(per, indices, items, masks, names))  # hashed here, as written here
    with sender_writes(path, token):
        written = write_traces(path, batch)
    return batch.drop_vars(written), written


class TraceSharder:
    """Sends trace_many's batches to the Client's workers and records each finished batch in the store.

    Example:
        >>> shard = TraceSharder(client, model, plan, "top5", None, None, bar, (batch_pass, store_settings),
        ...                      lock.token)  # doctest: +SKIP
    """

    def __init__(self, client: Any, model: Any, plan: TracePlan, targets: Any, labels: Sequence[str] | None,
                 worker_model: dict | None, bar: Any, steps: tuple[Callable, Callable], lock_token: str) -> None:
        from distributed import as_completed

        self.steps = steps  # (the batch pass, the store settings) of trace_many; functions travel by name
        # The workers load the model while this process traces the first batch (it shapes the store).
        self.sending = ModelSending(client, model, worker_model, str(plan.run_device), "trace_many")
        self.client, self.bar, self.plan = client, bar, plan
        self.token = lock_token  # the caller's store lock: a batch writes only while it is held
        self.plan_args = {"targets": targets, "sites": plan.site_ids, "layers": plan.layer_ids, "dtype": plan.dtype,
                          "labels": None if labels is None else list(labels), "rule": plan.rule}
        self.settings_id = settings_id(steps[1](plan))
        self.queue = as_completed()
        self.meta: dict[Any, Store] = {}
        self.limit = 2 * max(1, len(client.scheduler_info(n_workers=-1).get("workers", {})) or 1)

    def submit(self, store: Store, indices: list[int], items: list[Item], masks: list, prepared: list,
               names: list[str]) -> None:
        """Send one batch (the store lengthened first, so that its worker writes inside it)."""
        store.grow(max(indices) + 1)
        light = [Item(None, it.label, None, it.source) for it in items]  # the pixels travel prepared, once
        key, _ = self.sending.names()
        # The memory mode trace_many's budget chose for this batch (plan.recompute and plan.target_groups, set by
        # fit_budget).
        plan_args = {**self.plan_args, "recompute": bool(self.plan.recompute),
                     "target_groups": int(self.plan.target_groups)}
        future = self.client.submit(_worker_traces, self.steps, key, plan_args, self.settings_id,
                                    str(store.path), indices, light, masks, prepared, names, self.token, retries=2,
                                    pure=False)
        self.meta[future] = store
        self.queue.add(future)
        while self.queue.count() >= self.limit:
            self._record(next(self.queue))

    def _record(self, future: Any) -> None:
        store = self.meta.pop(future)
        rest, written = future.result()
        store.write(rest, written=written)
        self.bar.update(rest.sizes["image"])

    def wait(self) -> None:
        """Record every submitted batch as it finishes (a batch that failed all its tries raises here)."""
        for future in self.queue:
            self._record(future)

    def close(self) -> None:
        for future in list(self.meta):
            future.cancel()
        self.sending.drop()
