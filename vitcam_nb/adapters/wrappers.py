"""Wrappers around a supported model, and what to do with a model no adapter reads.

``torch.compile`` (``OptimizedModule._orig_mod``), ``nn.DataParallel`` / ``DistributedDataParallel``
(``.module``) and a one-module ``nn.Sequential`` hold the model a user trained; the trace reads the model inside
(the wrapper and the model are left exactly as they were) and the checklist says which wrappers were looked
through. A model that is neither supported nor a wrapper of one is refused with its class and the three ways
forward.

Example:
    >>> import torch
    >>> inner = torch.nn.Linear(2, 2)
    >>> unwrap(torch.nn.Sequential(inner))[0] is inner
    True
"""

from __future__ import annotations

import torch

__all__ = ["unsupported_message", "unwrap"]


def _inner(model: torch.nn.Module) -> tuple[torch.nn.Module, str] | None:
    """The model one wrapper holds and how it was reached, or None when ``model`` is no wrapper."""
    orig = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(orig, torch.nn.Module):
        return orig, "torch.compile (OptimizedModule._orig_mod)"
    if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        return model.module, f"{type(model).__name__}.module"
    if type(model) is torch.nn.Sequential and len(model) == 1:
        return model[0], "a one-module nn.Sequential ([0])"
    return None


def unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """The model inside any number of wrappers, and the wrappers looked through (outermost first).

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> unwrap(torch.nn.DataParallel(torch.nn.Sequential(lin)))[1]
        ['DataParallel.module', 'a one-module nn.Sequential ([0])']
    """
    chain: list[str] = []
    found = _inner(model)
    while found is not None:
        model, how = found
        chain.append(how)
        found = _inner(model)
    return model, chain


def unsupported_message(model: object, families: list[str]) -> str:
    """The refusal of a model no adapter reads: its class, and the three ways forward.

    Example:
        >>> unsupported_message(object(), ["vit"]).split(";")[0]
        'model: builtins.object is not a supported transformer'
    """
    cls = type(model)
    return (f"model: {cls.__module__}.{cls.__name__} is not a supported transformer; supported families: "
            f"{', '.join(families)}. Three ways forward: (1) write an adapter for it and register it with "
            "vitcam_nb.adapters.register_adapter() (docs/architecture.md, 'Adding a model family'); (2) if it "
            "wraps a supported model, pass the model inside (torch.compile, nn.DataParallel, "
            "DistributedDataParallel and a one-module nn.Sequential are unwrapped already); (3) request the "
            "family in an issue, naming the class and where it comes from.")
