"""Side-by-side measurements of vitcam_nb against plain PyTorch, pytorch-grad-cam and torchcam (issue #11).

Everything runs in one process (the memory peaks in fresh subprocesses), candidates are interleaved
(A, B, C, A, B, C, ... with the order rotated every round) and medians are reported, so that ratios stay
meaningful on a busy machine: what counts is how two things compare when measured side by side.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks import peers, workloads

SCHEMA = 1
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
GALLERY_SITES = ("F1", "F3", "F4", "F5", "F6")
TARGETS = {
    "trace_ratio": ("trace() / (forward + K+1 autograd.grad), K=5", "<=", 1.25),
    "single_variant_speedup": ("pytorch-grad-cam GradCAM / vc.cam(), one variant", ">=", 500.0),
    "gallery_seconds": ("vc.gallery(), 12 layers x 5 sites (60 maps), seconds", "<=", 0.100),
    "stored_bytes_ratio": ("trace Dataset bytes / captured tensors' own bytes", "<=", 1.05),
}
OFFICIAL_MODEL = workloads.VIT_BASE
ITEM_NUMBER = {"trace_cost": 1, "single_variant": 2, "gallery": 3, "memory": 4}
ITEMS = (*ITEM_NUMBER, "widget", "trace_many", "load", "export_html")
#: Items with their own module and JSON file (benchmarks/<NAME>.json), run through that module's command line.
OWN_FILE_ITEMS = {"load": ("benchmarks.load", "LOAD.json"),
                  "export_html": ("benchmarks.export_html", "EXPORT_HTML.json")}


@dataclass
class Config:
    """What to run: ``quick`` is the CI smoke mode (tiny model, few repeats, no timing claims)."""

    quick: bool = False
    out: Path = DEFAULT_OUT
    device: str = "cpu"
    models: tuple[str, ...] = workloads.FULL_MODELS
    repeats: int = 5
    warmup: int = 1
    cam_burst: int = 20
    gallery_burst: int = 5
    gallery_loop_repeats: int = 2
    k: int = 5
    memory: bool = True
    widget: bool = True
    threads: int = 0
    command: str = "python -m benchmarks"
    results_copy: bool = True
    items: tuple[str, ...] | None = None
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))


# -- timing ------------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
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
    _sync(device)
    c0 = time.process_time()
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
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


# -- machine and versions -----------------------------------------------------------------------------------
def machine_info(device: str) -> dict:
    """CPU model, cores, load average, memory, torch threads and, on CUDA, the GPU name.

    Example:
        >>> "cpu_model" in machine_info("cpu")
        True
    """
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info = {
        "cpu_model": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "memory_total_bytes": mem,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def versions() -> dict:
    """Versions of everything measured.

    Example:
        >>> "torch" in versions()
        True
    """
    from importlib import metadata

    out = {}
    for dist in ("vitcam_nb", "torch", "timm", "numpy", "xarray", "h5netcdf", "grad-cam", "torchcam"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


# -- 1. trace cost ---------------------------------------------------------------------------------------------
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
            _sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(device)
                acc[label] += time.perf_counter() - t0
        return inner

    # (module where the name is looked up at call time, name) -> phase
    patched = {
        ("vitcam_nb.capture.trace", "prepare_input"): "preprocessing",
        ("vitcam_nb.targets.classes", "class_labels"): "class labels",
        ("vitcam_nb.capture.trace", "assemble"): "assembly",
        ("vitcam_nb.capture.assemble", "to_numpy"): "assembly: to_numpy (torch -> numpy view)",
        ("vitcam_nb.capture.assemble", "weights_sha256"): "assembly: weights hash",
        ("vitcam_nb.capture.assemble", "array_sha256"): "assembly: input hash",
    }
    originals = {(mod, name): getattr(importlib.import_module(mod), name) for mod, name in patched}
    grad = torch.autograd.grad
    start: list[float] = []

    def pre(_m: object, _args: object) -> None:
        _sync(device)
        start.append(time.perf_counter())

    def post(_m: object, _args: object, _out: object) -> None:
        _sync(device)
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
            _sync(device)
            t0 = time.perf_counter()
            tr = vc.trace(model, x, targets=f"top{k}", device=device)
            _sync(device)
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
        _sync(dev)
        t0 = time.perf_counter()
        tr = vc.trace(model, x_trace, targets=f"top{k}", device=dev)
        _sync(dev)
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


# -- 2. one variant ----------------------------------------------------------------------------------------
def _clear_cam_caches() -> None:
    from vitcam_nb.compute.report import clear_reports
    from vitcam_nb.compute.view import clear_views

    clear_reports()
    clear_views()


def bench_single_variant(w: workloads.Workload, tr: object, peer_models: dict, cfg: Config) -> dict:
    """Item 2: one variant via vc.cam() against pytorch-grad-cam (and torchcam) computing the same variant."""
    import vitcam_nb as vc

    recipe = vc.presets.pytorch_grad_cam_vit()
    top1 = int(np.argmax(tr["logits"].values))
    size = (int(w.x.shape[-2]), int(w.x.shape[-1]))
    last = len(w.model.blocks) - 1
    pgc_model = peer_models["pgc_layers"][0]
    pgc_cam = peers.pgc_gradcam(pgc_model, [pgc_model.blocks[last].norm1])
    candidates: dict[str, Callable[[], object]] = {
        "vc_cam": lambda: vc.cam(tr, recipe),
        "vc_cam_cold_caches": lambda: (_clear_cam_caches(), vc.cam(tr, recipe))[1],
        "pytorch_grad_cam": lambda: peers.pgc_map(pgc_cam, w.x, top1),
    }
    tc_ext = None
    if peer_models.get("torchcam_layers") is not None:
        tc_model = peer_models["torchcam_layers"][0]
        tc_ext = peers.torchcam_gradcam(tc_model, [f"blocks.{last}.norm1"])
        candidates["torchcam"] = lambda: peers.torchcam_maps(tc_ext, tc_model, w.x, top1, size)
    try:
        ours = vc.cam(tr, recipe).values
        agreement = {"pytorch_grad_cam_max_abs_diff": float(np.abs(ours - peers.pgc_map(pgc_cam, w.x, top1)).max())}
        if tc_ext is not None:
            theirs = candidates["torchcam"]()[0].detach().cpu().numpy()
            agreement["torchcam_max_abs_diff"] = float(np.abs(ours - theirs).max())
        for _ in range(cfg.warmup):
            for fn in candidates.values():
                timed(fn, cfg.device)
        burst = {"vc_cam": cfg.cam_burst, "vc_cam_cold_caches": cfg.cam_burst}
        s = interleave(candidates, cfg.repeats, cfg.device, burst)
    finally:
        pgc_cam.activations_and_grads.release()
        if tc_ext is not None:
            tc_ext.remove_hooks()
    out = {
        "recipe": "presets.pytorch_grad_cam_vit()",
        "recipe_id": recipe.id,
        "class": top1,
        "what": "GradCAM on blocks[-1].norm1 output (F1), CLS dropped, logit of the top-1 class, ReLU, min-max, "
                f"bilinear to {size[0]}x{size[1]}",
        **{name: s.stats(name) for name in s},
        "speedup_vs_pytorch_grad_cam": paired_ratio(s["pytorch_grad_cam"], s["vc_cam"]),
        "speedup_vs_pytorch_grad_cam_cold_caches": paired_ratio(s["pytorch_grad_cam"], s["vc_cam_cold_caches"]),
        "agreement": agreement,
        "timing_note": (f"vc_cam: median of a burst of {cfg.cam_burst} calls per round (warm per-trace view and "
                        "checklist caches); vc_cam_cold_caches: both caches cleared before every call; peers: one "
                        "call per round (forward + backward + map), extractor built once outside the timer"),
    }
    if "torchcam" in s:
        out["speedup_vs_torchcam"] = paired_ratio(s["torchcam"], s["vc_cam"])
    cfg.log(f"    cam {out['vc_cam']['median_s'] * 1e3:.2f} ms, pgc {out['pytorch_grad_cam']['median_s']:.3f} s, "
            f"speedup {out['speedup_vs_pytorch_grad_cam']:.0f}x")
    return out


# -- 3. gallery ----------------------------------------------------------------------------------------------
def _peer_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, list[tuple[int, str, torch.nn.Module, str]], str]:
    """A private copy of ``model`` for a peer and its (layer, site, module, name) list in execution order."""
    peer = copy.deepcopy(model)
    try:
        for blk in peer.blocks:
            peers.peer_module(blk, "F3")
        how = peers.peer_module(peer.blocks[0], "F3")[1]
    except ValueError:
        peer = peers.wrap_proj_input(model)
        how = "attn.proj wrapped as Sequential(Identity, proj); the Identity's output (= F3) is hooked"
    names = {id(m): n for n, m in peer.named_modules()}
    layers = []
    for li, blk in enumerate(peer.blocks):
        for site in GALLERY_SITES:
            module = blk.attn.proj[0] if site == "F3" and isinstance(blk.attn.proj, torch.nn.Sequential) \
                else peers.peer_module(blk, site)[0]
            layers.append((li, site, module, names[id(module)]))
    return peer, layers, how


def bench_gallery(w: workloads.Workload, tr: object, peer_models: dict, cfg: Config) -> dict:
    """Item 3: the 12 x 5 gallery via vc.gallery() against pytorch-grad-cam looping over the same variants,
    pytorch-grad-cam in one pass, and torchcam with every layer hooked at once (one backward)."""
    import vitcam_nb as vc

    recipe = vc.presets.pytorch_grad_cam_vit()
    vary = {"layer": "all", "site": list(GALLERY_SITES)}
    top1 = int(np.argmax(tr["logits"].values))
    size = (int(w.x.shape[-2]), int(w.x.shape[-1]))
    n_layers = len(w.model.blocks)
    pgc_model, layers, f3_how = peer_models["pgc_layers"]

    def pgc_loop() -> np.ndarray:
        maps = []
        for _li, _site, module, _name in layers:
            with peers.pgc_gradcam(pgc_model, [module]) as cam:
                maps.append(peers.pgc_map(cam, w.x, top1))
        return np.stack(maps)

    pgc_all = peers.pgc_gradcam(pgc_model, [m for _, _, m, _ in layers])
    candidates: dict[str, Callable[[], object]] = {
        "vc_gallery": lambda: vc.gallery(tr, recipe, vary=vary),
        "vc_gallery_cold_caches": lambda: (_clear_cam_caches(), vc.gallery(tr, recipe, vary=vary))[1],
        "pytorch_grad_cam_loop": pgc_loop,
        "pytorch_grad_cam_one_pass": lambda: peers.pgc_per_layer(pgc_all, w.x, top1),
    }
    tc_ext = None
    if peer_models.get("torchcam_layers") is not None:
        tc_model, tc_layers, _ = peer_models["torchcam_layers"]
        tc_ext = peers.torchcam_gradcam(tc_model, [name for _, _, _, name in tc_layers])
        candidates["torchcam_one_pass"] = lambda: peers.torchcam_maps(tc_ext, tc_model, w.x, top1, size)
    try:
        ours = vc.gallery(tr, recipe, vary=vary).transpose("layer", "site", ...).values.reshape(-1, *size)
        agreement = {}
        for name in candidates:
            if name.startswith("vc_gallery"):
                continue
            theirs = candidates[name]()
            theirs = theirs.detach().cpu().numpy() if isinstance(theirs, torch.Tensor) else theirs
            diff = np.abs(ours - theirs).reshape(len(layers), -1).max(axis=1)
            agreement[name] = {"max_abs_diff": float(diff.max()), "maps_differing_by_more_than_1e-3":
                               int((diff > 1e-3).sum())}
        for _ in range(cfg.warmup):  # the loop's warm-up was the agreement run above
            for name, fn in candidates.items():
                if name != "pytorch_grad_cam_loop":
                    timed(fn, cfg.device)
        loop = {"pytorch_grad_cam_loop": candidates.pop("pytorch_grad_cam_loop")}
        burst = {"vc_gallery": cfg.gallery_burst, "vc_gallery_cold_caches": cfg.gallery_burst}
        s = interleave({**candidates, **loop}, cfg.gallery_loop_repeats, cfg.device, burst)
        extra = interleave(candidates, max(0, cfg.repeats - cfg.gallery_loop_repeats), cfg.device, burst)
    finally:
        pgc_all.activations_and_grads.release()
        if tc_ext is not None:
            tc_ext.remove_hooks()
    s.extend(extra)
    n_loop = len(s["pytorch_grad_cam_loop"])
    out = {
        "variants": len(layers),
        "layers": n_layers,
        "sites": list(GALLERY_SITES),
        "recipe": "presets.pytorch_grad_cam_vit() with vary={'layer': 'all', 'site': ['F1','F3','F4','F5','F6']}",
        **{name: s.stats(name) for name in s},
        "speedup_vs_pytorch_grad_cam_loop": paired_ratio(s["pytorch_grad_cam_loop"], s["vc_gallery"][:n_loop]),
        "speedup_vs_pytorch_grad_cam_one_pass": paired_ratio(s["pytorch_grad_cam_one_pass"], s["vc_gallery"]),
        "speedup_vs_pytorch_grad_cam_one_pass_cold_caches": paired_ratio(s["pytorch_grad_cam_one_pass"],
                                                                         s["vc_gallery_cold_caches"]),
        "agreement": agreement,
        "f3_hook": f"peers hook module outputs only; F3 (input of attn.proj) is read as {f3_how}",
        "timing_note": (f"vc_gallery: median of a burst of {cfg.gallery_burst} calls per round (warm per-trace view, "
                        "with the activation norms the first map on each (layer, site) keeps, and checklist caches); "
                        "vc_gallery_cold_caches: the same with both caches cleared before every call; "
                        "pytorch_grad_cam_loop: its public API once per variant (a GradCAM per layer, forward + "
                        "backward each), measured in fewer rounds because one round is 60 model passes; "
                        "pytorch_grad_cam_one_pass: all layers hooked, one forward + backward, per-layer maps via "
                        "compute_cam_per_layer (its __call__ would average the layers); torchcam_one_pass: all "
                        "layers hooked, one forward, one autograd.grad over all of them with retain_graph=True, "
                        "then bilinear upsampling + min-max (torchcam returns grid-sized maps)"),
    }
    if "torchcam_one_pass" in s:
        out["speedup_vs_torchcam_one_pass"] = paired_ratio(s["torchcam_one_pass"], s["vc_gallery"])
        out["speedup_vs_torchcam_one_pass_cold_caches"] = paired_ratio(s["torchcam_one_pass"],
                                                                        s["vc_gallery_cold_caches"])
    cfg.log(f"    gallery {out['vc_gallery']['median_s'] * 1e3:.1f} ms, pgc loop "
            f"{out['pytorch_grad_cam_loop']['median_s']:.2f} s, "
            f"one pass {out['pytorch_grad_cam_one_pass']['median_s']:.2f} s")
    return out


# -- 4. memory ---------------------------------------------------------------------------------------------------
def _probes(model_name: str, modes: tuple[str, ...], cfg: Config, k: int) -> dict[str, dict]:
    """Run one memory-probe subprocess per mode, all at once (each measures only its own process)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore"}
    procs = {}
    for mode in modes:
        cmd = [sys.executable, "-m", "benchmarks.memprobe", "--model", model_name, "--mode", mode,
               "--device", cfg.device, "--k", str(k)]
        if cfg.threads:
            cmd += ["--threads", str(cfg.threads)]
        procs[mode] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       cwd=str(ROOT), env=env)
    out = {}
    for mode, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=1800)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            out[mode] = {"status": "error", "note": stderr.strip()[-800:]}
        else:
            out[mode] = {"status": "ok", **json.loads(stdout.strip().splitlines()[-1])}
    return out


def bench_memory(w: workloads.Workload, tr: object, cfg: Config, k: int) -> dict:
    """Item 4: stored bytes against the captured tensors' own bytes, peak RSS, and the netCDF file size."""
    import vitcam_nb as vc

    per_var = {str(name): int(var.nbytes) for name, var in tr.variables.items()}
    stored = sum(per_var.values())
    data = sum(per_var.get(n, 0) for n in ("act", "grad", "attn", "attn_grad"))
    captured = peers.baseline_autograd(w.model, w.x, k)
    own = peers.tensor_bytes(captured)
    del captured
    tmp = Path(tempfile.mkdtemp(prefix="vitcam-bench-"))
    try:
        path = tmp / "x.nc"
        t0 = time.perf_counter()
        vc.save(tr, path)
        save_s = time.perf_counter() - t0
        disk = path.stat().st_size
        t0 = time.perf_counter()
        vc.load(path)
        load_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {
        "stored_bytes": stored,
        "stored_data_bytes": data,
        "tensor_bytes": own,
        "stored_bytes_ratio": stored / own,
        "per_variable_bytes": dict(sorted(per_var.items(), key=lambda kv: -kv[1])),
        "netcdf_bytes": disk,
        "netcdf_over_stored": disk / stored,
        "save_netcdf_s": save_s,
        "load_netcdf_s": load_s,
        "tensor_bytes_description": "numel x itemsize of every activation (F1, F3..F6), attention map (F2) and "
                                    f"gradient ({k + 1} targets) captured by the plain baseline",
    }
    if cfg.memory:
        cfg.log("    memory probes (subprocesses)")
        peaks = _probes(w.name, ("trace", "baseline"), cfg, k)
        trace_peak, base_peak = peaks["trace"], peaks["baseline"]
        out["peak_trace"] = trace_peak
        out["peak_baseline"] = base_peak
        if trace_peak.get("peak_rise_bytes") and base_peak.get("peak_rise_bytes"):
            out["peak_rise_ratio"] = trace_peak["peak_rise_bytes"] / base_peak["peak_rise_bytes"]
    else:
        out["peak_trace"] = out["peak_baseline"] = {"status": "skipped", "note": "--no-memory"}
    return out


# -- 5, 6 --------------------------------------------------------------------------------------------------------
def bench_widget(cfg: Config) -> dict:
    """Item 5: widget latency from ``benchmarks/widget_latency.py`` (another developer's), if it and Chromium exist."""
    if not cfg.widget:
        return {"status": "skipped", "note": "not run (the default in --quick, which must stay under a minute: "
                                             "the widget measurement starts a browser); pass --widget to run it"}
    if not (Path(__file__).resolve().parent / "widget_latency.py").is_file():
        return {"status": "skipped", "note": "benchmarks/widget_latency.py is not there yet"}
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
                   None)
    if browser is None:
        return {"status": "skipped", "note": "no Chromium found on PATH"}
    try:
        from benchmarks import widget_latency

        result = widget_latency.run(quick=cfg.quick)
    except Exception as exc:  # a broken optional item must not lose the rest of the run
        return {"status": "error", "note": f"{type(exc).__name__}: {exc}"[:800]}
    return {"status": "ok", "browser": browser, "result": result}


def bench_trace_many(cfg) -> dict:
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


# -- targets and the run --------------------------------------------------------------------------------------
def evaluate_targets(results: dict) -> list[dict]:
    """One row per (target, measured model): the value, the threshold and whether it holds. ``official`` is
    true for the issue's reference setting (vit_base_patch16_224, full mode). ``cpu_value`` is the same
    figure from process CPU time (medians), which a busy machine inflates much less than wall time; the
    verdict is always on wall time.

    Example:
        >>> evaluate_targets({"quick": True, "models": {}})
        []
    """
    rows = []
    for name, res in results["models"].items():
        if res.get("status") != "ok":
            continue
        tc, sv, g = res["trace_cost"], res["single_variant"], res["gallery"]
        values = {
            "trace_ratio": (tc["ratio_vs_autograd"], _cpu_ratio(tc["trace"], tc["baseline_autograd"])),
            "single_variant_speedup": (sv["speedup_vs_pytorch_grad_cam"],
                                       _cpu_ratio(sv["pytorch_grad_cam"], sv["vc_cam"])),
            "gallery_seconds": (g["vc_gallery"]["median_s"], g["vc_gallery"].get("cpu_median_s")),
            "stored_bytes_ratio": (res["memory"]["stored_bytes_ratio"], None),
        }
        for key, (value, cpu_value) in values.items():
            what, op, threshold = TARGETS[key]
            holds = value <= threshold if op == "<=" else value >= threshold
            rows.append({"target": key, "what": what, "model": name, "value": value, "op": op,
                         "threshold": threshold, "holds": bool(holds), "cpu_value": cpu_value,
                         "official": bool(name == OFFICIAL_MODEL and not results["quick"])})
    return rows


def _cpu_ratio(num: dict, den: dict) -> float | None:
    if num.get("cpu_median_s") is None or not den.get("cpu_median_s"):
        return None
    return num["cpu_median_s"] / den["cpu_median_s"]


def _peer_models(model: torch.nn.Module, with_torchcam: bool) -> dict:
    # Each peer gets its own copy, so no library's hooks ever fire inside another's measurement.
    out = {"pgc_layers": _peer_layers(model)}
    if with_torchcam:
        out["torchcam_layers"] = _peer_layers(model)
    return out


def bench_model(name: str, cfg: Config) -> dict:
    """Items 1-4 on one workload; ``status`` is "skipped" with a note when the workload cannot be built."""
    import vitcam_nb as vc

    try:
        w = workloads.build(name, cfg.device)
    except workloads.Unavailable as exc:
        cfg.log(f"  {name}: skipped ({exc})")
        return {"status": "skipped", "note": str(exc)}
    k = min(cfg.k, int(w.model.num_classes))
    has_tc = peers.torchcam_available()
    cfg.log(f"  {name}: {w.description}")
    out: dict = {"status": "ok", "description": w.description, "k": k, "item_wall_s": {}}
    if cfg.items is None or "trace_cost" in cfg.items:
        t0 = time.perf_counter()
        cfg.log("  1. trace cost")
        out["trace_cost"] = bench_trace_cost(w, cfg, k)
        out["item_wall_s"]["trace_cost"] = time.perf_counter() - t0
    tr = vc.trace(w.model, w.x.detach().cpu(), targets=f"top{k}", device=cfg.device)
    peer_models = _peer_models(w.model, has_tc)
    _settle()
    for item, fn in (("single_variant", lambda: bench_single_variant(w, tr, peer_models, cfg)),
                     ("gallery", lambda: bench_gallery(w, tr, peer_models, cfg)),
                     ("memory", lambda: bench_memory(w, tr, cfg, k))):
        if cfg.items is not None and item not in cfg.items:
            continue
        if item == "memory":
            peer_models.clear()
            gc.collect()
        t0 = time.perf_counter()
        cfg.log(f"  {ITEM_NUMBER[item]}. {item.replace('_', ' ')}")
        out[item] = fn()
        out["item_wall_s"][item] = time.perf_counter() - t0
        cfg.log(f"    ({out['item_wall_s'][item]:.1f} s)")
    if not has_tc:
        out["note"] = "torchcam is not installed (or older than 0.5, without reshape_transform): its columns are absent"
    return out


def run(cfg: Config) -> dict:
    """Run every item, write ``latest.json`` and ``latest.md`` under ``cfg.out`` (and, in full mode, the
    committed copies ``benchmarks/RESULTS.json`` / ``RESULTS.md``); return the results dict."""
    from benchmarks import report

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    results: dict = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": cfg.command,
        "quick": cfg.quick,
        "device": cfg.device,
        "machine": machine_info(cfg.device),
        "versions": versions(),
        "settings": {"repeats": cfg.repeats, "warmup": cfg.warmup, "cam_burst": cfg.cam_burst,
                     "gallery_burst": cfg.gallery_burst, "gallery_loop_repeats": cfg.gallery_loop_repeats,
                     "k": cfg.k, "models": list(cfg.models)},
        "models": {},
    }
    cfg.log(f"vitcam_nb benchmarks ({'quick' if cfg.quick else 'full'}) on {cfg.device}; "
            f"load average {results['machine']['load_average_start']}")
    _settle()
    model_items = cfg.items is None or any(i in ITEM_NUMBER for i in cfg.items)
    with warnings.catch_warnings():
        from vitcam_nb.core.errors import DegenerateMapWarning

        warnings.simplefilter("ignore", DegenerateMapWarning)
        for name in cfg.models if model_items else ():
            results["models"][name] = bench_model(name, cfg)
    if cfg.items is not None:
        return _run_items(cfg, results, started)
    cfg.log("  5. widget latency")
    results["widget_latency"] = bench_widget(cfg)
    results["trace_many"] = bench_trace_many(cfg)
    results["targets"] = evaluate_targets(results)
    results["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results["wall_s"] = time.perf_counter() - started
    results["derived"] = report.derived(results)
    results["notes"] = report.notes(results)
    cfg.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, default=_json_default)
    (cfg.out / "latest.json").write_text(text + "\n")
    markdown = report.markdown(results)
    (cfg.out / "latest.md").write_text(markdown)
    if not cfg.quick and cfg.results_copy:
        here = Path(__file__).resolve().parent
        (here / "RESULTS.json").write_text(text + "\n")
        (here / "RESULTS.md").write_text(markdown)
    cfg.log(f"done in {results['wall_s']:.0f} s; wrote {cfg.out / 'latest.json'}")
    return results


def merge_items(base: dict, part: dict) -> dict:
    """``base`` (a full run's results) with the items of a partial run ``part`` replacing its own; each merged
    item is listed under ``partial_updates`` with the date and command that produced it.

    Example:
        >>> base = {"models": {"m": {"status": "ok", "gallery": {"x": 1}, "memory": {"y": 2}}}}
        >>> part = {"created": "t", "command": "c", "models": {"m": {"status": "ok", "gallery": {"x": 3}}}}
        >>> merged = merge_items(base, part)
        >>> merged["models"]["m"]["gallery"], merged["models"]["m"]["memory"], merged["partial_updates"][0]["item"]
        ({'x': 3}, {'y': 2}, 'm/gallery')
    """
    merged = json.loads(json.dumps(base, default=_json_default))
    updates = merged.setdefault("partial_updates", [])
    for name, res in part.get("models", {}).items():
        if res.get("status") != "ok":
            continue
        target = merged["models"].setdefault(name, {"status": "ok"})
        for item in ITEM_NUMBER:
            if item in res:
                target[item] = res[item]
                updates.append({"item": f"{name}/{item}", "created": part["created"], "command": part["command"]})
    for key in ("widget_latency", "trace_many"):
        if key in part:
            merged[key] = part[key]
            updates.append({"item": key, "created": part["created"], "command": part["command"]})
    return merged


def _run_items(cfg: Config, results: dict, started: float) -> dict:
    """The end of a run limited to ``cfg.items``: the partial results go to latest.json; in full mode they are
    merged into the committed RESULTS.json / RESULTS.md (whose other items stay as their own run left them)."""
    from benchmarks import report

    if "widget" in cfg.items:
        cfg.log("  5. widget latency")
        results["widget_latency"] = bench_widget(cfg)
    if "trace_many" in cfg.items:
        results["trace_many"] = bench_trace_many(cfg)
    for item, (module, name) in OWN_FILE_ITEMS.items():
        if item in cfg.items:
            cfg.log(f"  {item}: python -m {module} (writes benchmarks/{name})")
            out = Path(__file__).resolve().parent / name
            argv = ["--out", str(out)] + (["--quick"] if cfg.quick and item == "export_html" else [])
            results[item] = {"status": "ok" if _module_main(module)(argv) == 0 else "error", "file": str(out)}
    results["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results["wall_s"] = time.perf_counter() - started
    results["items"] = list(cfg.items)
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "latest.json").write_text(json.dumps(results, indent=2, default=_json_default) + "\n")
    committed = Path(__file__).resolve().parent / "RESULTS.json"
    if not cfg.quick and cfg.results_copy and committed.is_file():
        merged = merge_items(json.loads(committed.read_text()), results)
        merged["targets"] = evaluate_targets(merged)
        merged["derived"] = report.derived(merged)
        merged["notes"] = report.notes(merged)
        committed.write_text(json.dumps(merged, indent=2, default=_json_default) + "\n")
        committed.with_suffix(".md").write_text(report.markdown(merged))
    cfg.log(f"done in {results['wall_s']:.0f} s; wrote {cfg.out / 'latest.json'}")
    return results


def _module_main(module: str) -> Callable[[list[str]], int]:
    import importlib

    return importlib.import_module(module).main


def _settle() -> None:
    """Import every library up front and freeze the objects alive now out of the garbage collector's scans:
    pytorch-grad-cam pulls in scikit-learn and SciPy, after which a full collection takes ~0.5 s, which
    the per-measurement ``gc.collect()`` would otherwise pay each time (outside the timers, but slowly)."""
    import pytorch_grad_cam  # noqa: F401
    import pytorch_grad_cam.utils.model_targets  # noqa: F401

    with contextlib.suppress(ImportError):
        import torchcam.methods  # noqa: F401
    gc.collect()
    gc.freeze()


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
