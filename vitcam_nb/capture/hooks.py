"""The hook context: everything a trace changes on a model while it reads the sites, each change a small
context manager that restores what it found, also on error or interrupt.

:class:`Capture` composes them: the adapter's per-trace setup (:meth:`~vitcam_nb.adapters.Adapter.tracing`),
``fused_attn`` switched off so the softmax attention exists as a tensor, eval mode, and one forward hook per
(layer, site) that keeps the tensor it sees, keyed by (layer, site) and never by firing order.

Example:
    >>> import timm, torch
    >>> from vitcam_nb.adapters import TraceContext, find_adapter
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False).train()
    >>> with Capture(m, find_adapter(m), layers=[11], sites=["F1"], ctx=TraceContext(m)) as cap:
    ...     _ = m(torch.zeros(1, 3, 224, 224))
    >>> sorted(cap.tensors), cap.grid, m.training, len(m.blocks[11].norm1._forward_hooks)
    ([(11, 'F1')], (14, 14), True, 0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch

from vitcam_nb.adapters.base import Adapter, TraceContext
from vitcam_nb.adapters.qkv import PROJECTED_IO, SCORES_IO, SPLIT_IO, projected_hooks, split_qkv
from vitcam_nb.capture.crop_check import CROP_PIXELS
from vitcam_nb.capture.scores import score_hooks
from vitcam_nb.core import module_walk
from vitcam_nb.core.errors import TraceError

__all__ = ["Capture", "eval_mode", "fused_attention_off", "removable_hooks"]


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every module in eval mode (dropout off); each module's own train/eval flag restored afterwards.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Dropout()).train()
        >>> with eval_mode(m):
        ...     m[0].training
        False
        >>> m[0].training
        True
    """
    # Only the modules in train mode are switched (and switched back): an eval model is left alone, as a
    # Hugging Face model's own eval() walks every module again (half a millisecond a pass on a 10-ms model).
    # Walked now, not the call's remembered walk: the adapter's tracing context, entered just before, may have added
    # modules of its own (Qwen2-VL's attention probes), and they run in eval mode too.
    training = [m for m in module_walk.modules(model, cached=False) if m.training]
    try:
        if training:
            model.eval()
        yield
    finally:
        for m in training:
            m.training = True


@contextlib.contextmanager
def fused_attention_off(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """``fused_attn = False`` on every module that has the flag (timm attention), restored afterwards.

    Example:
        >>> a = torch.nn.Module(); a.fused_attn = True
        >>> with fused_attention_off([a]):
        ...     a.fused_attn
        False
        >>> a.fused_attn
        True
    """
    saved = [(m, m.fused_attn) for m in modules if hasattr(m, "fused_attn")]
    try:
        for m, _ in saved:
            m.fused_attn = False
        yield
    finally:
        for m, flag in saved:
            m.fused_attn = flag


@contextlib.contextmanager
def removable_hooks() -> Iterator[list]:
    """A list to append hook handles to; every handle is removed on exit.

    Example:
        >>> lin = torch.nn.Linear(1, 1)
        >>> with removable_hooks() as handles:
        ...     handles.append(lin.register_forward_hook(lambda *a: None))
        >>> len(lin._forward_hooks)
        0
    """
    handles: list = []
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()


class Capture:
    """Read sites during a forward pass: ``with Capture(...) as cap: model(x)`` leaves the site tensors in
    ``cap.tensors[(layer, site)]`` (sites outside the block stack, e.g. ``xattn``, keyed by their own layer
    index) and the patch grid in ``cap.grid``. The model is returned exactly as it was on exit.

    Args:
        model: the model to read.
        adapter: its adapter (where each site lives).
        layers: block indices for block sites.
        sites: site names; extra sites of the adapter are read at every one of their layers.
        ctx: the trace's context, handed to the adapter's per-trace setup.

    Example:
        >>> import timm, torch
        >>> from vitcam_nb.adapters import TraceContext, find_adapter
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        >>> with Capture(m, find_adapter(m), [0], ["F2"], TraceContext(m)) as cap:
        ...     _ = m(torch.zeros(1, 3, 224, 224))
        >>> tuple(cap.tensors[(0, "F2")].shape)
        (1, 3, 197, 197)
    """

    def __init__(self, model: torch.nn.Module, adapter: Adapter, layers: Sequence[int], sites: Sequence[str],
                 ctx: TraceContext):
        self.model, self.adapter, self.layers, self.sites, self.ctx = model, adapter, list(layers), list(sites), ctx
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}
        self.grid: tuple[int, int] | None = None
        self._stack = contextlib.ExitStack()
        self._quiet = 0

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Hooks that fire inside this context keep nothing: a block run again for the backward pass
        (:mod:`vitcam_nb.capture.recompute`) has had its sites read in the forward pass already. What the hooks do
        to the block's outputs (a split qkv put back together) they still do, so the rerun computes what the first
        run did."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def _keep(self, key: tuple[int, str], tensor: object) -> None:
        if self._quiet:
            return
        # Hugging Face layers return tuples whose first element is the hidden state.
        if isinstance(tensor, (tuple, list)) and tensor and isinstance(tensor[0], torch.Tensor):
            tensor = tensor[0]
        if not isinstance(tensor, torch.Tensor):
            raise TraceError(f"sites: {key[1]} at layer {key[0]} produced {type(tensor).__name__}, not a tensor")
        if key in self.tensors:
            raise TraceError(f"sites: {key[1]} at layer {key[0]} fired twice in one forward pass; the adapter's "
                             "site table does not fit this model, or gradient checkpointing reruns the block "
                             "(switch it off for the trace: model.set_grad_checkpointing(False))")
        self.tensors[key] = tensor

    def _hook(self, handles: list, module: torch.nn.Module, io: str, key: tuple[int, str]) -> None:
        if io == "output":
            handles.append(module.register_forward_hook(lambda _m, _i, out: self._keep(key, out)))
        elif io.startswith("output["):  # one element of a tuple output, e.g. the weights a HF attention returns
            index = int(io[len("output["):-1])
            handles.append(module.register_forward_hook(lambda _m, _i, out: self._keep(key, out[index])))
        elif io.startswith(SPLIT_IO):  # one third of a fused qkv output: kept, and the output rebuilt from it
            handles.append(module.register_forward_hook(lambda _m, _i, out: self._third(key, io[len(SPLIT_IO):],
                                                                                         out)))
        elif io.startswith(PROJECTED_IO):  # q or k through the output projection, computed on the side (q_out/k_out)
            handles.extend(projected_hooks(module, io[len(PROJECTED_IO):], lambda t: self._keep(key, t)))
        elif io == SCORES_IO:  # no module holds the pre-softmax scores: recomputed from q and k in the pass
            handles.extend(score_hooks(module, lambda t: self._keep(key, t)))
        else:
            handles.append(module.register_forward_pre_hook(lambda _m, args: self._keep(key, args[0] if args
                                                                                         else None)))

    def _third(self, key: tuple[int, str], site: str, out: torch.Tensor) -> torch.Tensor:
        # The model continues from the three parts put back together, so the kept part is on the path to the
        # output and its gradient exists; the values are the same.
        parts = [split_qkv(s, out) for s in ("q", "k", "v")]
        self._keep(key, parts[("q", "k", "v").index(site)])
        return torch.cat(parts, dim=-1)

    def _grid_hook(self, _module: torch.nn.Module, inputs: object, output: torch.Tensor) -> None:
        self.grid = self.adapter.grid_from_output(self.model, output)
        if self.adapter.runs_crops(self.model) and isinstance(inputs, tuple) and inputs:
            # the crops exactly as the tower ran on them (a family may skip some of what the input held)
            self.ctx.facts[CROP_PIXELS] = inputs[0].detach()

    def __enter__(self) -> Capture:
        stack = self._stack
        try:
            # The adapter's setup comes first: it may add the very modules the site hooks go on.
            stack.enter_context(self.adapter.tracing(self.ctx))
            handles = stack.enter_context(removable_hooks())
            blocks = self.adapter.blocks(self.model)
            table = self.adapter.site_table(self.model)
            extra = self.adapter.extra_sites(self.model)
            for site in self.sites:
                if site in extra:
                    for i, (module, io) in enumerate(extra[site]):
                        self._hook(handles, module, io, (i, site))
                    continue
                spec = table[site]
                for layer in self.layers:
                    module = blocks[layer].get_submodule(spec.module) if spec.module else blocks[layer]
                    self._hook(handles, module, spec.io, (layer, site))
            handles.append(self.adapter.grid_module(self.model).register_forward_hook(self._grid_hook))
            stack.enter_context(fused_attention_off(self.adapter.attention_modules(self.model)))
            stack.enter_context(eval_mode(self.model))
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
