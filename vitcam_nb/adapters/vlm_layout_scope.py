"""A generative VLM's image-token layout computed once per trace call: the answer target's check, the memory
estimate and each LM-side site's assembly all ask for the layout of the same sequence (five times a call on a tiny
LLaVA, issue 55's trace-cost row). Inside :func:`~vitcam_nb.adapters.registry.lookup_scope` the answer is kept for
the call, keyed on the adapter, the model and the *content* of the sequence and of the extra forward arguments
(dtype, shape, device and bytes of every array or tensor), so a different sequence or argument is a different key;
an argument whose content cannot be read as such (any other object) is never kept. Outside a scope it is computed
every time, as before.

Example:
    >>> import numpy as np, torch
    >>> content_key({"image_sizes": torch.tensor([[32, 32]])}) == content_key({"image_sizes": torch.tensor([[32, 32]])})
    True
    >>> content_key({"x": object()}) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from vitcam_nb.adapters.registry import scoped

__all__ = ["content_key", "scoped_layout"]

R = TypeVar("R")
_PLAIN = (bool, int, float, str, bytes, type(None))


def _key(value: object) -> object:
    """A hashable key that equals another's only when the values are equal in content (None: not keyable)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        return ("tensor", str(value.dtype), tuple(value.shape), str(value.device), t.reshape(-1).view(torch.uint8)
                .numpy().tobytes())
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return None
        return ("array", value.dtype.str, value.shape, np.ascontiguousarray(value).tobytes())
    if isinstance(value, _PLAIN) or isinstance(value, np.generic) and not isinstance(value, np.object_):
        return (type(value).__name__, value)
    if isinstance(value, (list, tuple)):
        parts = tuple(_key(v) for v in value)
        return None if any(p is None for p in parts) else (type(value).__name__, parts)
    if isinstance(value, Mapping):
        items = [(k, _key(v)) for k, v in value.items()]
        if any(not isinstance(k, str) or p is None for k, p in items):
            return None
        return ("mapping", tuple(sorted(items)))
    return None


def content_key(extra: Mapping[str, Any] | None) -> object:
    """The key of a target's extra forward arguments (None when one of them is not an array, tensor, number,
    string or a list/tuple/mapping of those).

    Example:
        >>> content_key(None) == content_key({})
        True
    """
    return _key(dict(extra or {}))


def scoped_layout(owner: object, model: object, ids: np.ndarray, extra: Mapping[str, Any] | None,
                  compute: Callable[[], R]) -> R:
    """``compute()`` (the layout of ``ids`` with ``extra``), once per trace call for equal contents.

    Example:
        >>> from vitcam_nb.adapters.registry import lookup_scope
        >>> calls = []
        >>> with lookup_scope():
        ...     _ = [scoped_layout(1, 2, np.arange(3), None, lambda: calls.append(0)) for _ in range(3)]
        >>> len(calls)
        1
    """
    ids_key, extra_key = _key(np.asarray(ids)), content_key(extra)
    if ids_key is None or extra_key is None:
        return compute()
    return scoped(owner, model, ("image_token_layout", ids_key, extra_key), compute)
