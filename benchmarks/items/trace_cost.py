"""Item 1: trace() against one forward + K+1 single-target gradient passes, with a per-phase breakdown."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from benchmarks import peers, workloads
from benchmarks.timing import interleave, paired_ratio, sync, timed

if TYPE_CHECKING:
    from benchmarks.suite import Config


@contextlib.contextmanager
def phase_timers(model: torch.nn.Module, device: str) -> Iterator[dict[str, float]]:
    """Accumulate seconds per phase of ``vc.trace`` by wrapping its helpers (restored on exit).

    Phases: preprocessing, class labels, forward (model hooks), batched backward (``torch.autograd.grad``),
    assembly (of which numpy conversion, weights hash, input hash). Used for profiling only.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = workloads.build("tiny_vit").model
        >>> with phase_timers(m, "cpu") as acc:
        ...     _ = vc.trace(m, torch.zeros(1, 3, 32, 32), targets="top2")
        >>> acc["forward"] > 0
        True
    """
    import importlib

    acc: dict[str, float] = defaultdict(float)

    def wrap(label: str, fn: Callable) -> Callable:
        def inner(*args: object, **kwargs: object) -> object:
            sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(device)
                acc[label] += time.perf_counter() - t0
        return inner

    # (module where the name is looked up at call time, name) -> phase
    patched = {
        ("vitcam_nb.capture.trace", "prepare_input"): "preprocessing",
        ("vitcam_nb.targets.classes", "class_labels"): "class labels",
        ("vitcam_nb.capture.trace", "assemble"): "assembly",
        ("vitcam_nb.capture.assemble", "to_numpy"): "assembly: to_numpy (torch -> numpy view)",
        # the hash with the weights' origin, from one walk of the state (the origin's check is cached with it)
        ("vitcam_nb.capture.assemble", "weights_facts"): "assembly: weights hash",
        ("vitcam_nb.capture.assemble", "array_sha256"): "assembly: input hash",
    }
    originals = {(mod, name): getattr(importlib.import_module(mod), name) for mod, name in patched}
    grad = torch.autograd.grad
    start: list[float] = []

    def pre(_m: object, _args: object) -> None:
        sync(device)
        start.append(time.perf_counter())

    def post(_m: object, _args: object, _out: object) -> None:
        sync(device)
        acc["forward"] += time.perf_counter() - start.pop()

    handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
    try:
        for (mod, name), fn in originals.items():
            setattr(importlib.import_module(mod), name, wrap(patched[(mod, name)], fn))
        torch.autograd.grad = wrap("batched backward", grad)
        yield acc
    finally:
        torch.autograd.grad = grad
        for (mod, name), fn in originals.items():
            setattr(importlib.import_module(mod), name, fn)
        for h in handles:
            h.remove()


def _breakdown(model: torch.nn.Module, x: torch.Tensor, k: int, device: str, repeats: int) -> dict:
    import vitcam_nb as vc

    rounds = []
    for _ in range(repeats):
        gc.collect()
        with phase_timers(model, device) as acc:
            sync(device)
            t0 = time.perf_counter()
            tr = vc.trace(model, x, targets=f"top{k}", device=device)
            sync(device)
            acc["total"] = time.perf_counter() - t0
        del tr
        rounds.append(dict(acc))
    return _phase_table(rounds)


def _phase_table(rounds: list[dict]) -> dict:
    med = {key: statistics.median(r.get(key, 0.0) for r in rounds) for key in rounds[0]}
    total = med["total"]
    sub = sum(v for key, v in med.items() if key.startswith("assembly: "))
    med["assembly: copies into the stored arrays, coordinates, attrs, Dataset"] = \
        max(0.0, med.get("assembly", 0.0) - sub)
    top = ("preprocessing", "class labels", "forward", "batched backward", "assembly")
    med["other (validation, hooks, hashing of settings)"] = max(0.0, total - sum(med.get(p, 0.0) for p in top))
    return {"median_s": {key: round(v, 6) for key, v in med.items()},
            "fraction_of_total": {key: round(v / total, 4) for key, v in med.items() if key != "total"},
            "n": len(rounds)}


def fault_costs(candidates: dict[str, Callable[[], object]], calls: int = 2) -> dict:
    """Minor page faults and system CPU seconds per call (medians over ``calls``, one candidate after the other):
    what handing freed memory back to the system during a pass costs when its pages are faulted in again.
    ``resource`` is POSIX-only; elsewhere the result is empty.

    Example:
        >>> fault_costs({"noop": lambda: None}, calls=1)["noop"]["minor_faults"] >= 0
        True
    """
    try:
        import resource
    except ImportError:  # Windows
        return {}
    out = {}
    for name, fn in candidates.items():
        faults, system = [], []
        for _ in range(calls):
            gc.collect()
            before = resource.getrusage(resource.RUSAGE_SELF)
            fn()
            after = resource.getrusage(resource.RUSAGE_SELF)
            faults.append(after.ru_minflt - before.ru_minflt)
            system.append(after.ru_stime - before.ru_stime)
        out[name] = {"minor_faults": int(statistics.median(faults)), "system_s": statistics.median(system)}
    return out


def bench_trace_cost(w: workloads.Workload, cfg: Config, k: int) -> dict:
    """Item 1: trace() against one forward + K+1 single-target gradient passes, side by side."""
    import vitcam_nb as vc

    model, x, dev = w.model, w.x, cfg.device
    x_trace = x.detach().cpu()  # vc.trace moves the input to the device itself (see the notes about CUDA input)
    with phase_timers(model, dev) as acc:  # first call: the weights hash is not cached yet
        sync(dev)
        t0 = time.perf_counter()
        tr = vc.trace(model, x_trace, targets=f"top{k}", device=dev)
        sync(dev)
        acc["total"] = time.perf_counter() - t0
    cold = _phase_table([dict(acc)])
    del tr

    def forward() -> object:
        with torch.enable_grad():
            return model(x)

    candidates = {
        "trace": lambda: vc.trace(model, x_trace, targets=f"top{k}", device=dev),
        "baseline_autograd": lambda: peers.baseline_autograd(model, x, k),
        "baseline_backward": lambda: peers.baseline_backward(model, x, k),
        "forward": forward,
    }
    for _ in range(cfg.warmup):
        for fn in candidates.values():
            timed(fn, dev)
    s = interleave(candidates, cfg.repeats, dev)
    ratio = paired_ratio(s["trace"], s["baseline_autograd"])
    cfg.log(f"    trace {statistics.median(s['trace']):.3f} s, baseline {statistics.median(s['baseline_autograd']):.3f}"
            f" s, ratio {ratio:.3f}")
    breakdown = _breakdown(model, x_trace, k, dev, max(1, min(cfg.repeats, 3)))
    faults = fault_costs({name: candidates[name] for name in ("trace", "baseline_autograd")})
    return {
        "k": k,
        "n_targets": k + 1,
        "trace": s.stats("trace"),
        "baseline_autograd": s.stats("baseline_autograd"),
        "baseline_backward": s.stats("baseline_backward"),
        "forward": s.stats("forward"),
        "ratio_vs_autograd": ratio,
        "ratio_vs_autograd_of_medians": statistics.median(s["trace"]) / statistics.median(s["baseline_autograd"]),
        "ratio_vs_backward": paired_ratio(s["trace"], s["baseline_backward"]),
        "ratio_vs_forward": paired_ratio(s["trace"], s["forward"]),
        "first_trace": cold,
        "breakdown": breakdown,
        "page_faults": faults,
        "baseline_description": (
            f"one forward with hooks on F1..F6 of every block (fused_attn=False, as F2 needs), then {k + 1} "
            "torch.autograd.grad calls (top-K logits and the expected logit), each w.r.t. all hooked tensors "
            "with retain_graph=True; baseline_backward: the same with retain_grad() and "
            "loss.backward(retain_graph=True), which also computes parameter gradients; forward: one plain "
            "forward with grad enabled and timm's default attention, for scale"),
    }
