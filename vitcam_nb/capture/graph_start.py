"""The pass's autograd graph starts at the lowest traced layer: a trace of the last layer only needs no graph below it.

The gradients a trace stores are those of the targets with respect to tensors in the traced layers; every path
from the targets to a tensor in layer ``L`` runs above it, so nothing below block ``L`` enters them. The pass gives
the image no gradient, and :func:`graph_from` makes block ``L``'s input a leaf of the graph as the block receives
it (the parameters are frozen, so nothing else has one). The blocks below run as they would under
``torch.no_grad()``: autograd keeps nothing of them, a recomputing pass runs them once, and the forward values are
bitwise the same (the same kernels on the same inputs). A trace of one late layer holds one block's graph, not the
model's.

Example:
    >>> import timm, torch
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3).eval()
    >>> m.requires_grad_(False)  # doctest: +ELLIPSIS
    VisionTransformer(...)
    >>> with graph_from(list(m.blocks), 2) as start:
    ...     y = m(torch.zeros(1, 3, 32, 32))
    >>> start.input.requires_grad, start.input.grad_fn is None, y.requires_grad
    (True, True, True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from vitcam_nb.core.errors import TraceError

__all__ = ["GraphStart", "graph_from", "has_graph"]


class GraphStart:
    """What :func:`graph_from` saw: the leaf the graph starts at (``None`` until block ``start`` has run, and when
    the graph starts at the image).

    Example:
        >>> GraphStart(0).input is None
        True
    """

    def __init__(self, start: int):
        self.start = start
        self.input: torch.Tensor | None = None

    def check(self) -> None:
        """Refuse a pass whose graph should have started at a block that never received a tensor.

        Example:
            >>> GraphStart(3).check()
            Traceback (most recent call last):
            vitcam_nb.core.errors.TraceError: model: block 3 ran on no floating-point tensor, ...
        """
        if self.start and self.input is None:
            raise TraceError(f"model: block {self.start} ran on no floating-point tensor, so the pass cannot start "
                             "its gradients there; trace from layer 0 (layers=None) for this model")


@contextlib.contextmanager
def graph_from(blocks: Sequence[torch.nn.Module], start: int) -> Iterator[GraphStart]:
    """For the duration, block ``start`` receives its input (its first tensor argument, or ``hidden_states``) as
    a new leaf that requires a gradient, so the pass's graph starts there; with ``start`` 0 nothing changes (the
    caller gives the image its gradient). The hook goes first among the block's pre-hooks, so hooks that read the
    block's input read the leaf, and is removed on exit, also on error.

    Args:
        blocks: the model's transformer blocks (``adapter.blocks(model)``).
        start: the block whose input starts the graph (:attr:`~vitcam_nb.capture.plan.TracePlan.graph_start`).

    Example:
        >>> blocks = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).requires_grad_(False)
        >>> with graph_from(blocks, 1) as s:
        ...     out = blocks(torch.ones(1, 2))
        >>> out.requires_grad, s.input.grad_fn is None, blocks(torch.ones(1, 2)).requires_grad  # hook removed
        (True, True, False)
    """
    seen = GraphStart(start)
    if not start:
        yield seen
        return

    def leaf(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if seen.input is not None:
            return None  # a recomputation runs the block again on the leaf itself
        for i, a in enumerate(args):
            if _floating(a):
                seen.input = a.detach().requires_grad_(True)
                return (*args[:i], seen.input, *args[i + 1:]), kwargs
        if _floating(kwargs.get("hidden_states")):
            seen.input = kwargs["hidden_states"].detach().requires_grad_(True)
            return args, {**kwargs, "hidden_states": seen.input}
        return None

    handle = blocks[start].register_forward_pre_hook(leaf, prepend=True, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def has_graph(args: tuple, kwargs: dict) -> bool:
    """Whether a block's call has an input in the pass's graph (the parameters are frozen: nothing else is); a
    block below the graph's start has none, and a recomputing pass runs it as it is.

    Example:
        >>> has_graph((torch.ones(1),), {}), has_graph((), {"x": torch.ones(1, requires_grad=True)})
        (False, True)
    """
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values()))


def _floating(a: object) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()
