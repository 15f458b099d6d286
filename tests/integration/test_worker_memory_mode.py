"""A sharded trace_many's workers hold memory as the calling process chose against the budget (issue #35, item 4):
the caller's ``fit_budget`` picks, batch by batch, whether the pass recomputes each block inside the backward pass
and into how many groups it splits its targets (the same values, less memory); each worker's pass does as
chosen, where it used to keep the whole graph."""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from worker_runs import BATCH, SPEC, random_images, store_arrays, tiny_model

import vitcam_nb as vc
from vitcam_nb.capture.budget import estimate_plan, fit_budget
from vitcam_nb.capture.plan import TracePlan

distributed = pytest.importorskip("distributed")
ARGS = dict(targets="top3", sites=["F1", "F4"], layers=[-1], batch_size=BATCH, progress=False)


class RecordMemoryMode(distributed.WorkerPlugin):
    """Appends each worker pass's memory mode (trace_many's batch pass) to ``path``: R (recompute) or P (plain)
    and its target groups, two characters a batch."""

    def __init__(self, path: str) -> None:
        self.path = path

    def setup(self, worker) -> None:
        module = importlib.import_module("vitcam_nb.capture.trace_many")
        real, path = module._trace_batch, Path(self.path)

        def recorded(plan, prepared):
            with path.open("a") as f:
                f.write(f"{'R' if plan.recompute else 'P'}{plan.target_groups}")
            return real(plan, prepared)

        recorded.__wrapped__ = real
        module._trace_batch = recorded

    def teardown(self, worker) -> None:
        module = importlib.import_module("vitcam_nb.capture.trace_many")
        module._trace_batch = getattr(module._trace_batch, "__wrapped__", module._trace_batch)


def _budget_only_grouping_fits(model) -> float:
    """A max_bytes between the estimated peak of the pass recomputing each block with its four targets in two
    groups and that of the plain pass (the Dataset of the batch included, as trace_many counts it): only the
    grouped pass fits."""
    plan = TracePlan.for_store(model, ARGS["targets"], sites=ARGS["sites"], layers=ARGS["layers"], dtype="float32",
                               device=None, labels=None)

    def total(recompute: bool, groups: int) -> int:
        e = estimate_plan(replace(plan, recompute=recompute, target_groups=groups), (32, 32), BATCH)
        return e["peak_bytes"] + e["dataset_bytes"]

    grouped, others = total(True, 2), (total(False, 1), total(True, 1))
    assert grouped < min(others)
    budget = (grouped + min(others)) / 2
    fit_budget(plan, (32, 32), budget, batch=BATCH, stacked=True)
    assert (plan.recompute, plan.target_groups) == (True, 2)  # the caller's own choice under this budget
    return budget


@pytest.mark.slow
def test_each_worker_pass_holds_memory_as_the_callers_budget_chose(tmp_path):
    import cloudpickle

    model, images = tiny_model(), random_images()
    budget = _budget_only_grouping_fits(model)
    whole = vc.trace_many(model, images, tmp_path / "whole.zarr", max_bytes=budget, **ARGS)
    record = tmp_path / "modes.txt"
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the plugin travels by value
    try:
        with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                                      silence_logs=50) as cluster, distributed.Client(cluster) as client:
            client.register_plugin(RecordMemoryMode(str(record)), name="record-mode")
            path = vc.trace_many(model, images, tmp_path / "cluster.zarr", max_bytes=budget, worker_model=SPEC,
                                 **ARGS)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    # The first batch runs in the calling process; the two others on the worker, both recomputing in two groups.
    assert record.read_text() == "R2R2"
    got, want = store_arrays(path), store_arrays(whole)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
