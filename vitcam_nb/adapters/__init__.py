"""Architecture adapters: where each feature site lives in a model family, and how tokens map to a grid.

An adapter is the only per-architecture code in vitcam_nb. :func:`find_adapter` picks the first registered
adapter whose ``matches`` accepts the model; :func:`register_adapter` adds a user's own family without
editing the package.

Example:
    >>> import timm
    >>> from vitcam_nb.adapters import find_adapter
    >>> find_adapter(timm.create_model("vit_tiny_patch16_224", pretrained=False)).family
    'vit'
"""

from __future__ import annotations

from vitcam_nb.adapters.base import Adapter, SiteSpec
from vitcam_nb.adapters.beit import BeitAdapter
from vitcam_nb.adapters.eva import EvaAdapter
from vitcam_nb.adapters.swin import SwinAdapter
from vitcam_nb.adapters.vit import VitAdapter
from vitcam_nb.errors import TraceError
from vitcam_nb.vlm.blip import BlipAdapter  # imports transformers only when a BLIP model is traced
from vitcam_nb.vlm.clip import OpenClipAdapter  # imports open_clip only when one of its models is traced

_ADAPTERS: list[Adapter] = [VitAdapter(), SwinAdapter(), BeitAdapter(), EvaAdapter(), OpenClipAdapter(), BlipAdapter()]


def register_adapter(adapter: Adapter, *, first: bool = True) -> None:
    """Register an adapter for a model family; ``first=True`` lets it take precedence over built-ins.

    Example:
        >>> from vitcam_nb.adapters import register_adapter, VitAdapter
        >>> register_adapter(VitAdapter(), first=False)
    """
    if not isinstance(adapter, Adapter):
        raise TypeError(f"adapter: expected a vitcam_nb.adapters.Adapter, got {type(adapter).__name__}")
    if first:
        _ADAPTERS.insert(0, adapter)
    else:
        _ADAPTERS.append(adapter)


def unregister_adapter(adapter: Adapter | str) -> None:
    """Remove an adapter added with :func:`register_adapter`: the instance itself, or every adapter of a family
    name. Built-in adapters can be removed too (e.g. to test a replacement); a name or instance that is not
    registered raises a ValueError.

    Example:
        >>> from vitcam_nb.adapters import register_adapter, unregister_adapter, VitAdapter, supported_families
        >>> before = supported_families()
        >>> mine = VitAdapter()
        >>> register_adapter(mine)
        >>> try:
        ...     pass  # trace models here
        ... finally:
        ...     unregister_adapter(mine)
        >>> supported_families() == before
        True
    """
    if isinstance(adapter, str):
        keep = [a for a in _ADAPTERS if a.family != adapter]
        if len(keep) == len(_ADAPTERS):
            raise ValueError(f"adapter: no registered adapter of family {adapter!r}; "
                             f"registered: {', '.join(supported_families())}")
        _ADAPTERS[:] = keep
        return
    for i, registered in enumerate(_ADAPTERS):
        if registered is adapter:  # identity: a user's second instance of a built-in class stays distinct
            del _ADAPTERS[i]
            return
    raise ValueError(f"adapter: {type(adapter).__name__} (family {getattr(adapter, 'family', '?')!r}) is not "
                     "registered")


def supported_families() -> list[str]:
    """Names of the model families that have an adapter.

    Example:
        >>> "vit" in supported_families()
        True
    """
    return [a.family for a in _ADAPTERS]


def find_adapter(model: object) -> Adapter:
    """Return the adapter for ``model`` or raise a TypeError naming the supported families.

    Example:
        >>> find_adapter(object())  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        TypeError: model: ...
    """
    for adapter in _ADAPTERS:
        if adapter.matches(model):
            return adapter
    raise TypeError(
        f"model: {type(model).__module__}.{type(model).__name__} is not a supported transformer; "
        f"supported families: {', '.join(supported_families())}. Register your own family with "
        "vitcam_nb.adapters.register_adapter()."
    )


__all__ = ["Adapter", "BeitAdapter", "EvaAdapter", "SiteSpec", "VitAdapter", "find_adapter", "register_adapter",
           "supported_families", "TraceError", "unregister_adapter"]
