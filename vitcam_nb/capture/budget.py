"""How much memory a trace takes, before it is run: the Dataset's size and the pass's peak from the model's
config, sites, layers, targets and dtype, and the budget a trace refuses to exceed (with the cheapest ways
down).

The Dataset size is exact arithmetic over the schema (``act``, ``grad``, ``attn``, ``attn_grad``, logits,
image and coordinates). The peak follows from how the pass holds memory (parameters frozen, freed memory
handed back as it goes: :mod:`vitcam_nb.capture.runtime`): after the forward pass, autograd's graph (per block,
with parameters frozen, about six token-by-channel tensors, the MLP's hidden input and the softmax attention)
plus the captured tensors; at the end of the batched backward, every captured tensor and its gradients in the
compute dtype; in between, the backward's transients (one attention-map and one MLP-hidden gradient per target); the
assembly then frees each tensor as it copies it, so it never holds more. The peak is the larger of the two
plus the transients and a fixed 20 MB; ``benchmarks/memsizes.py`` measures it for eight cases and
``tests/integration/test_reliability_memory.py`` checks the estimate against those measurements.
The estimate covers flat token layouts (ViT, DeiT, DINOv2, BEiT, EVA); hierarchical (Swin) and
cross-attention (BLIP) models are not estimated and not budget-checked.

Example:
    >>> import timm
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    >>> e = estimate(m, targets="top1", sites=["F1"], layers=[-1])
    >>> e["parts"]["act"], e["parts"]["grad"]  # 1 layer x 1 site x 197 tokens x 192 channels x 4 bytes
    (151296, 302592)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.core.errors import TraceError
from vitcam_nb.preprocess import data_config, prepare_input
from vitcam_nb.targets.classes import ClassTargets

__all__ = ["BUDGET_FRACTION", "available_bytes", "check_budget", "check_max_bytes", "estimate", "estimate_plan"]

#: The default budget: this fraction of the memory available when the trace starts.
BUDGET_FRACTION = 0.5
# Beyond the tensors the arithmetic counts: the pass's own small allocations (hooks, coordinates, xarray).
_PEAK_FIXED = 20e6
# Token x channel tensors autograd keeps per block with parameters frozen: the qkv output (3), the scaled
# queries (1) and both LayerNorm inputs (2).
_GRAPH_TC = 6


def available_bytes() -> int | None:
    """Memory available to a new allocation (Linux ``MemAvailable``; psutil elsewhere), None if unknown.

    Example:
        >>> available_bytes() is None or available_bytes() > 0
        True
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def _input_hw(plan: TracePlan, image: object) -> tuple[int, int]:
    if image is None:
        size = data_config(plan.model)["input_size"]
        return int(size[-2]), int(size[-1])
    shape = prepare_input(plan.model, image).tensor.shape
    return int(shape[-2]), int(shape[-1])


def _n_targets(plan: TracePlan) -> int:
    target = plan.target
    if isinstance(target, ClassTargets):
        return target.k if target.k is not None else len(target.classes or [])
    return len(getattr(target, "labels", None) or [None])


def estimate_plan(plan: TracePlan, hw: tuple[int, int], batch: int = 1) -> dict:
    """:func:`estimate` of a resolved plan at input size ``hw`` (``batch`` images in one pass).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> estimate_plan(TracePlan.for_trace(m, "top1", sites=["F2"], layers=[0]), (224, 224))["parts"]["attn"]
        465708
    """
    model, adapter = plan.model, plan.adapter
    facts = adapter.describe(model)
    pe = getattr(model, "patch_embed", None)
    if (getattr(adapter, "hierarchical", False) or plan.extra_sites or pe is None or "embed_dim" not in facts
            or "num_heads" not in facts):
        raise TraceError(f"model: the memory estimate covers flat token layouts (ViT, DeiT, DINOv2, BEiT, EVA); "
                         f"this {adapter.family} model is not estimated")
    ph, pw = (int(v) for v in pe.patch_size)
    rounding = math.ceil if getattr(pe, "dynamic_img_pad", False) else math.floor
    grid = rounding(hw[0] / ph) * rounding(hw[1] / pw)
    tokens = len(adapter.prefix_kinds(model)) + grid
    width, heads = int(facts["embed_dim"]), int(facts["num_heads"])
    head_width = heads * int(facts.get("head_dim", width // heads))
    store = 2 if plan.dtype == "float16" else 4
    compute = torch.finfo(plan.compute_dtype).bits // 8
    k = _n_targets(plan) + 1
    n_layers = len(plan.layer_ids)
    token_sites = [s for s in plan.site_ids if s != "F2"]
    channels = sum(head_width if s == "F3" else width for s in token_sites)
    act = batch * n_layers * tokens * channels * store
    attn = batch * n_layers * heads * tokens * tokens * store if "F2" in plan.site_ids else 0
    n_classes = int(getattr(model, "num_classes", 0) or 0)
    labels = plan.class_labels or []
    # Coordinates: each token axis (token; query and key with F2) carries an index, a kind (4-byte unicode,
    # five characters) and a patch row and column; y and x index the image; classes carry an index and a label.
    token_axes = 3 if "F2" in plan.site_ids else 1
    other = (batch * (n_classes * 4 + hw[0] * hw[1] * 3) + token_axes * tokens * 44 + 8 * (hw[0] + hw[1])
             + len(labels) * 4 * max((len(s) for s in labels), default=0) + n_classes * 8
             + 8 * (n_layers + heads) + k * 128)
    parts = {"act": act, "grad": k * act, "attn": attn, "attn_grad": k * attn, "other": other}
    dataset = sum(parts.values())
    blocks = adapter.blocks(model)
    fc1 = getattr(getattr(blocks[0], "mlp", None), "fc1", None)
    hidden = int(getattr(fc1, "out_features", 4 * width))
    held = (act + attn) * (k + 1) * compute / store  # captured tensors and their gradients, in the compute dtype
    graph = batch * len(blocks) * (tokens * (_GRAPH_TC * width + hidden) + heads * tokens * tokens) * compute
    transient = k * batch * (heads * tokens * tokens + tokens * hidden) * compute
    # The backward's transients come on top of either: the graph is released only once the backward is done.
    peak = _PEAK_FIXED + other + transient + max(graph + (act + attn) * compute / store, held)
    return {"dataset_bytes": int(dataset), "peak_bytes": int(peak),
            "parts": {n: int(v) for n, v in parts.items()}, "tokens": tokens, "targets": k - 1,
            "input_size": [int(hw[0]), int(hw[1])]}


def estimate(model: torch.nn.Module, image: object = None, targets: object = "top5", *,
             sites: Sequence[str] | str | None = None, layers: int | Sequence[int] | None = None,
             dtype: str = "float32") -> dict:
    """Memory a :func:`vitcam_nb.trace` with these arguments would take, before running it: the Dataset's
    size (``dataset_bytes``, with ``parts`` per variable) and the peak of the pass (``peak_bytes``, the
    Dataset included). ``image`` sets the input size (default: the model's configured size).

    Example:
        >>> import timm, vitcam_nb as vc
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> e = vc.estimate(m, targets="top1")
        >>> e["dataset_bytes"] < e["peak_bytes"]
        True
    """
    plan = TracePlan.for_trace(model, targets, sites=sites, layers=layers, dtype=dtype)
    return estimate_plan(plan, _input_hw(plan, image))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def check_max_bytes(max_bytes: object) -> None:
    """Refuse a ``max_bytes`` that is not a positive number of bytes or None.

    Example:
        >>> check_max_bytes(2e9)
        >>> check_max_bytes("2GB")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: max_bytes: expected a positive number of bytes or None, got '2GB'
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, float))
                                  or not max_bytes > 0):
        raise TraceError(f"max_bytes: expected a positive number of bytes or None, got {max_bytes!r}")


def check_budget(plan: TracePlan, hw: tuple[int, int], max_bytes: object, batch: int = 1,
                 stacked: bool = False) -> None:
    """Refuse a pass whose estimated peak exceeds ``max_bytes`` (None: :data:`BUDGET_FRACTION` of the
    available memory), naming the estimate and the cheapest ways down. ``stacked``: the batch's Datasets are
    also stacked into one copy (``trace_many``). Models the estimate does not cover pass unchecked.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> check_budget(TracePlan.for_trace(m, "top1"), (224, 224), 10**6)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: max_bytes: this trace needs about ...
    """
    check_max_bytes(max_bytes)
    def total(p: TracePlan, n: int) -> int:
        e = estimate_plan(p, hw, n)
        return e["peak_bytes"] + (e["dataset_bytes"] if stacked else 0)

    try:
        need = estimate_plan(plan, hw, batch)
    except TraceError:
        return
    need["peak_bytes"] = total(plan, batch)
    if max_bytes is None:
        available = available_bytes()
        if available is None:
            return
        limit, what = BUDGET_FRACTION * available, f"{BUDGET_FRACTION:g} of the {_gb(available)} available"
    else:
        limit, what = float(max_bytes), "max_bytes"
    if need["peak_bytes"] <= limit:
        return
    ways = []
    for label, change in (("targets='top1'", {"target": ClassTargets("top1")}),
                          ("sites without 'F2'", {"site_ids": [s for s in plan.site_ids if s != "F2"] or None}),
                          ("layers=[-1]", {"layer_ids": plan.layer_ids[-1:]}),
                          ("dtype='float16'", {"dtype": "float16"})):
        if any(v is None for v in change.values()) or all(getattr(plan, f) == v for f, v in change.items()):
            continue
        if "target" in change and not isinstance(plan.target, ClassTargets):
            continue
        other = TracePlan(**{**plan.__dict__, **change})
        ways.append((total(other, batch), label))
    if batch > 1:
        ways.append((total(plan, 1), "batch_size=1"))
    hint = ", ".join(f"{label} -> {_gb(peak)}" for peak, label in sorted(ways))
    raise TraceError(f"max_bytes: this trace needs about {_gb(need['peak_bytes'])} at peak (Dataset "
                     f"{_gb(need['dataset_bytes'])}), over the budget of {_gb(limit)} ({what}). Cheapest ways down: "
                     f"{hint}; vitcam_nb.trace_many writes many images to disk batch by batch. Or raise max_bytes=")
