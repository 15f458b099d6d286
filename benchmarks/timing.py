"""Timing helpers for side-by-side measurements: one call, interleaved rounds, medians and paired ratios.

Candidates are interleaved (A, B, C, A, B, C, ... with the order rotated every round) and medians are reported,
so that ratios stay meaningful on a busy machine: what counts is how two things compare when measured side by side.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch


def sync(device: str) -> None:
    """Wait for queued CUDA work, so that a timer around it measures the work and not its launch.

    Example:
        >>> sync("cpu")  # nothing to wait for on the CPU
    """
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_both(fn: Callable[[], object], device: str = "cpu", collect: bool = True) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one call of ``fn`` (CUDA work synchronised on both sides); the
    result is dropped. With ``collect`` a garbage collection runs first, outside the timer. On a busy machine
    CPU time shows how much of the wall time was spent computing rather than waiting for a core.

    Example:
        >>> wall, cpu = timed_both(lambda: sum(range(10)))
        >>> wall >= 0 and cpu >= 0
        True
    """
    if collect:
        gc.collect()
    sync(device)
    c0 = time.process_time()
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    del out
    return wall, cpu


def timed(fn: Callable[[], object], device: str = "cpu", collect: bool = True) -> float:
    """Wall-clock seconds of one call of ``fn`` (see :func:`timed_both`).

    Example:
        >>> timed(lambda: sum(range(10))) >= 0
        True
    """
    return timed_both(fn, device, collect)[0]


class Samples(dict):
    """Wall-clock seconds per candidate, one per round; ``cpu`` holds the process CPU seconds alike."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu: dict[str, list[float]] = {}

    def extend(self, other: Samples) -> None:
        """Append the rounds of ``other`` to the candidates both have."""
        for name, values in other.items():
            self.setdefault(name, []).extend(values)
            self.cpu.setdefault(name, []).extend(other.cpu[name])

    def stats(self, name: str) -> dict:
        """:func:`stats` of one candidate, wall and CPU."""
        return stats(self[name], self.cpu.get(name))


def interleave(candidates: dict[str, Callable[[], object]], repeats: int, device: str = "cpu",
               burst: dict[str, int] | None = None) -> Samples:
    """Time every candidate once per round, rotating the order each round; a candidate with a ``burst`` of n
    is called n times per round and contributes the median of those. Returns seconds per round.

    Example:
        >>> s = interleave({"a": lambda: 1, "b": lambda: 2}, repeats=3)
        >>> [len(v) for v in s.values()], len(s.cpu["a"])
        ([3, 3], 3)
    """
    names = list(candidates)
    burst = burst or {}
    samples = Samples()
    for name in names:
        samples[name], samples.cpu[name] = [], []
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            # One collection per burst: a full gc costs more than a small cam() call.
            pairs = [timed_both(candidates[name], device, collect=i == 0) for i in range(burst.get(name, 1))]
            samples[name].append(statistics.median(p[0] for p in pairs))
            samples.cpu[name].append(statistics.median(p[1] for p in pairs))
    return samples


def stats(samples: list[float], cpu: list[float] | None = None) -> dict:
    """Median, min, max and count of wall-clock samples (seconds), the samples, and the median CPU seconds.

    Example:
        >>> stats([3.0, 1.0, 2.0])["median_s"]
        2.0
    """
    out = {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
           "n": len(samples), "samples_s": [round(v, 6) for v in samples]}
    if cpu:
        out["cpu_median_s"] = statistics.median(cpu)
    return out


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of ``num[i] / den[i]``: each pair was measured side by side, under the same load.

    Example:
        >>> paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0])
        2.0
    """
    return statistics.median(a / b for a, b in zip(num, den))
