"""The one place the kit differentiates: a batched (vmapped) backward pass of several outputs at once.

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

__all__ = ["batched_grad"]


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
    try:
        return torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs, is_grads_batched=True,
                                   allow_unused=True, retain_graph=retain_graph)
    except RuntimeError as exc:
        if "atching rule" not in str(exc) and "vmap" not in str(exc):
            raise
        raise TraceError("model: a gradient hook already on the model (e.g. another CAM library's) cannot "
                         f"run in the batched backward pass; remove it first ({exc})") from exc
