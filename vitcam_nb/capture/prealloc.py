"""The array pass (``run_pass(..., arrays=True)``; :func:`writes_arrays` says when a trace takes it): each
captured variable's final array, allocated once per image in the storage dtype, and written as the backward pass
reaches it: a tensor hook on the captured tensor copies its values and its gradients the moment autograd has
summed them, and the tensor is let go (the graph alone decides its life). Nothing large is held twice or copied
at the end; the memory the backward pass frees stays for the next block's transients, and is handed back to the
system only when the pass has added more than its cap (:class:`~vitcam_nb.capture.resident.ResidentCap`).

Token sites of the same layers (a flat model's layers, or one stage of a hierarchical one) share one
``(layer, site, token, channel)`` array and its ``(target, layer, site, token, channel)`` gradient, the arrays the
trace Dataset holds; a flat model's attention matrices one ``(layer, head, query, key)`` array per site, a
hierarchical stage's windowed attention one ``(layer, head, query, window key)`` array. Anything else (a
cross-attention site, shapes that do not line up) is kept per (layer, site) in the storage dtype and laid out by
:func:`vitcam_nb.capture.assemble.assemble` as before.

Example:
    >>> import timm
    >>> from vitcam_nb.capture.plan import TracePlan
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    >>> arrays = Arrays(TracePlan.for_trace(m, "top1", sites=["F1", "F2"]), 1, lambda k, t: t, hooks=True)
    >>> arrays.groups
    [((0, 1), ('F1',)), ((0, 1), ('F2',))]
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from vitcam_nb.capture.backward import batched_grad
from vitcam_nb.capture.buffers import reusable_empty
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.schema import ATTENTION_SITE, SCORES_SITE

__all__ = ["HOOKS_FROM", "Arrays", "batched_hooks_work", "copy_into", "lowest_tensors", "unbatched", "writes_arrays"]

Key = tuple[int, str]
Group = tuple[tuple[int, ...], tuple[str, ...]]


def writes_arrays(plan: TracePlan) -> bool:
    """Whether a trace's pass writes into its final arrays (``run_pass(..., arrays=True)``): on the CPU, and
    wherever the storage dtype is narrower than the compute dtype (float16 storage of a float32 model). The tensor
    pass keeps autograd's gradient tensors and copies them into the Dataset at the end, so it holds every gradient
    twice for a moment unless it hands freed memory back block by block, which faults the pages in again (measured
    in ``benchmarks/memsizes.py`` and item 1 of ``python -m benchmarks``). On a GPU with storage as wide as the
    computation, the gradients stay on the device until the end and the tensor pass is kept.

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> [writes_arrays(TracePlan.for_trace(m, "top1", dtype=d)) for d in ("float32", "float16")]
        [True, True]
    """
    narrower = np.dtype(plan.store_dtype).itemsize < torch.finfo(plan.compute_dtype).bits // 8
    return narrower or plan.run_device.type == "cpu"


def copy_into(dest: np.ndarray, t: torch.Tensor) -> None:
    """Write tensor ``t`` into ``dest`` through float32 on the CPU, as
    :func:`vitcam_nb.capture.assemble.to_numpy` converts it. torch's cast to the storage dtype rounds to nearest
    even as numpy's does (float16 storage is bitwise the tensor pass's), about eight times faster on one core, in
    place; a value beyond float16 becomes inf as with numpy, but without numpy's RuntimeWarning.

    Example:
        >>> out = np.empty(2, np.float16)
        >>> copy_into(out, torch.tensor([1.0, 2.5]))
        >>> out.tolist()
        [1.0, 2.5]
    """
    t = t.detach()
    if dest.dtype == np.float32 and t.dtype == torch.float32 and t.device.type == "cpu" and not t.is_neg():
        # float32 into float32: the same bytes by numpy's copy, about half torch's cost on a small VLM's many small
        # arrays (issue 55's trace-cost row)
        np.copyto(dest, t.numpy().reshape(dest.shape))
        return
    torch.from_numpy(dest).copy_(t.to("cpu", torch.float32).reshape(dest.shape))


def unbatched(g: torch.Tensor, n: int) -> torch.Tensor:
    """The plain ``(n, ...)`` tensor behind a gradient a tensor hook receives inside
    ``torch.autograd.grad(..., is_grads_batched=True)`` (torch runs that backward under its first-generation
    vmap, whose batched tensors hold the ``n`` vectors; this takes the innermost level off).

    Example:
        >>> seen = []
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = x * 3
        >>> _ = y.register_hook(lambda g: seen.append(unbatched(g, 2).clone()))
        >>> _ = torch.autograd.grad(y, [x], grad_outputs=torch.eye(2), is_grads_batched=True)
        >>> seen[0].tolist()
        [[1.0, 0.0], [0.0, 1.0]]
    """
    level = torch._C._vmapmode_increment_nesting()
    torch._C._vmapmode_decrement_nesting()
    return torch._remove_batch_dim(g, level - 1, n, 0)


#: A pass whose captured tensors and their gradients take fewer bytes than this (in the compute dtype) has autograd
#: return the gradients at once instead of tensor hooks writing each as it comes: holding them all costs at most this
#: much, while the hooks and the graph walk that picks the tensors to return cost about half a millisecond a pass on
#: a 10-ms model (issue 55's trace-cost row). The values are the same either way (autograd's summed gradient of each
#: tensor, handed to its hook or returned).
HOOKS_FROM = 4 << 20

_PROBE: list[bool] = []


def batched_hooks_work() -> bool:
    """Whether this torch lets a tensor hook read the plain gradients of a batched backward pass
    (:func:`unbatched`), checked once on a tiny graph; without it the pass takes the gradients from autograd's
    return value instead (same values, more memory held at the end of the backward).

    Example:
        >>> batched_hooks_work() in (True, False)
        True
    """
    if not _PROBE:
        try:
            seen: list[torch.Tensor] = []
            x = torch.arange(1.0, 4.0, requires_grad=True)
            y = x * 2
            y.register_hook(lambda g: seen.append(unbatched(g, 2).clone()))
            z = torch.stack([y.sum(), (y * y).sum()])
            (want,) = batched_grad(z, [y])
            _PROBE.append(len(seen) == 1 and seen[0].shape == want.shape and torch.equal(seen[0], want))
        except (AttributeError, RuntimeError, TypeError, TraceError):
            _PROBE.append(False)
    return _PROBE[0]


def lowest_tensors(tensors: Sequence[torch.Tensor | GradientEdge]) -> list[int]:
    """Indices of the tensors (each requiring grad, or its :class:`~torch.autograd.graph.GradientEdge`) no other
    of ``tensors`` lies below in the autograd graph. A backward pass to these runs every node a backward pass to
    all of them runs (each other tensor is on a path to one of them), so their hooks see the same gradients,
    while autograd holds only these tensors' gradients to return.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> a = x * 2
        >>> b = a + 1
        >>> lowest_tensors([b, a])
        [1]
    """
    # A leaf's edge is its AccumulateGrad node.
    nodes = [t if isinstance(t, GradientEdge) else get_gradient_edge(t) for t in tensors]
    edges = {(e.node, e.output_nr) for e in nodes}
    # Nodes whose whole subgraph holds no edge: never walked twice. Each search below one tensor's node stops at
    # the first edge it meets (a site's tensor is usually a few nodes above the next site's), so only the lowest
    # tensors' searches walk down to the graph's leaves, once.
    dead: set[object] = set()
    below: dict[object, bool] = {}
    for e in nodes:
        if e.node not in below:
            below[e.node] = _reaches(e.node, edges, dead)
    return [i for i, e in enumerate(nodes) if not below[e.node]]


def _reaches(start: object, edges: set[tuple[object, int]], dead: set[object]) -> bool:
    """Whether an edge lies strictly below ``start``; every node of a search that finds none joins ``dead`` (no
    edge strictly below it)."""
    seen = {start}
    stack = [start]
    while stack:  # depth first without recursion: a deep model's graph is thousands of nodes long
        for n, nr in stack.pop().next_functions:  # a new tuple on every access: read once per node
            if (n, nr) in edges:  # before ``dead``: a dead node (nothing below it) may be an edge itself
                return True
            if n is None or n in dead:
                continue
            if n not in seen:
                seen.add(n)
                stack.append(n)
    dead.update(seen)
    return False


class Arrays:
    """One pass's per-image arrays in the plan's storage dtype. After the forward pass each captured site tensor is
    handed to :meth:`keep`: its values are copied into their array, and a tensor hook will write its gradients
    there from inside the batched backward pass; only the tensor's gradient edge is kept, never the tensor.

    Args:
        plan: the pass's plan (layers, sites, storage dtype, adapter).
        n_images: images in the pass.
        arrange: puts a captured tensor (``(batch, ...)`` or ``(targets, batch, ...)``) in schema layout.
        hooks: register the gradient hooks (False: the caller writes the gradients autograd returns).
        on_write: called after each gradient is written (the pass checks its resident memory there, and hands what
            the backward pass freed back to the system when it has added too much: ``capture.resident``).
        hold: hold each captured tensor until its gradient arrives and write its values then, as the graph holds it
            anyway (False: write its values when it is kept and let it go; a pass that recomputes each block keeps
            no graph that would hold it).

    Example:
        >>> import timm
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
        >>> a = Arrays(TracePlan.for_trace(m, "top1", sites=["F1"]), 2, lambda k, t: t, hooks=False)
        >>> a.keep((0, "F1"), torch.ones(2, 17, 192))  # no graph: no edge, a zero gradient
        >>> a.begin_backward(2)
        >>> a.finish_backward()
        >>> a.filled[1][((0,), ("F1",), "act")].shape, a.filled[1][((0,), ("F1",), "grad")].shape
        ((1, 1, 17, 192), (2, 1, 1, 17, 192))
    """

    def __init__(self, plan: TracePlan, n_images: int, arrange: Callable[[Key, torch.Tensor], torch.Tensor], *,
                 hooks: bool, on_write: Callable[[], None] | None = None, hold: bool = True):
        self.dtype = plan.store_dtype
        self.n_images, self.arrange, self.hooks, self.on_write = n_images, arrange, hooks, on_write
        self.hold = hold
        extra = plan.extra_layers
        token_sites = tuple(s for s in plan.site_ids if s not in (ATTENTION_SITE, SCORES_SITE) and s not in extra)
        if getattr(plan.adapter, "hierarchical", False):
            # One stage's blocks share a grid and a width: each traced stage is one Dataset node of its own, with
            # its windowed attention as one (layer, head, query, window key) array (the staged assembly adds the
            # keys' raster tokens).
            stages = [tuple(i for i in plan.layer_ids if i in ids) for ids in plan.adapter.stages(plan.model)]
            groups = [(ids, token_sites) for ids in stages if ids and token_sites]
            groups += [(ids, (ATTENTION_SITE,)) for ids in stages if ids and ATTENTION_SITE in plan.site_ids]
        else:
            ids = tuple(plan.layer_ids)
            groups = [(ids, token_sites)] if token_sites else []
            groups += [(ids, (s,)) for s in (ATTENTION_SITE, SCORES_SITE) if s in plan.site_ids]
        self.groups: list[Group] = groups
        self._group_of = {(layer, s): g for g in groups for layer in g[0] for s in g[1]}
        #: where each key's values go: (group, index into the group's array after the target axis)
        self.slots: dict[Key, tuple[Group, tuple[int, ...]]] = {}
        self._broken: set[Group] = set()
        #: per image: (layers, sites, "act" | "grad") -> the group's array
        self.filled: list[dict[tuple, np.ndarray]] = [{} for _ in range(n_images)]
        #: per image: key -> activation (1, ...) and gradients (targets, 1, ...) of a key outside every group
        self.acts: list[dict[Key, np.ndarray]] = [{} for _ in range(n_images)]
        self.grads: list[dict[Key, np.ndarray]] = [{} for _ in range(n_images)]
        #: the gradient edge of every kept tensor that has a graph
        self.edges: dict[Key, GradientEdge] = {}
        self.n_targets = 0
        #: the targets the backward pass now running computes (a slice of the target axis)
        self.targets = slice(0, 0)
        #: whether that backward pass is batched (one vmapped call for the targets in flight) or a plain one (one
        #: target)
        self.batched = True
        self._grad_shapes: dict[Key, tuple[int, ...]] = {}
        #: per key whose gradients arrived, which targets' (a backward pass split into target groups writes each
        #: group's in turn)
        self._written: dict[Key, np.ndarray] = {}
        #: captured tensors whose values wait for their gradient (copied together, then let go)
        self._live: dict[Key, torch.Tensor] = {}
        self._kept_elements = 0

    def keep(self, key: Key, t: torch.Tensor) -> None:
        """Take one captured site tensor ``(batch, ...)`` after the forward pass. Without a graph its values go
        into their array now (its gradient is zero); with one, a tensor hook will write its values and gradients
        when the backward pass reaches it, and the tensor is held until then, as the graph holds it anyway."""
        self._kept_elements += t.numel()
        if not t.requires_grad or not self.hold:
            self._put_act(key, self.arrange(key, t.detach()))
        if not t.requires_grad:
            return
        if self.hooks:
            # The hook holds the key, never the tensor, and the arrays only weakly: the graph's nodes hold the
            # hook, and this object holds their edges.
            arrays = weakref.ref(self)
            t.register_hook(lambda g: arrays().put_grad(key, arrays().arrange(key, arrays().plain_rows(g))))
        self.edges[key] = get_gradient_edge(t)
        if self.hold:
            self._live[key] = t.detach()

    def _put_act(self, key: Key, t: torch.Tensor) -> None:
        self._grad_shapes[key] = tuple(t.shape[1:])
        group = self._group_of.get(key)
        if group is not None and group not in self._broken:
            matrix = group[1][0] in (ATTENTION_SITE, SCORES_SITE)
            layers, sites = group
            index = (layers.index(key[0]),) if matrix else (layers.index(key[0]), sites.index(key[1]))
            first = self.filled[0].get((*group, "act")) if self.n_images else None
            inner = tuple(t.shape[1:])
            if first is None and len(inner) == (3 if matrix else 2):
                shape = (len(layers), *inner) if matrix else (len(layers), len(sites), *inner)
                for b in range(self.n_images):
                    self.filled[b][(*group, "act")] = reusable_empty(shape, self.dtype)
                first = self.filled[0][(*group, "act")]
            if first is not None and first.shape[len(index):] == inner:
                self.slots[key] = (group, index)
                for b in range(self.n_images):
                    copy_into(self.filled[b][(*group, "act")][index], t[b])
                return
            self._break(group)
        for b in range(self.n_images):
            self.acts[b][key] = np.empty((1, *t.shape[1:]), self.dtype)
            copy_into(self.acts[b][key], t[b:b + 1])

    def _break(self, group: Group) -> None:
        """Shapes that do not line up (single-head attention on some blocks only, a token count the grid does not
        give): the group's keys are kept one by one, so assembly refuses or lays them out exactly as it always
        has."""
        self._broken.add(group)
        for key, (g, index) in [(k, v) for k, v in self.slots.items() if v[0] == group]:
            del self.slots[key]
            for b in range(self.n_images):
                self.acts[b][key] = self.filled[b][(*g, "act")][index][None].copy()
                if key in self._written:
                    self.grads[b][key] = self.filled[b][(*g, "grad")][(slice(None), *index)][:, None].copy()
        for b in range(self.n_images):
            self.filled[b].pop((*group, "act"), None)
            self.filled[b].pop((*group, "grad"), None)

    def begin_backward(self, n_targets: int) -> None:
        """Get ready for the backward pass's ``n_targets`` gradients per captured tensor."""
        self.n_targets = n_targets
        self.targets = slice(0, n_targets)

    def backward_targets(self, start: int, stop: int) -> None:
        """The next backward pass computes targets ``start:stop`` of the ``n_targets`` only (a pass whose targets
        are split into groups): the gradients it hands over are written there."""
        self.targets = slice(start, stop)

    def plain_rows(self, g: torch.Tensor) -> torch.Tensor:
        """A gradient a tensor hook receives, as ``(targets in flight, ...)``: taken out of the batched backward
        pass's vmap, or given its one row when the backward pass running is a plain one (:attr:`batched` false)."""
        return unbatched(g, self.in_flight) if self.batched else g[None]

    @property
    def in_flight(self) -> int:
        """How many targets the backward pass now running computes."""
        return self.targets.stop - self.targets.start

    def array_bytes(self, n_targets: int) -> int:
        """The bytes the arrays of every tensor kept so far take once filled: values and ``n_targets``
        gradients, in the storage dtype (what :class:`~vitcam_nb.capture.resident.ResidentCap` measures against).

        Example:
            >>> import timm
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
            >>> a = Arrays(TracePlan.for_trace(m, "top1", sites=["F1"]), 1, lambda k, t: t, hooks=False)
            >>> a.keep((0, "F1"), torch.ones(1, 17, 192))
            >>> a.array_bytes(2) == 3 * 17 * 192 * 4
            True
        """
        return self._kept_elements * np.dtype(self.dtype).itemsize * (1 + n_targets)

    def _grad_array(self, b: int, group: Group) -> np.ndarray:
        # Allocated when the backward pass first writes into it: a new buffer of this size maps untouched pages, so
        # each becomes resident only as its gradients arrive, block by block (a buffer an earlier trace left in the
        # pool of capture.buffers is resident already, and faults nothing in).
        arr = self.filled[b].get((*group, "grad"))
        if arr is None:
            act = self.filled[b][(*group, "act")]
            arr = self.filled[b][(*group, "grad")] = reusable_empty((self.n_targets, *act.shape), self.dtype)
        return arr

    def put_grad(self, key: Key, g: torch.Tensor) -> None:
        """Write the values and the gradient ``(targets, batch, ...)`` of ``key`` (already in schema layout)."""
        live = self._live.pop(key, None)
        if live is not None:
            self._put_act(key, self.arrange(key, live))
            del live  # the graph alone decides the tensor's life now
        self._written.setdefault(key, np.zeros(self.n_targets, bool))[self.targets] = True
        if key in self.slots:
            group, index = self.slots[key]
            for b in range(self.n_images):
                copy_into(self._grad_array(b, group)[(self.targets, *index)], g[:, b])
        else:
            for b in range(self.n_images):
                if key not in self.grads[b]:
                    self.grads[b][key] = np.zeros((self.n_targets, 1, *g.shape[2:]), self.dtype)
                copy_into(self.grads[b][key][self.targets], g[:, b:b + 1])
        if self.on_write is not None:
            self.on_write()

    def put_grads(self, items: list[tuple[Key, torch.Tensor]]) -> None:
        """:meth:`put_grad` of each ``(key, gradient)`` autograd returned (in schema layout), a group at a time
        where a whole group waits for its first values (every layer and site held, all of one shape): its values
        and its gradients each go in with one stacked copy per image instead of one per key (a small VLM's two
        dozen keys cost about a millisecond one by one; issue 55's trace-cost row). The same bytes either way:
        stacking copies values, it computes nothing."""
        got = dict(items)
        for group in self.groups:
            keys = [(layer, site) for layer in group[0] for site in group[1]]
            if (group in self._broken or self.filled[0].get((*group, "act")) is not None
                    or not all(k in self._live for k in keys)):
                continue
            acts = [self.arrange(k, self._live[k]) for k in keys]
            inner = tuple(acts[0].shape[1:])
            # a key autograd returned no gradient for (the targets do not depend on it): zeros, as finish_backward
            # writes them
            grads = [got[k] if k in got else acts[0].new_zeros((self.in_flight, self.n_images, *inner)) for k in keys]
            matrix = group[1][0] in (ATTENTION_SITE, SCORES_SITE)
            if (len(inner) != (3 if matrix else 2) or any(tuple(a.shape[1:]) != inner for a in acts)
                    or any(tuple(g.shape) != (self.in_flight, self.n_images, *inner) for g in grads)):
                continue  # one by one, as put_grad lays them out or refuses them
            shape = (len(group[0]), *inner) if matrix else (len(group[0]), len(group[1]), *inner)
            stacked_acts, stacked_grads = torch.stack(acts, 1), torch.stack(grads, 2)
            for b in range(self.n_images):
                self.filled[b][(*group, "act")] = reusable_empty(shape, self.dtype)
                copy_into(self.filled[b][(*group, "act")], stacked_acts[b])
                copy_into(self._grad_array(b, group)[self.targets], stacked_grads[:, b])
            for k in keys:
                li, si = group[0].index(k[0]), group[1].index(k[1])
                self.slots[k] = (group, (li,) if matrix else (li, si))
                self._grad_shapes[k] = inner
                self._written.setdefault(k, np.zeros(self.n_targets, bool))[self.targets] = True
                del self._live[k]
                got.pop(k, None)
            if self.on_write is not None:
                self.on_write()
        for key, g in got.items():
            self.put_grad(key, g)

    def finish_backward(self) -> None:
        """Drop the graph's edges, write the values of every tensor no gradient reached and zeros for its
        gradient (the targets do not depend on it, or it has no graph)."""
        self.edges.clear()
        while self._live:
            key, t = self._live.popitem()
            self._put_act(key, self.arrange(key, t))
        for key, shape in self._grad_shapes.items():
            missing = ~self._written.get(key, np.zeros(self.n_targets, bool))
            if not missing.any():
                continue
            if key in self.slots:
                group, index = self.slots[key]
                for b in range(self.n_images):
                    self._grad_array(b, group)[(missing, *index)] = 0
            else:
                for b in range(self.n_images):
                    if key in self.grads[b]:
                        continue  # allocated as zeros: the targets no group wrote are zero already
                    self.grads[b][key] = np.zeros((self.n_targets, 1, *shape), self.dtype)
