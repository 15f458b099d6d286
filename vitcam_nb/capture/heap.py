"""Large blocks from the heap on a dask worker, while a model the kit sent is loaded there.

glibc serves a block above its mmap threshold (128 KiB at start) with a fresh mapping and unmaps it when it is
freed, so every page of it faults in again at its next use. A process that sets none of glibc's malloc settings
raises that threshold by itself, up to 32 MiB, as it frees large blocks; setting any of them (an environment
variable such as ``MALLOC_TRIM_THRESHOLD_``, or a ``glibc.malloc`` tunable) keeps it fixed. dask's nanny starts
every worker with ``MALLOC_TRIM_THRESHOLD_`` set (``distributed.nanny.pre-spawn-environ``), so there each of a pass's
tensors above 128 KiB is mapped anew. Measured (``map_many``, ViT-B/16, 500 recipes, 13 images on a 2-worker
``LocalCluster``): 2.7 million page faults per worker and 24.3 s; with the threshold raised, 0.6 million and 15.7 s.

:func:`raise_mmap_threshold` sets the threshold to glibc's own ceiling when a model is loaded on a worker whose
environment fixed it, and :func:`restore_mmap_threshold` sets back the fixed value once the last such model is
unloaded. The trim threshold the environment chose is left as it is; a process whose environment sets nothing
is never touched.

Example:
    >>> fixed_threshold({"MALLOC_TRIM_THRESHOLD_": "65536"}), fixed_threshold({})
    (131072, None)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from vitcam_nb.capture.runtime import glibc_function

__all__ = ["CEILING", "fixed_threshold", "raise_mmap_threshold", "restore_mmap_threshold"]

#: The highest threshold glibc reaches by itself on a 64-bit system (its ``DEFAULT_MMAP_THRESHOLD_MAX``).
CEILING = 32 * 1024 * 1024
#: glibc's threshold when a setting keeps it fixed without giving it (its ``DEFAULT_MMAP_THRESHOLD_MIN``).
_START = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_TUNABLES = ("glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold", "glibc.malloc.top_pad",
             "glibc.malloc.mmap_max")


def fixed_threshold(environ: Mapping[str, str] | None = None) -> int | None:
    """The mmap threshold glibc keeps fixed in a process started with ``environ`` (default this one's): the one it
    gives (``MALLOC_MMAP_THRESHOLD_`` or the ``glibc.malloc.mmap_threshold`` tunable), else 128 KiB, when any malloc
    setting is given; None when none is (glibc then raises the threshold by itself).

    Example:
        >>> fixed_threshold({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=262144"})
        262144
    """
    environ = os.environ if environ is None else environ
    tunables = dict(t.partition("=")[::2] for t in environ.get("GLIBC_TUNABLES", "").split(":") if "=" in t)
    if not any(environ.get(v) for v in _VARIABLES) and not any(t in tunables for t in _TUNABLES):
        return None
    given = environ.get("MALLOC_MMAP_THRESHOLD_") or tunables.get("glibc.malloc.mmap_threshold")
    try:
        return int(given) if given else _START
    except ValueError:  # glibc ignores a value it cannot read
        return _START


_MALLOPT = glibc_function("mallopt")  # None where the C library is not glibc: nothing to set
_LOCK = threading.Lock()
_HOLDERS = [0]  # models loaded that asked for the raised threshold


def raise_mmap_threshold() -> None:
    """Raise the mmap threshold to :data:`CEILING` if this process's environment fixed it (a dask worker); counted,
    so that :func:`restore_mmap_threshold` sets it back only when the last model that raised it is unloaded.

    Example:
        >>> raise_mmap_threshold(); restore_mmap_threshold()
    """
    with _LOCK:
        _HOLDERS[0] += 1
        if _HOLDERS[0] == 1 and _MALLOPT is not None and fixed_threshold() is not None:
            _MALLOPT(_M_MMAP_THRESHOLD, CEILING)


def restore_mmap_threshold() -> None:
    """Undo one :func:`raise_mmap_threshold`; the last one sets the threshold back to the environment's.

    Example:
        >>> raise_mmap_threshold(); restore_mmap_threshold()
    """
    with _LOCK:
        if _HOLDERS[0] == 0:
            return
        _HOLDERS[0] -= 1
        fixed = fixed_threshold()
        if _HOLDERS[0] == 0 and _MALLOPT is not None and fixed is not None:
            _MALLOPT(_M_MMAP_THRESHOLD, fixed)
