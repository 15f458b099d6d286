"""Recomputing each block's forward pass inside the backward pass, for traces whose Dataset is small beside the
model's graph.

Autograd keeps every tensor a block's backward needs (layer-norm inputs, attention matrices, MLP hidden states)
from the forward pass until the backward pass reaches the block, so a trace that stores few sites or layers (or
stores them in float16) peaks at the start of its backward pass at the whole graph, however small its Dataset.
:func:`recomputed_blocks` runs each block under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant): the
forward pass keeps only each block's input, and the backward pass runs the block forward again when it reaches it,
so the graph alive at any moment is one block's. The gradients are bitwise those of the plain pass, structurally:
the same kernels on the same inputs and shapes (each block reruns on its own input, and the backward is still one
batched call over every target; tested on a ViT); the cost is one more forward pass
of the blocks. The capture's hooks inside a block fire again during the recomputation; :func:`recomputed_blocks`
tells the capture to let those pass (``quiet``), so every site is read once, from the first forward pass.
This serves the tensor pass (a GPU with float32 storage); the array pass (the CPU, float16 storage) recomputes
through :mod:`vitcam_nb.capture.block_major` instead, which runs each block forward again once and differentiates
it one target at a time.

Example:
    >>> import timm, torch
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    >>> x = torch.zeros(1, 3, 32, 32, requires_grad=True)
    >>> with recomputed_blocks(list(m.blocks), contextlib.nullcontext):
    ...     y = m(x).sum()
    >>> [type(b).forward is b.forward.__func__ for b in m.blocks]  # the blocks are back as they were
    [True, True]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager

import torch
from torch.utils.checkpoint import checkpoint

from vitcam_nb.capture.graph_start import has_graph

__all__ = ["forwards_wrapped", "recomputed_blocks"]


@contextlib.contextmanager
def recomputed_blocks(blocks: Sequence[torch.nn.Module],
                      quiet: Callable[[], AbstractContextManager]) -> Iterator[None]:
    """Each of ``blocks`` checkpointed for the duration: its forward pass keeps only its inputs for the backward
    pass, which runs the block forward again (inside ``quiet()``) when it needs the block's tensors. Each block's
    own ``forward`` (an instance attribute or the class's) is restored on exit, also on error.

    Args:
        blocks: the modules to recompute (a model's transformer blocks).
        quiet: a context the recomputation runs in (the capture's: its hooks let the second firing pass).

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> with recomputed_blocks([lin], contextlib.nullcontext):
        ...     "forward" in vars(lin)
        True
        >>> "forward" in vars(lin)
        False
    """
    with forwards_wrapped(blocks, lambda _, forward: _checkpointed(forward, quiet)):
        yield


@contextlib.contextmanager
def forwards_wrapped(blocks: Sequence[torch.nn.Module], wrap: Callable[[int, Callable], Callable]) -> Iterator[None]:
    """Each of ``blocks`` runs ``wrap(i, its forward)`` in place of its ``forward`` for the duration; each block's own
    ``forward`` (an instance attribute or the class's) is restored on exit, also on error.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> with forwards_wrapped([lin], lambda i, forward: lambda x: forward(x) * 0):
        ...     lin(torch.ones(1, 2)).abs().sum().item()
        0.0
        >>> "forward" in vars(lin)
        False
    """
    saved = [(b, vars(b).get("forward")) for b in blocks]
    try:
        for i, (block, _) in enumerate(saved):
            block.forward = wrap(i, block.forward)
        yield
    finally:
        for block, own in saved:
            if own is None:
                vars(block).pop("forward", None)
            else:
                block.forward = own


def _checkpointed(forward: Callable, quiet: Callable[[], AbstractContextManager]) -> Callable:
    def run(*args: object, **kwargs: object) -> object:
        if not has_graph(args, kwargs):  # below the graph's start (capture.graph_start): nothing to recompute
            return forward(*args, **kwargs)
        calls = [0]

        def once_then_quiet(*a: object, **k: object) -> object:
            calls[0] += 1
            if calls[0] == 1:
                return forward(*a, **k)
            with quiet():
                return forward(*a, **k)

        # The model is in eval mode (no dropout), so no random state needs replaying.
        return checkpoint(once_then_quiet, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return run
