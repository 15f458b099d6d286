"""Item 6: trace_many throughput and memory flatness, measured by :mod:`benchmarks.trace_many`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.suite import Config


def bench_trace_many(cfg: Config) -> dict:
    """Item 6: trace_many throughput and memory flatness, from :mod:`benchmarks.trace_many`.

    Example:
        >>> bench_trace_many(cfg)["status"]  # doctest: +SKIP
        'ok'
    """
    try:
        from benchmarks import trace_many

        return trace_many.run(quick=cfg.quick, device=cfg.device)
    except Exception as exc:  # a broken optional item must not lose the rest of the run
        return {"status": "error", "note": f"{type(exc).__name__}: {exc}"[:800]}
