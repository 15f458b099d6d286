"""The backward pass of a trace that recomputes its blocks, block by block: each block recomputed once for all
targets, its backward one target at a time.

A pass that recomputes each block under torch's checkpoint (:mod:`vitcam_nb.capture.recompute`) runs all its
targets through every block in one batched backward call, whose transients are every target's (and torch's batched
backward runs ops without a batching rule row by row, then concatenates them); split into target groups, it would
run one call per group over the whole graph, the blocks recomputed once per call. Here the backward pass goes block
by block instead, from the top. The head goes first, from the outputs to the top block's output, in the target
groups (:attr:`~vitcam_nb.capture.plan.TracePlan.target_groups`: all the targets in one, or two or three targets
each; never a group of one, which would multiply matrix by vector in the head, whose sums round otherwise). Then
each block, one target at a time, in a plain backward call without the batched backward's vmap: that target's
gradients at the block's input are taken from those at its output, and they are the next block's output
gradients; one target's transients are alive at a time, and each block's backward computes every row as the
batched backward over all targets does, to float32 rounding: its matrix products have one target's batch shape,
which rounds otherwise on some CPUs (tested within 1e-5 of each element's magnitude plus 1e-5 of the array's
largest, for every family that recomputes; the benchmark checks ViT-S/16 and ViT-B/16 at full size).
:class:`SharedRecompute` keeps each block's saved tensors out of the forward pass (as torch's checkpoint does) and
recomputes them once, when the first target's call first needs them; they stay for the other targets' calls over
that block and go with the last.

This is only right when every path from the outputs to a block goes through the next block's input (a chain of
blocks, as timm's ViTs and Swins are): :func:`chained` checks it on the pass's own autograd graph, and a pass
whose graph is not such a chain goes back group by group over the whole graph, recomputing each block per group,
as before. The gradients equal those of one batched backward pass to float32 rounding (tested for every family
that recomputes).

Example:
    >>> import contextlib, timm, torch
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    >>> shared = SharedRecompute(list(m.blocks), contextlib.nullcontext)
    >>> x = torch.zeros(1, 3, 32, 32, requires_grad=True)
    >>> with shared.installed():
    ...     y = m(x)[0, :2]
    >>> chained(y, shared.inputs)
    True
    >>> [g.shape for g in torch.autograd.grad(y.sum(), [x])]  # the blocks recompute as the backward needs them
    [torch.Size([1, 3, 32, 32])]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge, saved_tensors_hooks

from vitcam_nb.capture.backward import batched_grad, one_target_grad
from vitcam_nb.capture.graph_start import has_graph
from vitcam_nb.capture.prealloc import Arrays, lowest_tensors
from vitcam_nb.capture.recompute import forwards_wrapped
from vitcam_nb.core.errors import TraceError

__all__ = ["SharedRecompute", "backward_by_block", "chained"]

Handle = tuple[int, int]


class SharedRecompute:
    """Each of ``blocks`` keeps only its inputs from the forward pass; the saved tensors its backward needs are
    recomputed (inside ``quiet()``, so the capture reads every site once) when a backward call first asks for one
    of them, and kept while :attr:`keep` is true (for the next group's call over the same block); otherwise each
    goes as it is used, and a call that asks again recomputes the block again.

    Args:
        blocks: the model's transformer blocks, in the order the forward pass runs them.
        quiet: a context the recomputation runs in (the capture's).

    Example:
        >>> import contextlib
        >>> lin = torch.nn.Linear(2, 2)
        >>> shared = SharedRecompute([lin], contextlib.nullcontext)
        >>> with shared.installed():
        ...     y = lin(torch.ones(1, 2, requires_grad=True)).sum()
        >>> shared.inputs[0].shape, "forward" in vars(lin)
        (torch.Size([1, 2]), False)
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], quiet: Callable[[], AbstractContextManager]):
        self.blocks, self.quiet = list(blocks), quiet
        #: each block's input tensor from the forward pass (its graph's), None for a block that did not run
        self.inputs: list[torch.Tensor | None] = [None] * len(self.blocks)
        #: the output of the block that ran last (the top block's, once the forward pass is done)
        self.output: torch.Tensor | None = None
        #: keep recomputed tensors for another backward call over the same block
        self.keep = False
        self._calls: dict[int, tuple[Callable, tuple, dict]] = {}
        self._counts: dict[int, int] = {}
        self._cache: dict[int, dict[int, torch.Tensor]] = {}

    def installed(self) -> AbstractContextManager:
        """Each block's ``forward`` wrapped for the duration, its own (an instance attribute or the class's)
        restored on exit, also on error (:func:`~vitcam_nb.capture.recompute.forwards_wrapped`)."""
        return forwards_wrapped(self.blocks, self._wrapped)

    def _wrapped(self, i: int, forward: Callable) -> Callable:
        def run(*args: object, **kwargs: object) -> object:
            if not has_graph(args, kwargs):  # below the graph's start (capture.graph_start): nothing to keep
                return forward(*args, **kwargs)
            if i in self._calls:
                raise TraceError(f"model: block {i} ran twice in one forward pass; a trace that recomputes its "
                                 "blocks needs each to run once")
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self.inputs[i] = x
            # What the recomputation runs on: the same values, without this forward pass's graph.
            self._calls[i] = (forward, tuple(_detached(a) for a in args),
                              {k: _detached(v) for k, v in kwargs.items()})
            self._counts[i] = 0

            def pack(t: torch.Tensor) -> Handle:
                self._counts[i] += 1
                return i, self._counts[i] - 1

            with saved_tensors_hooks(pack, self._unpack):
                out = forward(*args, **kwargs)
            self.output = out if isinstance(out, torch.Tensor) else None
            return out

        return run

    def _unpack(self, handle: Handle) -> torch.Tensor:
        i, n = handle
        cache = self._cache.get(i)
        if cache is None or n not in cache:
            cache = self._cache[i] = self._recompute(i)
        return cache[n] if self.keep else cache.pop(n)

    def _recompute(self, i: int) -> dict[int, torch.Tensor]:
        if i not in self._calls:
            raise TraceError(f"model: the backward pass came back to block {i} after it was done with it; its graph "
                             "is not a chain of blocks")
        forward, args, kwargs = self._calls[i]
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> None:
            saved.append(t.detach())

        def never(_: object) -> torch.Tensor:  # the recomputation's own graph is never differentiated
            raise AssertionError("unreachable")

        with torch.enable_grad(), self.quiet(), saved_tensors_hooks(pack, never):
            forward(*args, **kwargs)
        if len(saved) != self._counts[i]:
            raise TraceError(f"model: block {i} saved {len(saved)} tensors when run again for the backward pass, "
                             f"{self._counts[i]} the first time; its forward pass does not rerun the same way, so "
                             "it cannot be recomputed")
        return dict(enumerate(saved))

    def done(self, i: int) -> None:
        """The backward pass is done with block ``i``: drop what it recomputed, what it would recompute from, and
        the input of the block above it (whose gradients the pass has taken), so that the blocks' inputs go as the
        pass goes down."""
        self._cache.pop(i, None)
        self._calls.pop(i, None)
        if i + 1 < len(self.inputs):
            self.inputs[i + 1] = None

    def clear(self) -> None:
        """Drop everything: the recomputed tensors and the blocks' inputs."""
        self._cache.clear()
        self._calls.clear()
        self.inputs = [None] * len(self.blocks)
        self.output = None


def _detached(a: object) -> object:
    if isinstance(a, torch.Tensor):
        return a.detach().requires_grad_(a.requires_grad)
    return a


def _edge(t: torch.Tensor | GradientEdge) -> GradientEdge:
    return t if isinstance(t, GradientEdge) else get_gradient_edge(t)


def chained(outputs: torch.Tensor, inputs: Sequence[torch.Tensor | None]) -> bool:
    """Whether every path in the autograd graph from ``outputs`` down to block ``i``'s input passes through block
    ``i + 1``'s input, for every block that ran with a graph: then the gradients at a block's input follow from
    those at the next block's input alone, and the backward pass may go block by block.

    Example:
        >>> a = torch.ones(2, requires_grad=True) * 1
        >>> b = a * 2
        >>> chained((b * 3).sum(), [a, b]), chained((b * 3 + a).sum(), [a, b])  # a second path from the top to a
        (True, False)
    """
    # A block's input is in the graph when it has a grad_fn, or is the leaf the graph starts at (capture.graph_start)
    cuts = [_edge(t) for t in inputs if t is not None and t.requires_grad]
    if len(cuts) != sum(t is not None for t in inputs):
        return False  # a block that ran on a tensor without a graph: nothing to chain
    for lower, upper in zip(cuts[:-1], cuts[1:]):
        seen, stack = {upper.node}, [outputs.grad_fn]  # never past the next block's input
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            if node is lower.node:
                return False
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions if n is not None and n not in seen)
    return True


def backward_by_block(store: Arrays, outputs: torch.Tensor, bounds: Sequence[int], shared: SharedRecompute) -> bool:
    """The backward pass of ``outputs`` into ``store``, block by block from the top: first the head, from the outputs
    to the top block's output, in the target groups ``bounds`` (:func:`~vitcam_nb.capture.plan.group_bounds`; a
    group of one target would round otherwise in the head's matrix-vector product); then each block, one target at
    a time: one plain backward call per target (no vmap: :func:`~vitcam_nb.capture.backward.one_target_grad`) from
    its gradients at the block above's input to this block's input and the tensors captured in it, whose hooks
    write their gradients. A block's recomputed tensors serve every target and are dropped after the last. Returns
    False, having run nothing, when the graph is not a chain of blocks (:func:`chained`) or some block between the
    top and the lowest captured layer did not run.

    Example:
        >>> import contextlib, timm
        >>> from vitcam_nb.capture.plan import TracePlan
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> store = Arrays(TracePlan.for_trace(m.eval(), "top3", sites=["F1"]), 1, lambda k, t: t, hooks=False)
        >>> shared = SharedRecompute(list(m.blocks), contextlib.nullcontext)
        >>> x = torch.zeros(1, 3, 32, 32, requires_grad=True)
        >>> with shared.installed():
        ...     h = m.blocks[0](m._pos_embed(m.patch_embed(x)))
        ...     store.keep((0, "F1"), h)
        ...     y = m.forward_head(m.norm(m.blocks[1](h)))[0, :4]
        >>> store.begin_backward(4)
        >>> backward_by_block(store, y, [0, 2, 4], shared)
        True
        >>> store.finish_backward()
        >>> grad = store.filled[0][((0, 1), ("F1",), "grad")]  # (target, layer, site, token, channel)
        >>> grad.shape, bool((grad[:, 0] != 0).all(axis=(1, 2, 3)).all())
        ((4, 2, 1, 17, 192), True)
    """
    by_layer: dict[int, list[tuple[tuple[int, str], GradientEdge]]] = {}
    for key, edge in store.edges.items():
        by_layer.setdefault(key[0], []).append((key, edge))
    if not by_layer:
        return True  # nothing captured has a graph: nothing to differentiate
    ran = [i for i, t in enumerate(shared.inputs) if t is not None]
    low, top = min(by_layer), max(ran, default=-1)
    if shared.output is None or top < max(by_layer) or any(shared.inputs[i] is None for i in range(low, top + 1)) \
            or not chained(outputs, [*shared.inputs[low:top + 1], shared.output]):
        return False
    heads = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    singles = [(t, t + 1) for t in range(heads[-1][1])]
    # (block, the tensor its region stops at, the target groups): the head first, then the blocks from the top
    stages = [(None, shared.output, heads)] + [(i, shared.inputs[i] if i > low else None, singles)
                                                for i in range(top, low - 1, -1)]
    grads: list[torch.Tensor | None] | None = None  # at the region's root, per group (None: the outputs' one-hots)
    root: torch.Tensor = outputs
    try:
        for block, cut, groups in stages:
            keys = by_layer.get(block, []) if block is not None else []
            root_edge = _edge(root) if block is not None else None
            # a tensor captured at the block's output is the block above's input: its gradient arrived there
            region = [(k, e) for k, e in keys if not _same(e, root_edge)]
            at_root = [k for k, e in keys if _same(e, root_edge)]
            wanted = _unique(([_edge(cut)] if cut is not None else []) + [e for _, e in region])
            inputs = [wanted[j] for j in lowest_tensors(wanted)] if store.hooks else wanted
            if cut is not None and not _same(inputs[0], _edge(cut)):
                inputs.insert(0, _edge(cut))
            below: list[torch.Tensor | None] = []
            for j, (start, stop) in enumerate(groups):
                store.backward_targets(start, stop)
                shared.keep = block is not None and j < len(groups) - 1
                if grads is None:
                    got = batched_grad(outputs[start:stop], inputs, retain_graph=True)
                else:
                    g, grads[j] = grads[j], None
                    if g is not None and not store.hooks:
                        for key in at_root:
                            store.put_grad(key, store.arrange(key, g))
                    if g is None or not inputs:  # no gradient arrives here, or all captured here is written
                        below.append(None)
                        continue
                    store.batched = False  # one target: a plain backward pass, no vmap
                    try:
                        got = one_target_grad(root, inputs, g, retain_graph=True)
                    finally:
                        store.batched = True
                    del g
                if not store.hooks:
                    for key, edge in region:
                        g = next((g for e, g in zip(inputs, got) if _same(e, edge)), None)
                        if g is not None:
                            store.put_grad(key, store.arrange(key, g))
                below.append(got[0] if cut is not None else None)
                del got
            if block is None:  # from the head's groups to one target at a time
                below = [None if g is None else g[r:r + 1] for g, (a, b) in zip(below, groups) for r in range(b - a)]
            grads, root = below, cut  # the block above's input goes: its gradients are taken
            del cut
            if block is not None:
                shared.done(block)
    finally:
        shared.keep = False
    return True


def _same(a: GradientEdge | None, b: GradientEdge | None) -> bool:
    return a is not None and b is not None and a.node is b.node and a.output_nr == b.output_nr


def _unique(edges: list[GradientEdge]) -> list[GradientEdge]:
    out: list[GradientEdge] = []
    for e in edges:
        if not any(_same(e, o) for o in out):
            out.append(e)
    return out
