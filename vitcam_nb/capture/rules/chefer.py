"""Backward rule ``chefer_lrp`` on timm's ``VisionTransformer``: Chefer, Gur & Wolf's LRP relevance pass (CVPR
2021; official code hila-chefer/Transformer-Explainability, ``baselines/ViT/ViT_LRP.py`` and ``layers_ours.py``).

Under this rule autograd's backward carries *relevance*, not a gradient: the batched backward starts from the
one-hot of each target class (as the official ``relprop`` does), and every layer maps the relevance of its output
to that of its inputs. The stored "gradient" at every site of such a trace IS the LRP relevance there; at ``F2``
it is the relevance ``R_A`` of the attention map that Transformer Attribution multiplies by the attention gradient.

Each layer is a custom autograd Function whose forward returns the layer's own output unchanged and whose
backward is the layer's relevance rule (``generate_vmap_rule``: the pass's vmapped backward runs through it):

- Linear (``qkv``, ``proj``, ``fc1``, ``fc2``, ``head``): LRP-alpha1-beta0, bias left out of the denominator;
- LayerNorm, GELU (and softmax, dropout): relevance passes unchanged;
- ``A @ V`` and ``q k^T``: the z-rule, half the relevance to each operand (the relevance at ``A`` is the halved
  share, as the official code saves it); the scale on ``q`` cancels in the z-rule;
- each residual sum: relevance split in proportion to operand x relevance / sum, then each share rescaled so that
  the two shares keep the sum of the relevance (per image), as ``layers_ours.Add.relprop``;
- a fork (the block input feeding the attention and the residual): relevances summed (autograd's own sum).

Example:
    >>> import timm
    >>> from vitcam_nb.adapters import find_adapter
    >>> from vitcam_nb.capture.rules import check_rule_for
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
    >>> check_rule_for("chefer_lrp", m, find_adapter(m))
    'chefer_lrp'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch

from vitcam_nb.adapters.base import Adapter
from vitcam_nb.capture.backward import batched_grad
from vitcam_nb.capture.hooks import removable_hooks
from vitcam_nb.capture.rules.base import RuleImpl, register_rule
from vitcam_nb.capture.rules.vit import check_vit
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.rules import define_rule

__all__ = ["PLAIN_GRAD", "check_chefer", "check_chefer_target", "chefer_hooks", "plain_attention_grads", "safe_divide"]

#: The trace variable holding the plain gradient of each target at F2 in a ``chefer_lrp`` trace.
PLAIN_GRAD = "attn_plain_grad"

RULE = "chefer_lrp"
MODELS = "timm VisionTransformer with a class token head: vit_*, deit_* (no layer scale, no distillation head)"


def safe_divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a / b`` with the official code's stabiliser: ``a / (b + 1e-9)``, and 0 where ``b == 0``.

    Example:
        >>> safe_divide(torch.tensor([1.0, 1.0]), torch.tensor([2.0, 0.0])).tolist()
        [0.5, 0.0]
    """
    den = b + 1e-9
    den = den + (den == 0).to(den.dtype) * 1e-9
    return a / den * (b != 0).to(b.dtype)


class _Mode:
    """One pass's switch, held by every function of the pass (its last argument): while ``plain`` is True (inside
    :func:`plain_attention_grads` only) each passes autograd's own gradient to the layer's real output, so a
    backward over the same graph is the plain gradient. Per pass, so concurrent passes do not see each other's."""

    plain = False


def _per_image_sum(t: torch.Tensor) -> torch.Tensor:
    # The official code traces one image, summing over the whole tensor; here each image of a batch alone.
    return t.sum(dim=tuple(range(1, t.dim())), keepdim=True)


class _Pass(torch.autograd.Function):
    """``value`` forward; the relevance of the output goes to ``x`` unchanged (LayerNorm, GELU)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: torch.Tensor, x: torch.Tensor, mode: _Mode) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mode = inputs[-1]

    @staticmethod
    def backward(ctx, r: torch.Tensor) -> tuple:
        return (r, None, None) if ctx.mode.plain else (None, r, None)


class _Linear(torch.autograd.Function):
    """``value`` forward; LRP-alpha1-beta0 of ``x @ w.T`` backward (``half_times_value``: the incoming tensor is
    first turned into relevance as ``0.5 * value * g``, the z-rule's last step on q, k and v)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: torch.Tensor, x: torch.Tensor, w: torch.Tensor, half_times_value: bool,
                mode: _Mode) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        value, x, w, half, ctx.mode = inputs
        ctx.half = half
        ctx.save_for_backward(value, x, w)

    @staticmethod
    def backward(ctx, r: torch.Tensor) -> tuple:
        if ctx.mode.plain:
            return r, None, None, None, None
        value, x, w = ctx.saved_tensors
        if ctx.half:
            r = 0.5 * value * r
        wp, wn = w.clamp(min=0), w.clamp(max=0)
        xp, xn = x.clamp(min=0), x.clamp(max=0)
        s = safe_divide(r, xp @ wp.T + xn @ wn.T)
        return None, xp * (s @ wp) + xn * (s @ wn), None, None, None


class _Add(torch.autograd.Function):
    """``branch`` forward (the operand added to the residual ``resid``); backward the two shares of Add.relprop.
    The residual already receives the sum's relevance through the model's own ``+``, so it gets its share minus
    that here."""

    generate_vmap_rule = True

    @staticmethod
    def forward(branch: torch.Tensor, resid: torch.Tensor, mode: _Mode) -> torch.Tensor:
        return branch.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mode = inputs[-1]
        ctx.save_for_backward(*inputs[:2])

    @staticmethod
    def backward(ctx, r: torch.Tensor) -> tuple:
        if ctx.mode.plain:
            return r, None, None
        branch, resid = ctx.saved_tensors
        s = safe_divide(r, resid + branch)
        a, b = resid * s, branch * s
        a_sum, b_sum, total = _per_image_sum(a), _per_image_sum(b), _per_image_sum(r)
        norm = a_sum.abs() + b_sum.abs()
        a = a * safe_divide(safe_divide(a_sum.abs(), norm) * total, a_sum)
        b = b * safe_divide(safe_divide(b_sum.abs(), norm) * total, b_sum)
        return b, a - r, None


class _Scores(torch.autograd.Function):
    """The softmax attention ``value`` forward; backward the relevance of A passes through the softmax unchanged
    and the z-rule's first step on ``q k^T``: relevance / scores as the gradient of the (recomputed) scores."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: torch.Tensor, scores: torch.Tensor, mode: _Mode) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mode = inputs[-1]
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, r: torch.Tensor) -> tuple:
        if ctx.mode.plain:
            return r, None, None
        (scores,) = ctx.saved_tensors
        return None, safe_divide(r, scores), None


class _OnValue(torch.autograd.Function):
    """``x`` forward, ``x`` kept for a backward that rescales by it (the z-rule's steps on ``A @ V``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, mode: _Mode) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mode = inputs[-1]
        ctx.save_for_backward(inputs[0])


class _HalfTimesValue(_OnValue):
    """``x`` forward; backward ``0.5 * x * g``: the z-rule's last step on ``A`` in ``A @ V``."""

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple:
        if ctx.mode.plain:
            return g, None
        (x,) = ctx.saved_tensors
        return 0.5 * x * g, None


class _DivideByValue(_OnValue):
    """``x`` forward; backward ``r / x``: the z-rule's first step on ``A @ V`` (its output's relevance / output)."""

    @staticmethod
    def backward(ctx, r: torch.Tensor) -> tuple:
        if ctx.mode.plain:
            return r, None
        (x,) = ctx.saved_tensors
        return safe_divide(r, x), None


def check_chefer(model: torch.nn.Module, adapter: Adapter) -> None:
    """Refuse what Chefer's ViT does not have: besides the ViT family's checks, layer scales, a distillation
    head, and pooling other than the class token.

    Example:
        >>> import timm
        >>> from vitcam_nb.adapters import find_adapter
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1, global_pool="avg")
        >>> check_chefer(m, find_adapter(m))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: rule: rule='chefer_lrp' is defined here for ...
    """
    check_vit(model, adapter, RULE, models=MODELS)
    where = f"rule: rule={RULE!r} is defined here for {MODELS};"
    for i, blk in enumerate(adapter.blocks(model)):
        for name in ("ls1", "ls2"):
            if not isinstance(getattr(blk, name, None), torch.nn.Identity):
                raise TraceError(f"{where} block {i} has a layer scale ({name}), which Chefer's ViT has not")
    if getattr(model, "global_pool", None) != "token" or getattr(model, "head_dist", None) is not None:
        raise TraceError(f"{where} this model pools with {getattr(model, 'global_pool', None)!r} or has a "
                         "distillation head; Chefer's ViT reads the class token with one head")
    if not isinstance(getattr(model, "head", None), torch.nn.Linear):
        raise TraceError(f"{where} the model's head is a {type(getattr(model, 'head', None)).__name__}, not a Linear")
    registers = int(getattr(model, "num_reg_tokens", 0) or 0)
    if registers:  # Chefer's code reads a sequence of the class token and the patches; registers are neither
        raise TraceError(f"{where} this model has {registers} register tokens, which Chefer's ViT has not (its "
                         "relevance rollout covers the class token and the patches only)")


def check_chefer_target(target: object) -> None:
    """Refuse a target other than class logits: Chefer's relevance pass starts from the one-hot of a class (the
    official ``relprop``), and a contrast or a per-block read-out is a relevance it does not define.

    Example:
        >>> import vitcam_nb as vc
        >>> check_chefer_target(vc.targets.contrast(0, against=[1]))  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TraceError: targets: rule='chefer_lrp' starts its relevance from the one-hot of a class ...
    """
    from vitcam_nb.targets.classes import ClassTargets

    if not isinstance(target, ClassTargets):
        kind = getattr(target, "kind", type(target).__name__)
        raise TraceError(f"targets: rule={RULE!r} starts its relevance from the one-hot of a class (as the official "
                         f"relprop); a {kind} target is a relevance it does not define. Trace class targets "
                         "(\"topK\", an int or a list of ints), or this target with rule='gradient'")


def _linear_hook(mode: _Mode, half: bool, module: torch.nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return _Linear.apply(out, args[0], module.weight.detach(), half, mode)


def _pass_hook(mode: _Mode, _module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return _Pass.apply(out, args[0], mode)


@contextlib.contextmanager
def chefer_hooks(model: torch.nn.Module, adapter: Adapter) -> Iterator[None]:
    """The hooks of ``chefer_lrp``, removed on exit, also on error. Forward hooks go first (``prepend``) so the
    sites read the rule's tensors; the one on ``attn_drop``'s output that turns the gradient at A into relevance
    goes last, after the capture's ``F2`` hook, so that ``F2``'s stored gradient is the relevance ``R_A``.

    Example:
        >>> import timm
        >>> from vitcam_nb.adapters import find_adapter
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> with chefer_hooks(m, find_adapter(m)):
        ...     len(m.blocks[0].attn.attn_drop._forward_hooks)
        2
        >>> len(m.blocks[0].attn.attn_drop._forward_hooks)
        0
    """
    with removable_hooks() as handles:
        def add(module: torch.nn.Module, hook, pre: bool = False, prepend: bool = True) -> None:
            register = module.register_forward_pre_hook if pre else module.register_forward_hook
            handles.append(register(hook, prepend=prepend))

        mode = _Mode()
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                add(module, partial(_pass_hook, mode))
        add(model.head, partial(_linear_hook, mode, False))
        for blk in adapter.blocks(model):
            _block_hooks(blk, add, mode)
        yield


def _block_hooks(blk: torch.nn.Module, add, mode: _Mode) -> None:
    attn, mlp, seen = blk.attn, blk.mlp, {}

    def keep(name: str):
        def hook(_m: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            seen[name] = args[0] if name.startswith("resid") else out
        return hook

    def scores(_m: torch.nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        # The scores recomputed with timm's ops: the relevance of A reaches q and k only through them.
        return _Scores.apply(out, (seen.pop("q") * attn.scale) @ seen.pop("k").transpose(-2, -1), mode)

    def residual(name: str):
        def hook(_m: torch.nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            return _Add.apply(out, seen.pop(name), mode)
        return hook

    add(blk.norm1, keep("resid1"), prepend=False)
    add(blk.norm2, keep("resid2"), prepend=False)
    add(attn.q_norm, keep("q"))
    add(attn.k_norm, keep("k"))
    add(attn.qkv, partial(_linear_hook, mode, True))
    add(attn.attn_drop, scores)
    add(attn.attn_drop, lambda _m, _a, out: _HalfTimesValue.apply(out, mode), prepend=False)
    add(attn.proj, lambda _m, args: (_DivideByValue.apply(args[0], mode), *args[1:]), pre=True)
    for linear in (attn.proj, mlp.fc1, mlp.fc2):
        add(linear, partial(_linear_hook, mode, False))
    add(mlp.act, partial(_pass_hook, mode))
    add(blk.drop_path1, residual("resid1"))
    add(blk.drop_path2, residual("resid2"))


def plain_attention_grads(outputs: torch.Tensor, tensors: dict) -> dict[str, dict]:
    """The plain gradient of each output at every stored F2 tensor (Transformer Attribution's ``dA``: the
    official code's hook on the attention after dropout), by one batched backward over the retained graph with
    every relevance function passing autograd's own gradient; ``{}`` when F2 is not traced.

    Example:
        >>> plain_attention_grads(torch.zeros(1), {})
        {}
    """
    keys = [k for k, t in tensors.items() if k[1] == "F2" and t.requires_grad]
    if not keys:
        return {}
    # The pass's switch, reached through the F2 tensor: its node is this rule's scores function (ctx = grad_fn).
    mode = getattr(tensors[keys[0]].grad_fn, "mode", None)
    if not isinstance(mode, _Mode):
        raise TraceError("rule: chefer_lrp: the F2 tensor is not the rule's own (another hook replaced it); remove "
                         "other forward hooks on attn_drop")
    mode.plain = True
    try:
        # outputs without a graph: a head that reads no traced layer (capture.graph_start), whose gradients are 0
        got = batched_grad(outputs, [tensors[k] for k in keys], retain_graph=True) if outputs.requires_grad \
            else [None] * len(keys)
    finally:
        mode.plain = False
    return {PLAIN_GRAD: {k: torch.zeros((len(outputs), *tensors[k].shape), dtype=tensors[k].dtype,
                                        device=tensors[k].device) if g is None else g for k, g in zip(keys, got)}}


define_rule(
    RULE,
    "Chefer et al.'s LRP relevance pass: the backward carries relevance, not a gradient, from the one-hot of "
    "the class (the stored 'gradient' at every site IS the LRP relevance there): Linear layers by "
    "LRP-alpha1-beta0 (bias left out), LayerNorm, GELU, softmax and dropout pass relevance unchanged, the "
    "products q k^T and A V by the z-rule with half the relevance to each operand, each residual sum split in "
    "proportion to its operands and rescaled to keep the sum, relevance at a fork summed",
    "Chefer, Gur & Wolf 2021, Transformer Interpretability Beyond Attention Visualization, CVPR; official code "
    "github.com/hila-chefer/Transformer-Explainability (baselines/ViT/ViT_LRP.py, layers_ours.py)",
    order=40, replace=True)
register_rule(RULE, RuleImpl("vit", check_chefer, chefer_hooks, MODELS, plain_attention_grads, (PLAIN_GRAD,),
                             check_chefer_target), replace=True)
