"""The key :func:`vitcam_nb.core.provenance.weights_sha256` checks its cached hash against, read without building a
state dict: torch's ``state_dict`` walk (an ordered dict, its metadata and a call per module) took about a tenth of a
millisecond on a 10-ms VLM, on every trace (issue 55's trace-cost row). The walk here lists exactly the entries
``model.state_dict(keep_vars=True)`` lists, in its order and under its names (every non-None parameter, every
non-None persistent buffer, module by module, a module registered twice under each of its names), and falls back to
``state_dict`` itself for a model any of whose modules changes what it lists (a state-dict hook, an extra state, its
own ``state_dict`` or ``_save_to_state_dict``).

Example:
    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    >>> state_entries(m) == list(m.state_dict(keep_vars=True).items())
    True
"""

from __future__ import annotations

import torch

__all__ = ["state_entries"]

_M = torch.nn.Module


_PLAIN_KINDS: dict[type, bool] = {}


def _plain(module: torch.nn.Module) -> bool:
    kind = type(module)
    plain = _PLAIN_KINDS.get(kind)
    if plain is None:  # per class: whether it lists its state as torch's Module does
        plain = _PLAIN_KINDS[kind] = (kind.state_dict is _M.state_dict and kind.get_extra_state is _M.get_extra_state
                                      and kind._save_to_state_dict is _M._save_to_state_dict)
    return plain and not module._state_dict_hooks and not module._state_dict_pre_hooks


def state_entries(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``list(model.state_dict(keep_vars=True).items())``: (name, tensor) of every entry, in the state dict's order.

    Example:
        >>> lin = torch.nn.Linear(1, 1)
        >>> [name for name, _ in state_entries(torch.nn.Sequential(lin, lin))]
        ['0.weight', '0.bias', '1.weight', '1.bias']
    """
    out: list[tuple[str, torch.Tensor]] = []
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        prefix, module = stack.pop()
        if not _plain(module):
            return list(model.state_dict(keep_vars=True).items())
        for name, p in module._parameters.items():
            if p is not None:
                out.append((prefix + name, p))
        skip = module._non_persistent_buffers_set
        for name, b in module._buffers.items():
            if b is not None and name not in skip:
                out.append((prefix + name, b))
        if module._modules:  # depth first, in registration order, as state_dict recurses
            stack.extend(reversed([(prefix + name + ".", child) for name, child in module._modules.items()
                                   if child is not None]))
    return out
