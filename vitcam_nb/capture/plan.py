"""The plan of a trace: every argument of :func:`vitcam_nb.trace` and :func:`vitcam_nb.trace_many` checked and
resolved once, before any model call (model family, target, class labels, layers, sites, dtypes, device).

Example:
    >>> import timm
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    >>> plan = TracePlan.for_trace(m, "top2", sites=["F1", "F2"], layers=[-1])
    >>> plan.layer_ids, plan.site_ids, plan.store_dtype.__name__
    ([11], ['F1', 'F2'], 'float32')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vitcam_nb.adapters.base import Adapter
from vitcam_nb.adapters.registry import find_adapter, supported_families
from vitcam_nb.adapters.wrappers import unsupported_message, unwrap
from vitcam_nb.capture.rules import check_rule_for, check_rule_target
from vitcam_nb.capture.runtime import check_autocast, check_device
from vitcam_nb.core.errors import ArgumentTypeError, TraceError
from vitcam_nb.core.rules import DEFAULT_RULE
from vitcam_nb.core.schema import CORE_SITES, EXTENDED_SITES, OPTIONAL_SITES, STORAGE_DTYPES
from vitcam_nb.targets.base import Target
from vitcam_nb.targets.classes import ClassTargets, as_target, head_size

__all__ = ["TracePlan", "group_bounds", "memory_mode", "model_name", "paired_groups", "resolve_layers",
           "resolve_sites"]


def _check_family(model: object, dtype: str) -> tuple[Adapter, torch.nn.Module, tuple[str, ...]]:
    """Refuse a non-module, an unsupported family or an unknown storage dtype; return the model's adapter, the
    model it reads (inside torch.compile, DataParallel, DDP or a one-module Sequential when no adapter reads the
    wrapper itself) and the wrappers looked through."""
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    try:
        adapter, inner, wrappers = find_adapter(model), model, []
    except TypeError:
        inner, wrappers = unwrap(model)
        if not wrappers:
            raise
        try:
            adapter = find_adapter(inner)
        except TypeError:
            raise ArgumentTypeError(unsupported_message(model, supported_families()) + f" Looked through {wrappers} to "
                                    f"{type(inner).__module__}.{type(inner).__name__}, which is not supported "
                                    "either.") from None
    if dtype not in STORAGE_DTYPES:
        raise TraceError(f"dtype: expected one of {list(STORAGE_DTYPES)}, got {dtype!r}")
    return adapter, inner, tuple(wrappers)


def resolve_layers(layers: object, n_layers: int) -> list[int]:
    """Sorted absolute block indices from the ``layers`` argument (None: every block).

    Example:
        >>> resolve_layers([-1, 0], 12)
        [0, 11]
    """
    if layers is None:
        return list(range(n_layers))
    items = [layers] if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool) else layers
    if not isinstance(items, Sequence) or isinstance(items, str) or len(items) == 0:
        raise TraceError(f"layers: expected None, an int or a non-empty list of ints, got {layers!r}")
    out = set()
    for i in items:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TraceError(f"layers: expected ints in [-{n_layers}, {n_layers - 1}], got {i!r}")
        if not -n_layers <= i < n_layers:
            raise TraceError(f"layers: {i} is out of range for a model with {n_layers} blocks "
                             f"(allowed -{n_layers}..{n_layers - 1})")
        out.add(int(i) % n_layers)
    return sorted(out)


def resolve_sites(sites: object, adapter: Adapter, model: torch.nn.Module, extra: dict | None = None) -> list[str]:
    """The sites to read, in the adapter's order (None: F1..F6 and the extra sites the model has); ``extra``: the
    adapter's extra sites of this model when the caller has them already.

    Example:
        >>> import timm
        >>> from vitcam_nb.adapters import find_adapter
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> resolve_sites(["F4", "F1"], find_adapter(m), m)
        ['F1', 'F4']
    """
    allowed = list(adapter.site_table(model)) + list(adapter.extra_sites(model) if extra is None else extra)
    if sites is None:
        # the optional sites are read only when asked for, like the extended sites
        own = adapter.sites  # once: a family's site table may be built each time it is asked for
        return [s for s in allowed if s in CORE_SITES or (s not in own and s not in OPTIONAL_SITES)]
    items = [sites] if isinstance(sites, str) else sites
    if not isinstance(items, Sequence) or len(items) == 0:
        raise TraceError(f"sites: expected a site name or a non-empty list of them, got {sites!r}")
    for s in items:
        if s not in allowed:
            known = ("a site this model does not have" if s in adapter.sites or s in CORE_SITES + EXTENDED_SITES
                     + OPTIONAL_SITES else "unknown site")
            raise TraceError(f"sites: {known} {s!r}; this {adapter.family} model has {allowed}")
    return [s for s in allowed if s in items]


def group_bounds(n_targets: int, groups: int) -> np.ndarray:
    """Where the backward pass of ``n_targets`` outputs split into ``groups`` (:attr:`TracePlan.target_groups`)
    starts and stops each group: ``groups + 1`` bounds, the groups as even as whole targets allow.

    Example:
        >>> group_bounds(6, 3).tolist(), group_bounds(5, 2).tolist(), group_bounds(4, 1).tolist()
        ([0, 2, 4, 6], [0, 2, 5], [0, 4])
    """
    if groups == 1 and n_targets >= 1:  # one group (every trace but a budget-split one): no linspace per pass
        return np.array([0, n_targets])
    return np.linspace(0, n_targets, min(groups, n_targets) + 1).round().astype(int)


def memory_mode(recompute: bool, target_groups: int) -> str:
    """How a pass held its memory (:attr:`TracePlan.recompute`, :attr:`TracePlan.target_groups`), in words: a
    trace's ``memory_mode`` attribute and :func:`vitcam_nb.estimate`'s. Every mode stores the same values to float32
    rounding (every element within 1e-5 of its magnitude plus 1e-5 of the array's largest; its backward multiplies
    matrices of other batch shapes, which round otherwise on some CPUs), so the mode is not part of the trace id.

    Example:
        >>> memory_mode(False, 1), memory_mode(True, 1)
        ('plain', 'blocks recomputed, one target at a time')
        >>> memory_mode(True, 3)
        'blocks recomputed, one target at a time (the head in 3 groups)'
    """
    if not recompute:
        return "plain"
    return "blocks recomputed, one target at a time" + (f" (the head in {target_groups} groups)"
                                                        if target_groups > 1 else "")


def paired_groups(n_targets: int) -> int:
    """How many groups a grouped backward pass splits ``n_targets`` outputs into: the most with two targets or
    more in each, two per group when ``n_targets`` is even; when it is odd, one group holds three anyway, so the
    fewest groups of at most three (the same largest group, so the same peak, with fewer backward calls). A group
    of one target multiplies matrix by vector in the head's backward, whose sums round otherwise than the batched
    matrix product's (here in the last bits of about one element in twelve); groups of two or more take the matrix
    product as one batched backward does. Either way the values equal the batched backward's to float32 rounding,
    not bitwise: on some CPUs a matrix product of another batch shape rounds otherwise too.

    Example:
        >>> paired_groups(6), paired_groups(3), np.diff(group_bounds(11, paired_groups(11))).tolist()
        (3, 1, [3, 3, 2, 3])
    """
    if n_targets % 2 == 0:
        return max(1, n_targets // 2)
    return max(1, -(-n_targets // 3))


def model_name(model: torch.nn.Module) -> tuple[str, str]:
    """(architecture, pretrained tag) as the model's timm config states them ("" when it has no tag).

    Example:
        >>> model_name(torch.nn.Linear(1, 1))
        ('Linear', '')
    """
    cfg = getattr(model, "pretrained_cfg", None) or {}
    arch = cfg.get("architecture") if isinstance(cfg, dict) else None
    tag = cfg.get("tag") if isinstance(cfg, dict) else None
    return str(arch or type(model).__name__), str(tag or "")


@dataclass
class TracePlan:
    """Everything resolved once for a trace or a store: what to read, what to differentiate, where, how.

    ``class_labels`` is None for targets that name their scores only once they are computed.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> plan = TracePlan.for_trace(m, "top3", dtype="float16")
        >>> plan.store_dtype.__name__, plan.run_device.type, len(plan.class_labels)
        ('float16', 'cpu', 1000)
    """

    model: torch.nn.Module
    adapter: Adapter
    target: Target
    class_labels: list[str] | None
    layer_ids: list[int]
    site_ids: list[str]
    dtype: str
    run_device: torch.device
    compute_dtype: torch.dtype
    #: wrappers looked through to reach ``model`` (torch.compile, DataParallel, ...), outermost first
    wrappers: tuple[str, ...] = ()
    #: the backward rule the pass runs under (:mod:`vitcam_nb.core.rules`; "gradient": autograd's own)
    rule: str = DEFAULT_RULE
    #: run each block forward again inside the backward pass instead of keeping its graph, the blocks one target at
    #: a time in the array pass (:mod:`vitcam_nb.capture.block_major`; the tensor pass:
    #: :mod:`vitcam_nb.capture.recompute`; chosen by :func:`vitcam_nb.capture.budget.fit_budget`)
    recompute: bool = False
    #: with ``recompute``: the head's backward pass in this many groups of targets (:func:`group_bounds`), to hold
    #: fewer targets' gradients at once (chosen by :func:`vitcam_nb.capture.budget.fit_budget`)
    target_groups: int = 1
    #: the adapter's sites outside the block stack, by name, with how many layers each (read once when the plan is
    #: made: finding their modules walks the model; None: read from the adapter when asked, :attr:`extra_layers`)
    extra_counts: dict[str, int] | None = None

    @property
    def store_dtype(self) -> type:
        """The numpy type arrays are stored in."""
        return np.float16 if self.dtype == "float16" else np.float32

    @property
    def extra_sites(self) -> dict:
        """The adapter's sites outside the block stack (e.g. ``xattn``), with their modules."""
        return self.adapter.extra_sites(self.model)

    @property
    def extra_layers(self) -> dict[str, int]:
        """The adapter's sites outside the block stack by name, with how many layers each: what the pass, the
        assembly and the budget read of them (:attr:`extra_sites` gives their modules).

        Example:
            >>> import timm
            >>> TracePlan.for_trace(timm.create_model("vit_tiny_patch16_224", pretrained=False), 1).extra_layers
            {}
        """
        if self.extra_counts is not None:
            return self.extra_counts
        return {name: len(where) for name, where in self.extra_sites.items()}

    @property
    def graph_start(self) -> int:
        """The block whose input the pass's autograd graph starts at: the lowest traced layer (the blocks below it
        run without a graph, since no gradient the trace stores depends on them), or 0, the image itself, when the
        adapter has sites outside the block stack (BLIP's text layers, TimeSformer's every-block matrices).

        Example:
            >>> import timm
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
            >>> TracePlan.for_trace(m, "top1", layers=[-1]).graph_start, TracePlan.for_trace(m, "top1").graph_start
            (11, 0)
        """
        return 0 if self.extra_layers else min(self.layer_ids)

    @classmethod
    def _make(cls, model: torch.nn.Module, adapter: Adapter, target: Target, class_labels: list[str] | None,
              layer_ids: list[int], site_ids: list[str], dtype: str, device: object, extra: dict) -> TracePlan:
        first = next(iter(model.parameters()), None)  # the first parameter only (listing them all: per trace)
        model_device = first.device if first is not None else torch.device("cpu")
        run_device = check_device(device, model_device)
        check_autocast()
        return cls(model=model, adapter=adapter, target=target, class_labels=class_labels, layer_ids=layer_ids,
                   site_ids=site_ids, dtype=dtype, run_device=run_device,
                   compute_dtype=first.dtype if first is not None else torch.float32,
                   extra_counts={name: len(where) for name, where in extra.items()})

    @classmethod
    def for_trace(cls, model: object, targets: object = "top5", *, sites: object = None, layers: object = None,
                  dtype: str = "float32", device: object = None, labels: Sequence[str] | None = None,
                  rule: str = DEFAULT_RULE) -> TracePlan:
        """The plan of one :func:`vitcam_nb.trace` call: any target kind.

        Example:
            >>> import timm
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
            >>> TracePlan.for_trace(m, 3).target.classes
            [3]
        """
        adapter, model, wrappers = _check_family(model, dtype)
        rule = check_rule_for(rule, model, adapter)
        target = as_target(targets, labels)
        check_rule_target(rule, target, adapter)
        target.check(model)
        # Class labels are known (and wrong ones refused) before the forward pass; other targets name their
        # scores when they have computed them.
        names = target.class_labels(model, head_size(model)) if isinstance(target, ClassTargets) else None
        layer_ids = resolve_layers(layers, len(adapter.blocks(model)))
        extra = adapter.extra_sites(model)
        plan = cls._make(model, adapter, target, names, layer_ids, resolve_sites(sites, adapter, model, extra), dtype,
                         device, extra)
        plan.wrappers, plan.rule = wrappers, rule
        return plan

    @classmethod
    def for_store(cls, model: object, targets: object = "top5", *, sites: object = None, layers: object = None,
                  dtype: str = "float32", device: object = None, labels: Sequence[str] | None = None,
                  rule: str = DEFAULT_RULE) -> TracePlan:
        """The plan of a :func:`vitcam_nb.trace_many` store: class targets of a flat (non-hierarchical) model or of
        a video family's clips.

        Example:
            >>> import timm
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
            >>> TracePlan.for_store(m, "top1").target.k
            1
        """
        adapter, model, wrappers = _check_family(model, dtype)
        rule = check_rule_for(rule, model, adapter)
        num_classes = head_size(model)
        if num_classes <= 0:
            raise TraceError("model: has no classifier head (num_classes=0); class targets need logits")
        # A video family's extra sites (TimeSformer's attn_time, attn_space) are one clip's arrays: they stack.
        video, extra = getattr(adapter, "video", False), adapter.extra_sites(model)
        if getattr(adapter, "hierarchical", False) or (extra and not video):
            raise TraceError(f"model: trace_many stores flat token layouts; the {adapter.family} family has "
                             "per-stage grids or extra sites. Trace its images one by one with vitcam_nb.trace()")
        # Layers and sites are checked before the targets, as trace_many always did.
        layer_ids = resolve_layers(layers, len(adapter.blocks(model)))
        site_ids = resolve_sites(sites, adapter, model, extra)
        target = ClassTargets(targets, labels)
        target.check_count(num_classes)
        plan = cls._make(model, adapter, target, target.class_labels(model, num_classes), layer_ids, site_ids, dtype,
                         device, extra)
        plan.wrappers, plan.rule = wrappers, rule
        return plan
