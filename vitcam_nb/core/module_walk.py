"""One walk over a model's modules, parameters and buffers, as ``model.modules()``, ``model.parameters()`` and
``model.buffers()`` give them (the same objects, each once, in the same order), without building the dotted name
of every module: a trace walks its model several times (the one-trace-at-a-time check, the device check, frozen
parameters, eval mode, the untrained-weights check), and torch's named walk cost about a tenth of a millisecond
each on a 10-ms VLM (issue 55's trace-cost row).

Example:
    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    >>> modules(m) == list(m.modules()), parameters(m) == list(m.parameters()), buffers(m) == list(m.buffers())
    (True, True, True)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["buffers", "devices", "modules", "parameters", "walk_scope"]

_M = torch.nn.Module

#: inside :func:`walk_scope`: id(model) -> (model, its modules)
_SCOPE: contextvars.ContextVar[dict[int, tuple[torch.nn.Module, list[torch.nn.Module]]] | None] = \
    contextvars.ContextVar("vitcam_nb_walk_scope", default=None)


@contextlib.contextmanager
def walk_scope() -> Iterator[None]:
    """Inside it, :func:`modules` walks each model once and hands the same list again: for the checks of one call
    before its pass and after it (a trace walked a 10-ms VLM's tree six times), between which the module tree is
    the same. Inside the pass an adapter may add modules of its own for the trace (removed after); what walks
    there asks for ``cached=False``. Forgotten on exit.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(1, 1))
        >>> with walk_scope():
        ...     modules(m) is modules(m)
        True
        >>> modules(m) is modules(m)
        False
    """
    token = _SCOPE.set({})
    try:
        yield
    finally:
        _SCOPE.reset(token)


def modules(model: torch.nn.Module, *, cached: bool = True) -> list[torch.nn.Module]:
    """``list(model.modules())``: the model, then its submodules depth first in registration order, each module
    once (a module registered twice is listed where it is met first). Read it, do not change it: inside
    :func:`walk_scope` the same list is handed to every caller (``cached=False``: walked now, for a caller that runs
    after an adapter added modules of its own for the trace, e.g. Qwen2-VL's attention probes).

    Example:
        >>> lin = torch.nn.Linear(1, 1)
        >>> [type(m).__name__ for m in modules(torch.nn.Sequential(lin, lin, torch.nn.ReLU()))]
        ['Sequential', 'Linear', 'ReLU']
    """
    memo = _SCOPE.get() if cached else None
    if memo is None:
        return _walk(model)
    hit = memo.get(id(model))
    if hit is None or hit[0] is not model:
        hit = memo[id(model)] = (model, _walk(model))  # the model held: its id stays its own meanwhile
    return hit[1]


def _walk(model: torch.nn.Module) -> list[torch.nn.Module]:
    kind = type(model)
    if kind.named_modules is not _M.named_modules or kind.modules is not _M.modules:  # its own walk: that walk
        return list(model.modules())
    seen = {id(model)}
    out = [model]
    stack = [iter(model._modules.values())]
    while stack:
        for child in stack[-1]:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                out.append(child)
                if type(child).named_modules is not _M.named_modules:
                    # its own walk below it (the rare class that overrides it)
                    for m in list(child.modules())[1:]:
                        if id(m) not in seen:
                            seen.add(id(m))
                            out.append(m)
                    continue
                stack.append(iter(child._modules.values()))
                break
        else:
            stack.pop()
    return out


def _members(model: torch.nn.Module, attr: str) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for m in modules(model):
        for t in getattr(m, attr).values():
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``list(model.parameters())``: every parameter once, module by module as :func:`modules` lists them.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> parameters(torch.nn.Sequential(lin, lin)) == [lin.weight, lin.bias]
        True
    """
    if type(model).parameters is not _M.parameters or type(model).named_parameters is not _M.named_parameters:
        return list(model.parameters())
    return _members(model, "_parameters")


def buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """``list(model.buffers())``: every buffer once, module by module as :func:`modules` lists them.

    Example:
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> buffers(bn) == list(bn.buffers())
        True
    """
    if type(model).buffers is not _M.buffers or type(model).named_buffers is not _M.named_buffers:
        return list(model.buffers())
    return _members(model, "_buffers")


def devices(model: torch.nn.Module) -> set[torch.device]:
    """The devices of every parameter and buffer, ``{t.device for t in [*model.parameters(), *model.buffers()]}``,
    in one walk.

    Example:
        >>> devices(torch.nn.BatchNorm1d(2))
        {device(type='cpu')}
    """
    kind = type(model)
    if (kind.parameters is not _M.parameters or kind.named_parameters is not _M.named_parameters
            or kind.buffers is not _M.buffers or kind.named_buffers is not _M.named_buffers):
        return {t.device for t in [*model.parameters(), *model.buffers()]}
    return {t.device for m in modules(model) for where in (m._parameters, m._buffers) for t in where.values()
            if t is not None}
