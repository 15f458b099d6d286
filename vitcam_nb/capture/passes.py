"""The pass: one forward and one batched backward pass over a batch of images, shared by
:func:`vitcam_nb.trace` (a batch of one) and :func:`vitcam_nb.trace_many`.

Target j of image b is the score ``s[b, c_bj]``. Images in a batch are independent, so the gradient of
``sum_b s[b, c_bj]`` with respect to image b's tensors is that of ``s[b, c_bj]`` alone, and one
``torch.autograd.grad(..., is_grads_batched=True)`` call over the K summed targets plus the summed expected
score ``E_b = sum_i p_bi s_bi`` (``p`` detached) covers the whole batch. Everything a trace records about
how it ran (deterministic kernels, input checks, the patch grid) comes from here, for both entry points.

Example:
    >>> import timm, torch
    >>> from vitcam_nb.capture.plan import TracePlan
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    >>> res = run_pass(TracePlan.for_trace(m, "top2", sites=["F1"], layers=[0]), torch.zeros(2, 3, 224, 224))
    >>> len(res.classes), tuple(res.grads[(0, "F1")].shape)
    (2, (3, 2, 197, 192))
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vitcam_nb.adapters.base import Adapter, TraceContext
from vitcam_nb.adapters.qkv import single_head_layers
from vitcam_nb.capture.backward import batched_grad
from vitcam_nb.capture.block_major import SharedRecompute, backward_by_block
from vitcam_nb.capture.crop_check import CROP_PIXELS, check_crops
from vitcam_nb.capture.graph_start import graph_from
from vitcam_nb.capture.hooks import Capture
from vitcam_nb.capture.plan import TracePlan, group_bounds
from vitcam_nb.capture.prealloc import HOOKS_FROM, Arrays, batched_hooks_work, lowest_tensors
from vitcam_nb.capture.recompute import recomputed_blocks
from vitcam_nb.capture.resident import ResidentCap
from vitcam_nb.capture.rules import rule_context, rule_extra_grads
from vitcam_nb.capture.runtime import (
    deterministic,
    frozen_parameters,
    release_freed_memory,
    releasing_during_backward,
    releasing_during_forward,
)
from vitcam_nb.core.errors import TraceError

__all__ = ["ImagePass", "PassResult", "check_input", "run_pass"]

Key = tuple[int, str]


@dataclass
class ImagePass:
    """One image's share of a pass: its scores, traced indices, site tensors and gradients (leading batch
    dimension of one; gradients (targets, 1, ...)). From a pass that wrote its arrays (``run_pass(...,
    arrays=True)``), ``filled`` holds the finished arrays by (layers, sites, "act" | "grad") and ``acts`` and
    ``grads`` only the keys outside them, already NumPy arrays in the storage dtype.

    Example:
        >>> ImagePass(torch.zeros(3), [2], {}, {}).classes
        [2]
    """

    logits: torch.Tensor
    classes: list[int]
    acts: dict[Key, torch.Tensor | np.ndarray]
    grads: dict[Key, torch.Tensor | np.ndarray]
    #: a rule's extra gradients (:func:`~vitcam_nb.capture.rules.rule_extra_grads`), by variable name
    extra_grads: dict[str, dict[Key, torch.Tensor]] = field(default_factory=dict)
    #: the arrays a pass with ``arrays=True`` wrote, by (layers, sites, "act" | "grad")
    filled: dict[tuple, np.ndarray] = field(default_factory=dict)


@dataclass
class PassResult:
    """What a pass over a batch computed, on the device it ran on, in the schema layout.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> run = run_pass(TracePlan.for_trace(m, "top1", sites=["F1"]), torch.zeros(1, 3, 32, 32))
        >>> run.grid, run.deterministic_settings, tuple(run.image(0).grads[(0, "F1")].shape)
        ((4, 4), 'cpu kernels', (2, 1, 17, 192))
    """

    logits: torch.Tensor
    classes: list[list[int]]
    acts: dict[Key, torch.Tensor]
    grads: dict[Key, torch.Tensor]
    grid: tuple[int, int]
    ctx: TraceContext
    deterministic: int
    deterministic_settings: str
    #: blocks whose attention ran as one head (inside ``vitcam_nb.adapters.single_head_attention``)
    single_head: tuple[int, ...] = ()
    #: a rule's extra gradients (:func:`~vitcam_nb.capture.rules.rule_extra_grads`), by variable name
    extra_grads: dict[str, dict[Key, torch.Tensor]] = field(default_factory=dict)
    #: each image's share, when the pass wrote its arrays (``acts`` and ``grads`` are then empty)
    images: list[ImagePass] = field(default_factory=list)
    #: the crops the tower ran on, for a model whose tower runs on several crops of its one image (0: none); the
    #: block sites' leading dim is then the crop, not the batch
    crops: int = 0

    def image(self, b: int) -> ImagePass:
        """Image ``b``'s share (views of the batch tensors, or the arrays the pass wrote). Refused on a pass over
        crops, whose block sites hold one image's crops: :meth:`whole` gives them all."""
        if self.crops:
            raise TraceError(f"image: the tower ran on {self.crops} crops of one image; its trace is assembled with "
                             "every crop (vitcam_nb.capture.crops.assemble_crops, as vitcam_nb.trace does), never "
                             "as one batch row")
        if self.images:
            return self.images[b]
        return ImagePass(self.logits[b], self.classes[b], {k: t[b:b + 1] for k, t in self.acts.items()},
                         {k: g[:, b:b + 1] for k, g in self.grads.items()},
                         {n: {k: g[:, b:b + 1] for k, g in got.items()} for n, got in self.extra_grads.items()})

    def whole(self) -> ImagePass:
        """The pass's one image with every row of its tensors (a crops pass: the tower's crops included)."""
        if int(self.logits.shape[0]) != 1:
            raise TraceError(f"image: the pass holds {int(self.logits.shape[0])} images; whole() takes a pass of one")
        return ImagePass(self.logits[0], self.classes[0], dict(self.acts), dict(self.grads),
                         {n: dict(got) for n, got in self.extra_grads.items()})


def check_input(model: torch.nn.Module, adapter: Adapter, x: torch.Tensor) -> None:
    """Refuse an input batch the model cannot take: a size its patch embedding refuses, or one the adapter
    refuses (:meth:`~vitcam_nb.adapters.Adapter.check_input`).

    Example:
        >>> import timm
        >>> from vitcam_nb.adapters import find_adapter
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> check_input(m, find_adapter(m), torch.zeros(1, 3, 64, 64))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: image: the model expects 224x224 input, got 64x64; ...
    """
    pe = getattr(model, "patch_embed", None)
    if pe is not None:
        got = tuple(int(v) for v in x.shape[-2:])
        if getattr(model, "dynamic_img_size", False):
            patch = tuple(int(v) for v in pe.patch_size)
            if not getattr(pe, "dynamic_img_pad", False) and (got[0] % patch[0] or got[1] % patch[1]):
                raise TraceError(f"image: {got[0]}x{got[1]} is not a multiple of the patch size "
                                 f"{patch[0]}x{patch[1]}; crop or resize it")
        elif getattr(pe, "strict_img_size", False):
            expected = tuple(int(v) for v in pe.img_size)
            if got != expected:
                raise TraceError(f"image: the model expects {expected[0]}x{expected[1]} input, got "
                                 f"{got[0]}x{got[1]}; pass a PIL image or uint8 array to have it resized, or create "
                                 "the model with dynamic_img_size=True")
    adapter.check_input(model, x)


def _check_scores(z: object, n_images: int) -> None:
    """A target's batch scores must be a (batch, N) float tensor: one non-empty score vector per image."""
    if not isinstance(z, torch.Tensor) or z.ndim != 2 or z.shape[0] != n_images or not z.is_floating_point() \
            or z.numel() == 0:
        shape = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise TraceError(f"targets: the target's batch_scores() must return a non-empty ({n_images}, N) float "
                         f"tensor, got {shape}")


def _check_choice(classes: object, n: int) -> list[int]:
    """A target's choice must be distinct valid indices into its scores."""
    if not isinstance(classes, Sequence) or not classes or len(set(classes)) != len(classes) or any(
            isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c < n for c in classes):
        raise TraceError(f"targets: the target's choose() must return a non-empty list of distinct ints in "
                         f"0..{n - 1}, got {classes!r}")
    return [int(c) for c in classes]


def run_pass(plan: TracePlan, x: torch.Tensor, *, arrays: bool = False) -> PassResult:
    """Trace a batch ``x`` (B, 3, H, W): one forward pass with the plan's sites hooked, one batched backward
    pass for every image's chosen targets and its expected score.

    By default the site tensors and their gradients come back as tensors on the pass's device (``acts``,
    ``grads``). With ``arrays=True`` the pass writes them into each image's final NumPy arrays in the storage
    dtype (:mod:`vitcam_nb.capture.prealloc`; :meth:`PassResult.image`): each tensor's values and gradients from
    inside the backward pass as autograd produces them, so it never holds them twice. The
    model's device placement is the caller's (``vitcam_nb.capture.runtime.on_device``); everything else the pass
    changes on the model, and the deterministic-kernel flags on CUDA, is restored on return.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> run = run_pass(TracePlan.for_trace(m, [0, 1], sites=["F1"]), torch.zeros(1, 3, 32, 32))
        >>> run.classes, m.training  # the model is back in train mode, as it was given
        ([[0, 1]], True)
        >>> run_pass(TracePlan.for_trace(m, [0], sites=["F1"]), torch.zeros(1, 3, 32, 32), arrays=True
        ...          ).image(0).filled[((0,), ("F1",), "grad")].shape
        (2, 1, 1, 17, 192)
    """
    model, adapter = plan.model, plan.adapter
    check_input(model, adapter, x)
    crops = adapter.runs_crops(model)
    if crops:  # refused before any work when the crops do not fit the target
        check_crops(plan, x)
        # The array pass writes batch rows into per-image arrays; a crops tower's rows are one image's crops.
        arrays = False
    ctx = TraceContext(model)
    extra = plan.extra_layers
    resident = ResidentCap() if arrays else None  # the resident memory before the pass: its rise is measured

    def arrange(k: Key, t: torch.Tensor) -> torch.Tensor:
        return adapter.arrange_extra(k[1], t) if k[1] in extra else adapter.arrange_traced(ctx, k[1], k[0], t)

    # The rule's hooks go on after the capture's: its forward hooks run first (prepend), so the sites read the
    # rule's tensors; its pre-hooks run after the capture's (the attn_scores site rebuilds the softmax it then sees).
    with deterministic(plan.run_device) as (det, det_settings), frozen_parameters(model), \
            Capture(model, adapter, plan.layer_ids, plan.site_ids, ctx) as cap, \
            rule_context(plan.rule, model, adapter), torch.inference_mode(False), torch.enable_grad():
        # The graph starts at the lowest traced layer's input (capture.graph_start), or at the image.
        graph_start, blocks = plan.graph_start, adapter.blocks(model)  # once each: both walk the model's modules
        x = x.to(plan.run_device, plan.compute_dtype).clone().requires_grad_(graph_start == 0)
        # The array pass hands nothing back during the forward pass: a block's freed transients are the next
        # block's, and handing them back made each fault its pages in again.
        # Recomputing: the backward pass goes block by block, each block recomputed once for all targets and
        # differentiated one target at a time.
        shared = SharedRecompute(blocks, cap.quiet) if arrays and plan.recompute else None
        with releasing_during_forward([] if arrays else blocks), graph_from(blocks, graph_start) as start, \
                (shared.installed() if shared is not None else recomputed_blocks(blocks, cap.quiet)
                 if plan.recompute else contextlib.nullcontext()):
            z = plan.target.batch_scores(model, x)
        missing = [f"{s}@{layer}" for layer in plan.layer_ids for s in plan.site_ids
                   if s not in extra and (layer, s) not in cap.tensors]
        missing += [f"{s}@{i}" for s in plan.site_ids if s in extra for i in range(extra[s])
                    if (i, s) not in cap.tensors]
        if missing or cap.grid is None:
            raise TraceError(f"sites: hooks never fired for {missing or ['patch grid']}; the adapter's site "
                             "table does not fit this model")
        start.check()
        _check_scores(z, int(x.shape[0]))
        classes = [_check_choice(plan.target.choose(row), int(z.shape[1])) for row in z]
        if len({len(c) for c in classes}) > 1:
            raise TraceError(f"targets: the target chose a different number of indices per image {classes}; a "
                             "batch traces the same number for every image")
        expected = (torch.softmax(z.detach(), dim=1) * z).sum(dim=1)
        chosen = z.gather(1, torch.tensor(classes, device=z.device)).sum(dim=0)
        outputs = torch.cat([chosen, expected.sum()[None]])
        # A rule may first differentiate the retained graph itself (chefer_lrp: the plain gradient at F2).
        extra_grads = {name: {k: adapter.arrange_traced(ctx, k[1], k[0], g) for k, g in got.items()}
                       for name, got in rule_extra_grads(plan.rule, adapter, outputs, cap.tensors).items()}
        acts, grad_by_key, images = {}, {}, []
        if arrays:
            # a small pass has autograd return its gradients rather than hooks write them (prealloc.HOOKS_FROM)
            captured = sum(t.numel() for t in cap.tensors.values()) * (1 + len(outputs)) * x.element_size()
            store = Arrays(plan, int(x.shape[0]), arrange, hooks=batched_hooks_work() and captured >= HOOKS_FROM,
                           on_write=resident, hold=not plan.recompute)
            # The store holds each tensor until its gradient arrives, then lets it go (a recomputing pass: writes its
            # values now and lets it go, since no graph holds it).
            while cap.tensors:
                store.keep(*cap.tensors.popitem())
            resident.limit(store.array_bytes(len(outputs)))
            _backward_into(store, outputs, plan.target_groups, shared)
            images = [ImagePass(z[b].detach(), classes[b], store.acts[b], store.grads[b],
                                {n: {k: g[:, b:b + 1] for k, g in got.items()} for n, got in extra_grads.items()},
                                store.filled[b]) for b in range(int(x.shape[0]))]
        else:
            keys = list(cap.tensors)
            # Parameters are frozen, so a site that does not depend on the image has no graph: its gradient is 0.
            needed = [k for k in keys if cap.tensors[k].requires_grad]
            # One release per block (each costs page faults later); an extra site's layers (BLIP's text layers)
            # share the block numbers and would take the vision blocks' places.
            per_layer = {k[0]: cap.tensors[k] for k in needed if k[1] not in extra}
            with releasing_during_backward(list(per_layer.values())):
                got = dict(zip(needed, batched_grad(outputs, [cap.tensors[k] for k in needed]))) \
                    if needed and outputs.requires_grad else {}
            release_freed_memory()
            for k in keys:
                act, g = cap.tensors[k].detach(), got.get(k)
                if g is None:  # allow_unused: the targets do not depend on this tensor at all
                    g = torch.zeros((len(outputs), *act.shape), dtype=act.dtype, device=act.device)
                acts[k], grad_by_key[k] = arrange(k, act), arrange(k, g)
    return PassResult(logits=z.detach(), classes=classes, acts=acts, grads=grad_by_key, grid=cap.grid, ctx=ctx,
                      deterministic=det, deterministic_settings=det_settings,
                      single_head=single_head_layers(model, adapter.attention_modules(model)),
                      extra_grads=extra_grads, images=images,
                      crops=int(ctx.facts[CROP_PIXELS].shape[0]) if crops and CROP_PIXELS in ctx.facts else 0)


def _backward_into(store: Arrays, outputs: torch.Tensor, groups: int = 1,
                   shared: SharedRecompute | None = None) -> None:
    """The batched backward pass into ``store``: its hooks write each captured tensor's gradients as soon as
    autograd has summed them, and autograd returns only the lowest tensors' (:func:`lowest_tensors`), which their
    hooks wrote already. Without readable batched hooks, autograd returns them all and they are written here.
    Block by block when the forward pass ran under ``shared`` (it recomputed its blocks) and the graph is a chain
    of blocks (:func:`~vitcam_nb.capture.block_major.backward_by_block`: the head in ``groups`` groups of targets,
    each block one target at a time); otherwise one batched backward per group
    (:func:`~vitcam_nb.capture.plan.group_bounds`) over the whole graph (kept until the last), each group's
    gradients into its rows of the target axis, so fewer targets' transients are alive at once."""
    store.begin_backward(len(outputs))
    keys, edges = list(store.edges), list(store.edges.values())
    lowest = [edges[i] for i in lowest_tensors(edges)] if edges and store.hooks else edges
    # No captured tensor has a graph, or the outputs do not depend on any (a head that reads only layers below the
    # graph's start): no backward, the gradients are zero.
    bounds = group_bounds(len(outputs), groups) if edges and outputs.requires_grad else []
    try:
        if shared is not None and len(bounds) and backward_by_block(store, outputs, bounds, shared):
            bounds = []
        for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            store.backward_targets(int(start), int(stop))
            got = batched_grad(outputs[start:stop], lowest, retain_graph=i < len(bounds) - 2)
            if not store.hooks:
                store.put_grads([(k, store.arrange(k, g)) for k, g in zip(keys, got) if g is not None])
            del got
    finally:
        del edges, lowest
        store.edges.clear()  # the graph's nodes go with the pass
        if shared is not None:
            shared.clear()
    store.finish_backward()
