"""How much memory a trace takes, before it is run, and how its pass holds it: the estimate
(:func:`estimate`, whose arithmetic is :mod:`vitcam_nb.capture.budget_peak`), the pass's memory mode, and the
budget a trace refuses to exceed (with the cheapest ways down).

A pass takes the fastest of three memory modes that its estimate allows: the plain pass keeps autograd's graph
of every traced block (the graph starts at the lowest traced layer: :mod:`vitcam_nb.capture.graph_start`);
recomputing each block inside the backward pass (:mod:`vitcam_nb.capture.block_major`) keeps one block's graph and
one target's transients at a time (the blocks go back one target at a time), and is chosen when that lowers the
estimated peak by a quarter or more (few sites or targets); splitting the head's backward pass into groups of two
or three targets too is chosen when the estimated peak is still above :data:`GROUPS_ABOVE` times the Dataset
(float16 storage, few targets, Swin). Every mode stores the same values to float32 rounding (other batch shapes in
the backward, which round otherwise on some CPUs). A trace over its budget takes the fastest mode that fits, and is
refused when none does. A model the estimate does not cover (:func:`estimate` raises) passes the default budget
unchecked, and an explicit ``max_bytes`` for it is refused before the pass, naming the family and what is covered.

Example:
    >>> import timm
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    >>> e = estimate(m, targets="top1", sites=["F1"], layers=[-1])
    >>> e["parts"]["act"], e["parts"]["grad"]  # 1 layer x 1 site x 197 tokens x 192 channels x 4 bytes
    (151296, 302592)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from vitcam_nb.capture.budget_peak import estimate_plan, n_targets
from vitcam_nb.capture.budget_shapes import model_shapes
from vitcam_nb.capture.budget_vlm import is_vlm, vlm_shape
from vitcam_nb.capture.plan import TracePlan, memory_mode, paired_groups
from vitcam_nb.capture.prealloc import writes_arrays
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.rules import DEFAULT_RULE
from vitcam_nb.preprocess import data_config, prepare_input
from vitcam_nb.targets.classes import ClassTargets

__all__ = ["BUDGET_FRACTION", "GROUPS_ABOVE", "GROUPS_BELOW", "RECOMPUTE_BELOW", "available_bytes", "check_max_bytes",
           "estimate", "estimate_plan", "fit_budget", "meminfo_available", "recomputable"]

#: The default budget: this fraction of the memory available when the trace starts.
BUDGET_FRACTION = 0.5


def available_bytes() -> int | None:
    """Memory available to a new allocation (Linux ``MemAvailable``; psutil elsewhere), None if unknown.

    Example:
        >>> available_bytes() is None or available_bytes() > 0
        True
    """
    try:
        with open("/proc/meminfo", "rb") as f:  # bytes, read at once: no decoding line by line on every trace
            found = meminfo_available(f.read())
        if found is not None:
            return found
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def meminfo_available(text: bytes) -> int | None:
    r"""The ``MemAvailable`` bytes of a ``/proc/meminfo`` text (its value is in kB), None without a readable one.

    Example:
        >>> meminfo_available(b"MemTotal:  100 kB\nMemFree:  20 kB\nMemAvailable:   60 kB\n")
        61440
    """
    for line in text.splitlines():
        if line.startswith(b"MemAvailable:"):
            fields = line.split()
            return int(fields[1]) * 1024 if len(fields) > 1 and fields[1].isdigit() else None
    return None


def _input_hw(plan: TracePlan, image: object) -> tuple[int, int]:
    if getattr(plan.adapter, "video", False):  # a clip: the frame size the model was built for (others are refused)
        return plan.adapter.configured_size(plan.model) if image is None else \
            tuple(plan.adapter.prepare_input(plan.model, image).tensor.shape[-2:])
    if image is None:
        size = data_config(plan.model)["input_size"]
        return int(size[-2]), int(size[-1])
    # A family whose input is read with its target's forward arguments prepares it as the trace does (Qwen2-VL's
    # packed pixel_values with the answer's image_grid_thw)
    traced = getattr(plan.adapter, "prepare_traced_input", None) if is_vlm(plan) else None
    prepared = traced(plan.model, image, None, plan.target) if traced is not None else None
    shape = (prepared or prepare_input(plan.model, image)).tensor.shape
    return int(shape[-2]), int(shape[-1])


def estimate(model: torch.nn.Module, image: object = None, targets: object = "top5", *,
             sites: Sequence[str] | str | None = None, layers: int | Sequence[int] | None = None,
             dtype: str = "float32", rule: str = DEFAULT_RULE) -> dict:
    """Memory a :func:`vitcam_nb.trace` with these arguments would take, before running it: the Dataset's
    size (``dataset_bytes``, with ``parts`` per variable) and the peak of the pass (``peak_bytes``, the
    Dataset included), and how the pass holds its memory: whether it recomputes each block inside the backward
    pass, one target at a time through the blocks (``recompute``), and into how many groups of targets the head's
    backward pass goes (``target_groups``), as
    :func:`fit_budget` chooses them (a trace over its budget may also switch to a leaner mode), and that mode in
    words (``memory_mode``, as the trace's ``memory_mode`` attribute records the mode it took). ``image`` sets the
    input size (default: the model's configured size). ``rule``: the backward rule, checked as ``vc.trace`` checks
    it (a rule this model's family does not support is refused by name) and returned under ``rule``.

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> e = vc.estimate(m, targets="top1")
        >>> e["dataset_bytes"] < e["peak_bytes"], e["recompute"], e["target_groups"]
        (True, False, 1)
    """
    plan = TracePlan.for_trace(model, targets, sites=sites, layers=layers, dtype=dtype, rule=rule)
    hw = _input_hw(plan, image)
    peaks = _mode_peaks(plan, hw, 1, lambda p, n: estimate_plan(p, hw, n)["peak_bytes"], True)
    recompute, groups = _chosen_mode(plan, hw, 1, peaks)
    return {**estimate_plan(replace(plan, recompute=recompute, target_groups=groups), hw), "recompute": recompute,
            "target_groups": groups, "memory_mode": memory_mode(recompute, groups), "rule": plan.rule}


#: A mode of the pass: whether it recomputes each block in the backward pass, and its target groups.
Mode = tuple[bool, int]
_PLAIN: Mode = (False, 1)


def _modes(plan: TracePlan, allowed: bool) -> list[Mode]:
    """The memory modes ``plan``'s pass may take, fastest first: the plain pass; recomputing each block, one target
    at a time through the blocks (:func:`recomputable`, where ``allowed``; :mod:`~vitcam_nb.capture.block_major`);
    and that with the head's backward pass in groups of two or three targets
    (:func:`~vitcam_nb.capture.plan.paired_groups`)."""
    modes = [_PLAIN]
    if allowed and recomputable(plan):
        modes.append((True, 1))
        groups = paired_groups(n_targets(plan) + 1)
        if groups > 1:
            modes.append((True, groups))
    return modes


def _mode_peaks(plan: TracePlan, hw: tuple[int, int], batch: int, total: Callable[[TracePlan, int], int],
                allowed: bool, plain: int | None = None) -> dict[Mode, int]:
    """The estimated peak (as ``total`` counts it) of ``plan``'s pass in each mode it may take, fastest first;
    ``plain``: the plain mode's, already counted for this very plan (and batch) by the caller."""
    return {m: plain if m == _PLAIN and plain is not None else total(replace(plan, recompute=m[0],
                                                                             target_groups=m[1]), batch)
            for m in _modes(plan, allowed)}


def _chosen_mode(plan: TracePlan, hw: tuple[int, int], batch: int, peaks: dict[Mode, int]) -> Mode:
    """The mode a pass takes before its budget is looked at: recomputing each block when that lowers the estimated
    peak to :data:`RECOMPUTE_BELOW` of the plain pass's or less; then, if the pass's estimated peak is still above
    :data:`GROUPS_ABOVE` times its Dataset, the head's targets in groups too, when the Dataset is at least half that
    peak (the head's gradients are then a few MB fewer, for 1-2 % more time: ``benchmarks/MEMORY_MODES.json``) or
    when the estimate says grouping lowers the peak to :data:`GROUPS_BELOW` of it or less (one late layer, whose
    Dataset is small beside the head's gradients)."""
    mode = _PLAIN
    if (True, 1) in peaks and peaks[(True, 1)] <= RECOMPUTE_BELOW * peaks[_PLAIN]:
        mode = (True, 1)
    grouped = [m for m in peaks if m[1] > 1]
    if grouped:
        dataset = estimate_plan(plan, hw, batch)["dataset_bytes"]
        peak = estimate_plan(replace(plan, recompute=mode[0], target_groups=mode[1]), hw, batch)["peak_bytes"]
        if peak > GROUPS_ABOVE * dataset and (2 * dataset >= peak or peaks[grouped[0]] <= GROUPS_BELOW * peaks[mode]):
            mode = grouped[0]
    return mode


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def check_max_bytes(max_bytes: object, plan: TracePlan | None = None) -> None:
    """Refuse a ``max_bytes`` that is not a positive number of bytes or None, and, given the ``plan``, an
    explicit ``max_bytes`` for a model the estimate does not cover (a budget it could not honour).

    Example:
        >>> check_max_bytes(2e9)
        >>> check_max_bytes("2GB")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: max_bytes: expected a positive number of bytes or None, got '2GB'
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, float))
                                  or not max_bytes > 0):
        raise TraceError(f"max_bytes: expected a positive number of bytes or None, got {max_bytes!r}")
    if max_bytes is not None and plan is not None:
        try:
            # coverage does not depend on the input size
            vlm_shape(plan) if is_vlm(plan) else model_shapes(plan, (224, 224))
        except TraceError as exc:
            raise _uncovered(plan, max_bytes, exc) from exc


def _uncovered(plan: TracePlan, max_bytes: object, exc: TraceError) -> TraceError:
    reason = str(exc).removeprefix("model: ")
    return TraceError(f"max_bytes: a budget of {max_bytes!r} bytes cannot be honoured for this "
                      f"{type(plan.model).__name__} (family {plan.adapter.family!r}): {reason}. Pass max_bytes=None "
                      "to trace it without a budget check")


def recomputable(plan: TracePlan) -> bool:
    """Whether ``plan``'s pass may recompute each block inside the backward pass
    (:mod:`vitcam_nb.capture.recompute`): a pass on the CPU or with narrower storage (where the estimate follows the
    array pass, :func:`~vitcam_nb.capture.prealloc.writes_arrays`), autograd's own gradient (a backward rule's
    hooks are not run twice), a family whose recomputed traces are tested equal to the plain pass's (to float32
    rounding; :attr:`~vitcam_nb.adapters.Adapter.recomputable`), no sites outside the blocks.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> recomputable(TracePlan.for_trace(m, "top1"))
        True
    """
    return (writes_arrays(plan) and plan.rule == DEFAULT_RULE and getattr(plan.adapter, "recomputable", False)
            and not plan.extra_layers)


#: The pass recomputes each block when that lowers its estimated peak to this share of the plain pass's or less
#: (few sites over many layers: one block's graph at a time instead of every traced block's), or when only then it
#: fits its budget.
RECOMPUTE_BELOW = 0.75
#: A pass whose estimated peak is above this multiple of its Dataset (float16 storage, few targets, Swin) also
#: splits its targets' backward pass into groups, trading time (``benchmarks/MEMORY_MODES.json``) for a peak nearer
#: the Dataset.
GROUPS_ABOVE = 1.3
#: ... when the Dataset is at least half the peak, or when grouping lowers the estimated peak to this share or less
#: (not a small model's, whose peak is mostly the pass's fixed allocations).
GROUPS_BELOW = 0.95


def fit_budget(plan: TracePlan, hw: tuple[int, int], max_bytes: object, batch: int = 1,
               stacked: bool = False, recompute: bool = True) -> None:
    """Choose how ``plan``'s pass holds memory, then refuse it if its estimated peak exceeds ``max_bytes`` (None:
    :data:`BUDGET_FRACTION` of the available memory), naming the estimate and the cheapest ways down.

    The pass recomputes each block inside the backward pass (``plan.recompute``; one more forward pass of the
    blocks, the same values to float32 rounding) when :func:`recomputable` and that lowers its estimated peak to
    :data:`RECOMPUTE_BELOW` of the plain pass's or less; it also splits its targets into groups
    (``plan.target_groups``) when its estimated peak is still above :data:`GROUPS_ABOVE` times its Dataset and the
    Dataset is at least half of it, or grouping lowers it to :data:`GROUPS_BELOW` of that or less; over the
    budget, it takes the fastest of these modes that fits. ``stacked``: the batch's Datasets are also stacked into
    one copy (``trace_many``);
    ``recompute=False``: the caller's pass never recomputes (``map_many``, whose pass keeps its tensors for the
    maps: recomputing there was measured no lower, and slower by about a tenth in the scale benchmark). A model
    the estimate does not cover passes the default budget unchecked and is refused an explicit ``max_bytes``,
    which could not be honoured.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> fit_budget(TracePlan.for_trace(m, "top1"), (224, 224), 10**6)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: max_bytes: this trace needs about ...
        >>> plan = TracePlan.for_trace(m, "top5", sites=["F1"], layers=[-1])
        >>> fit_budget(plan, (224, 224), None)
        >>> plan.recompute, plan.target_groups  # one late layer: one block's graph, one target's transients
        (True, 3)
    """
    check_max_bytes(max_bytes)

    def total(p: TracePlan, n: int) -> int:
        e = estimate_plan(p, hw, n)
        return e["peak_bytes"] + (e["dataset_bytes"] if stacked else 0)

    plan.recompute, plan.target_groups = _PLAIN
    try:
        need = estimate_plan(plan, hw, batch)
    except TraceError as exc:
        if max_bytes is None:  # the default budget is a safeguard: a model it cannot estimate passes unchecked
            return
        raise _uncovered(plan, max_bytes, exc) from exc
    # ``need`` is this plan's plain pass (set just above), at this batch: its peak is the plain mode's, counted
    # once (every other mode, and every way down below, is another plan and is estimated on its own)
    plain = need["peak_bytes"] + (need["dataset_bytes"] if stacked else 0)
    peaks = _mode_peaks(plan, hw, batch, total, recompute, plain)
    plan.recompute, plan.target_groups = _chosen_mode(plan, hw, batch, peaks)
    if max_bytes is None:
        available = available_bytes()
        if available is None:
            return
        limit, what = BUDGET_FRACTION * available, f"{BUDGET_FRACTION:g} of the {_gb(available)} available"
    else:
        limit, what = float(max_bytes), "max_bytes"
    if peaks[(plan.recompute, plan.target_groups)] <= limit:
        return
    fits = [m for m, peak in peaks.items() if peak <= limit]  # the fastest mode that fits
    if fits:
        plan.recompute, plan.target_groups = fits[0]
        return
    need["peak_bytes"] = min(peaks.values())  # the refusal names the leanest mode's peak
    ways = []
    for label, change in (("targets='top1'", {"target": ClassTargets("top1")}),
                          ("sites without 'F2'", {"site_ids": [s for s in plan.site_ids if s != "F2"] or None}),
                          ("layers=[-1]", {"layer_ids": plan.layer_ids[-1:]}),
                          ("dtype='float16'", {"dtype": "float16"})):
        if any(v is None for v in change.values()) or all(getattr(plan, f) == v for f, v in change.items()):
            continue
        if "target" in change and not isinstance(plan.target, ClassTargets):
            continue
        other = replace(plan, **change)
        ways.append((min(_mode_peaks(other, hw, batch, total, recompute).values()), label))
    if batch > 1:
        ways.append((min(_mode_peaks(plan, hw, 1, total, recompute).values()), "batch_size=1"))
    hint = ", ".join(f"{label} -> {_gb(peak)}" for peak, label in sorted(ways))
    # trace_many stores flat layouts and clips only (TracePlan.for_store): a Swin or BLIP user is not sent there.
    if not getattr(plan.adapter, "hierarchical", False) and (not plan.extra_layers or getattr(plan.adapter, "video",
                                                                                             False)):
        hint += "; vitcam_nb.trace_many writes many images to disk batch by batch"
    raise TraceError(f"max_bytes: this trace needs about {_gb(need['peak_bytes'])} at peak (Dataset "
                     f"{_gb(need['dataset_bytes'])}), over the budget of {_gb(limit)} ({what}). Cheapest ways down: "
                     f"{hint}. Or raise max_bytes=")
