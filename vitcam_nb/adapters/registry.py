"""The table of adapters: which one reads a model, and how families are added.

Built-in families are listed here by import path with the optional package each needs (``open_clip`` for the
open_clip adapter, ``transformers`` for BLIP and the Hugging Face families), and are imported the first time the
table is used, each only when its package is installed. Third-party packages add families through the
``vitcam_nb.adapters`` entry point group (``name = "package.module:AdapterClass"``), looked up before the built-ins
(a plugin for a subclass of a built-in family must win over it); a user adds one at run time with
:func:`register_adapter`, by default in front of all. The first adapter whose ``matches`` accepts the model reads
it.

Example:
    >>> import timm
    >>> find_adapter(timm.create_model("vit_tiny_patch16_224", pretrained=False)).family
    'vit'
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
import warnings
from importlib.metadata import entry_points

from vitcam_nb.adapters.base import Adapter
from vitcam_nb.adapters.wrappers import unsupported_message
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError

__all__ = ["BUILTIN_ADAPTERS", "ENTRY_POINT_GROUP", "find_adapter", "register_adapter", "supported_families",
           "unregister_adapter"]

ENTRY_POINT_GROUP = "vitcam_nb.adapters"
#: (family, "module:Class", package it needs or None), in lookup order.
BUILTIN_ADAPTERS: tuple[tuple[str, str, str | None], ...] = (
    ("vit", "vitcam_nb.adapters.vit:VitAdapter", None),
    ("swin", "vitcam_nb.adapters.swin:SwinAdapter", None),
    ("beit", "vitcam_nb.adapters.beit:BeitAdapter", None),
    ("eva", "vitcam_nb.adapters.eva:EvaAdapter", None),
    ("open_clip", "vitcam_nb.adapters.open_clip:OpenClipAdapter", "open_clip"),
    ("blip", "vitcam_nb.adapters.blip:BlipAdapter", "transformers"),
    ("hf_vit", "vitcam_nb.adapters.hf:HfVitAdapter", "transformers"),
    ("hf_deit_distilled", "vitcam_nb.adapters.hf:HfDeitAdapter", "transformers"),
    ("hf_dinov2", "vitcam_nb.adapters.hf:HfDinov2Adapter", "transformers"),
    ("hf_dinov2_registers", "vitcam_nb.adapters.hf:HfDinov2RegistersAdapter", "transformers"),
    ("hf_beit", "vitcam_nb.adapters.hf:HfBeitAdapter", "transformers"),
    ("hf_clip", "vitcam_nb.adapters.hf_clip:HfClipAdapter", "transformers"),
    ("hf_siglip", "vitcam_nb.adapters.hf_clip:HfSiglipAdapter", "transformers"),
    ("hf_swin", "vitcam_nb.adapters.hf_swin:HfSwinAdapter", "transformers"),
    ("hf_swinv2", "vitcam_nb.adapters.hf_swin:HfSwinv2Adapter", "transformers"),
    ("hf_upernet_swin", "vitcam_nb.adapters.hf_upernet:HfUperNetSwinAdapter", "transformers"),
    ("hf_dpt", "vitcam_nb.adapters.hf_dpt:HfDptAdapter", "transformers"),
    ("hf_videomae", "vitcam_nb.adapters.hf_video:HfVideoMaeAdapter", "transformers"),
    ("hf_vivit", "vitcam_nb.adapters.hf_video:HfVivitAdapter", "transformers"),
    ("hf_timesformer", "vitcam_nb.adapters.hf_video:HfTimesformerAdapter", "transformers"),
    ("hf_yolos", "vitcam_nb.adapters.hf_yolos:HfYolosAdapter", "transformers"),
    ("hf_owlvit", "vitcam_nb.adapters.hf_owl:HfOwlVitAdapter", "transformers"),
    ("hf_owlv2", "vitcam_nb.adapters.hf_owl:HfOwlv2Adapter", "transformers"),
    ("hf_vlm", "vitcam_nb.adapters.hf_vlm:HfVlmAdapter", "transformers"),
)

_ADAPTERS: list[Adapter] = []
_LOADED = False
_LOCK = threading.Lock()


def _load(target: str) -> type:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _table() -> list[Adapter]:
    """The adapters in lookup order, the built-in and entry-point ones loaded on first use."""
    global _LOADED
    with _LOCK:
        if not _LOADED:
            builtins = [_load(target)() for _, target, needs in BUILTIN_ADAPTERS
                        if needs is None or importlib.util.find_spec(needs) is not None]
            plugins = []
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                try:
                    plugins.append(ep.load()())
                except Exception as exc:  # a broken plugin must not take the built-in families down
                    warnings.warn(f"adapter entry point {ep.name!r} ({ep.value}) failed to load: {exc}",
                                  RuntimeWarning, stacklevel=3)
            _ADAPTERS[:] = plugins + builtins
            _LOADED = True
    return _ADAPTERS


def register_adapter(adapter: Adapter, *, first: bool = True) -> None:
    """Register an adapter for a model family; ``first=True`` lets it take precedence over built-ins.

    Example:
        >>> from vitcam_nb.adapters import register_adapter, unregister_adapter, VitAdapter
        >>> extra = VitAdapter()
        >>> register_adapter(extra, first=False)
        >>> unregister_adapter(extra)
    """
    if not isinstance(adapter, Adapter):
        raise ArgumentTypeError(f"adapter: expected a vitcam_nb.adapters.Adapter, got {type(adapter).__name__}")
    table = _table()
    if first:
        table.insert(0, adapter)
    else:
        table.append(adapter)


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
    table = _table()
    if isinstance(adapter, str):
        keep = [a for a in table if a.family != adapter]
        if len(keep) == len(table):
            raise ArgumentError(f"adapter: no registered adapter of family {adapter!r}; "
                                f"registered: {', '.join(supported_families())}")
        table[:] = keep
        return
    for i, registered in enumerate(table):
        if registered is adapter:  # identity: a user's second instance of a built-in class stays distinct
            del table[i]
            return
    raise ArgumentError(f"adapter: {type(adapter).__name__} (family {getattr(adapter, 'family', '?')!r}) is not "
                        "registered")


def supported_families() -> list[str]:
    """Names of the model families that have an adapter (built-ins whose package is installed included).

    Example:
        >>> "vit" in supported_families()
        True
    """
    return [a.family for a in _table()]


def find_adapter(model: object) -> Adapter:
    """Return the adapter for ``model`` or raise a TypeError naming its class, the supported families and the
    three ways forward (an adapter, a wrapper to unwrap, a family to request).

    Example:
        >>> find_adapter(object())  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        vitcam_nb.core.errors.ArgumentTypeError: model: ...
    """
    for adapter in _table():
        if adapter.matches(model):
            return adapter
    raise ArgumentTypeError(unsupported_message(model, supported_families()))
