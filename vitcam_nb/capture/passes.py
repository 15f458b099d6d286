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

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vitcam_nb.adapters.base import Adapter, TraceContext
from vitcam_nb.adapters.qkv import single_head_layers
from vitcam_nb.capture.backward import batched_grad
from vitcam_nb.capture.hooks import Capture
from vitcam_nb.capture.plan import TracePlan
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
    dimension of one; gradients (targets, 1, ...)).

    Example:
        >>> ImagePass(torch.zeros(3), [2], {}, {}).classes
        [2]
    """

    logits: torch.Tensor
    classes: list[int]
    acts: dict[Key, torch.Tensor]
    grads: dict[Key, torch.Tensor]
    #: a rule's extra gradients (:func:`~vitcam_nb.capture.rules.rule_extra_grads`), by variable name
    extra_grads: dict[str, dict[Key, torch.Tensor]] = field(default_factory=dict)


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

    def image(self, b: int) -> ImagePass:
        """Image ``b``'s share (views of the batch tensors)."""
        return ImagePass(self.logits[b], self.classes[b], {k: t[b:b + 1] for k, t in self.acts.items()},
                         {k: g[:, b:b + 1] for k, g in self.grads.items()},
                         {n: {k: g[:, b:b + 1] for k, g in got.items()} for n, got in self.extra_grads.items()})


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


def run_pass(plan: TracePlan, x: torch.Tensor) -> PassResult:
    """Trace a batch ``x`` (B, 3, H, W): one forward pass with the plan's sites hooked, one batched backward
    pass for every image's chosen targets and its expected score.

    The model's device placement is the caller's (``vitcam_nb.capture.runtime.on_device``); everything else
    the pass changes on the model, and the deterministic-kernel flags on CUDA, is restored on return.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> run = run_pass(TracePlan.for_trace(m, [0, 1], sites=["F1"]), torch.zeros(1, 3, 32, 32))
        >>> run.classes, m.training  # the model is back in train mode, as it was given
        ([[0, 1]], True)
    """
    model, adapter = plan.model, plan.adapter
    check_input(model, adapter, x)
    ctx = TraceContext(model)
    extra = plan.extra_sites
    # The rule's hooks go on after the capture's: its forward hooks run first (prepend), so the sites read the
    # rule's tensors; its pre-hooks run after the capture's (the attn_scores site rebuilds the softmax it then sees).
    with deterministic(plan.run_device) as (det, det_settings), frozen_parameters(model), \
            Capture(model, adapter, plan.layer_ids, plan.site_ids, ctx) as cap, \
            rule_context(plan.rule, model, adapter), torch.inference_mode(False), torch.enable_grad():
        x = x.to(plan.run_device, plan.compute_dtype).clone().requires_grad_(True)
        with releasing_during_forward(adapter.blocks(model)):
            z = plan.target.batch_scores(model, x)
        missing = [f"{s}@{layer}" for layer in plan.layer_ids for s in plan.site_ids
                   if s not in extra and (layer, s) not in cap.tensors]
        missing += [f"{s}@{i}" for s in plan.site_ids if s in extra for i in range(len(extra[s]))
                    if (i, s) not in cap.tensors]
        if missing or cap.grid is None:
            raise TraceError(f"sites: hooks never fired for {missing or ['patch grid']}; the adapter's site "
                             "table does not fit this model")
        _check_scores(z, int(x.shape[0]))
        classes = [_check_choice(plan.target.choose(row), int(z.shape[1])) for row in z]
        if len({len(c) for c in classes}) > 1:
            raise TraceError(f"targets: the target chose a different number of indices per image {classes}; a "
                             "batch traces the same number for every image")
        expected = (torch.softmax(z.detach(), dim=1) * z).sum(dim=1)
        chosen = z.gather(1, torch.tensor(classes, device=z.device)).sum(dim=0)
        outputs = torch.cat([chosen, expected.sum()[None]])
        keys = list(cap.tensors)
        # Parameters are frozen, so a site that does not depend on the image has no graph: its gradient is zero.
        needed = [k for k in keys if cap.tensors[k].requires_grad]
        # One release per block (each costs page faults later); an extra site's layers (BLIP's text layers) share
        # the block numbers and would take the vision blocks' places.
        per_layer = {k[0]: cap.tensors[k] for k in needed if k[1] not in extra}
        # A rule may first differentiate the retained graph itself (chefer_lrp: the plain gradient at F2).
        extra_grads = {name: {k: adapter.arrange_traced(ctx, k[1], k[0], g) for k, g in got.items()}
                       for name, got in rule_extra_grads(plan.rule, adapter, outputs, cap.tensors).items()}
        with releasing_during_backward(list(per_layer.values())):
            got = dict(zip(needed, batched_grad(outputs, [cap.tensors[k] for k in needed]))) if needed else {}
        release_freed_memory()
        grads = [got.get(k) for k in keys]
        acts, grad_by_key = {}, {}
        for k, g in zip(keys, grads):
            act = cap.tensors[k].detach()
            if g is None:  # allow_unused: the targets do not depend on this tensor at all
                g = torch.zeros((len(outputs), *act.shape), dtype=act.dtype, device=act.device)
            if k[1] not in extra:
                act, g = adapter.arrange_traced(ctx, k[1], k[0], act), adapter.arrange_traced(ctx, k[1], k[0], g)
            acts[k], grad_by_key[k] = act, g
    return PassResult(logits=z.detach(), classes=classes, acts=acts, grads=grad_by_key, grid=cap.grid, ctx=ctx,
                      deterministic=det, deterministic_settings=det_settings,
                      single_head=single_head_layers(model, adapter.attention_modules(model)),
                      extra_grads=extra_grads)
