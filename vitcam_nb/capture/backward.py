"""The one place the kit differentiates: a batched (vmapped) backward pass of several outputs at once, or a plain one
for one target's vector (a pass that goes back one target at a time through each block).

The pass (:mod:`vitcam_nb.capture.passes`) calls it once per trace; a backward rule that needs a second backward
over the same retained graph (``chefer_lrp``: the plain gradient at F2 beside the relevance) calls it too, so
every backward the kit runs goes through the same checks.

Example:
    >>> import torch
    >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
    >>> [g.tolist() for g in batched_grad(torch.stack([x.sum(), (x * x).sum()]), [x])]
    [[[1.0, 1.0], [2.0, 4.0]]]
"""

from __future__ import annotations

import torch

from vitcam_nb.core.errors import TraceError

__all__ = ["batched_grad", "one_target_grad"]


def batched_grad(outputs: torch.Tensor, inputs: list, *, retain_graph: bool = False,
                 grad_outputs: torch.Tensor | None = None) -> tuple:
    """Gradients of every entry of ``outputs`` (each with its own one-hot) with respect to ``inputs`` (tensors or
    their gradient edges), in one vmapped backward pass; ``None`` for an input the outputs do not depend on. With
    ``grad_outputs`` (``(n, *outputs.shape)``), the ``n`` vectors it holds take the one-hots' place (a backward pass
    continued from gradients an earlier one stopped at).

    Example:
        >>> x = torch.tensor([3.0], requires_grad=True)
        >>> batched_grad((2 * x).sum()[None], [x])[0].tolist()
        [[2.0]]
        >>> batched_grad(2 * x, [x], grad_outputs=torch.tensor([[1.0], [5.0]]))[0].tolist()
        [[2.0], [10.0]]
    """
    if grad_outputs is None:
        grad_outputs = torch.eye(len(outputs), device=outputs.device, dtype=outputs.dtype)
    return _grad(outputs, inputs, grad_outputs, batched=True, retain_graph=retain_graph)


def one_target_grad(outputs: torch.Tensor, inputs: list, grad_outputs: torch.Tensor, *,
                    retain_graph: bool = False) -> tuple:
    """:func:`batched_grad` for one vector (``grad_outputs`` of shape ``(1, *outputs.shape)``) as a plain backward
    pass, without the vmap: the same kernels on the same rows (ops torch's batched backward has no batching rule
    for run row by row there, then concatenated), with less memory and time. The gradients keep their leading axis
    of one.

    Example:
        >>> x = torch.tensor([3.0], requires_grad=True)
        >>> one_target_grad(2 * x, [x], torch.tensor([[5.0]]))[0].tolist()
        [[10.0]]
    """
    got = _grad(outputs, inputs, grad_outputs[0], batched=False, retain_graph=retain_graph)
    return tuple(None if g is None else g[None] for g in got)


def _grad(outputs: torch.Tensor, inputs: list, grad_outputs: torch.Tensor, *, batched: bool,
          retain_graph: bool) -> tuple:
    try:
        return torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs, is_grads_batched=batched,
                                   allow_unused=True, retain_graph=retain_graph)
    except RuntimeError as exc:
        if "atching rule" not in str(exc) and "vmap" not in str(exc):
            raise
        raise TraceError("model: a gradient hook already on the model (e.g. another CAM library's) cannot "
                         f"run in the batched backward pass; remove it first ({exc})") from exc
