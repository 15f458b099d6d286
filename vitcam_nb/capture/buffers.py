"""Large trace arrays whose memory the next trace reuses once they are gone.

A trace's Dataset arrays are hundreds of megabytes (ViT-B/16 top5: a 352 MB gradient array). The system's
allocator maps every array that large afresh and unmaps it when it is freed, so each trace in a loop (``vc.trace``
over images, each batch of ``vc.trace_many``) has the kernel fault in and zero all of it again: on the machine of
the committed benchmarks about half a second of system time per ViT-B/16 trace, while autograd's own tensors,
smaller, come back from the heap. :func:`reusable_empty` keeps the memory of an array that is no longer referenced
(no array, view or Dataset holds it) in a pool, marked ``MADV_FREE`` so the system may take its pages back
whenever it needs them, and hands it to the next array of about the same size. Two live arrays never share memory.
The pool holds at most :data:`KEEP_FREE_FRACTION` of the machine's memory; until the system takes them, its pages
count in the process's resident memory, and :func:`release_free_buffers` unmaps them at once. Where anonymous
private mappings are not available (Windows), it is ``np.empty``.

Example:
    >>> a = reusable_empty((4, 8 << 20), np.float32)  # 128 MiB
    >>> address = a.ctypes.data
    >>> del a
    >>> reusable_empty((4, 8 << 20), np.float32).ctypes.data == address
    True
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref

import numpy as np

__all__ = ["KEEP_FREE_FRACTION", "MIN_BYTES", "free_bytes", "release_free_buffers", "reusable_empty"]

#: Arrays at least this large come from the pool (smaller ones come back from the heap already).
MIN_BYTES = 32 << 20
#: The unreferenced buffers kept take at most this share of the machine's memory; the oldest beyond it are unmapped.
KEEP_FREE_FRACTION = 0.125

_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_USABLE = bool(getattr(mmap, "MAP_PRIVATE", 0) and getattr(mmap, "MAP_ANONYMOUS", 0))
_LOCK = threading.Lock()
_FREE: list[mmap.mmap] = []  # unreferenced buffers, oldest first


def reusable_empty(shape: tuple[int, ...], dtype: object) -> np.ndarray:
    """An uninitialised C-contiguous array like ``np.empty(shape, dtype)``. At :data:`MIN_BYTES` and above its
    memory is a pool buffer: the smallest unreferenced one that holds it and is at most twice its size, or a new
    anonymous mapping; it returns to the pool when nothing refers to the array any more.

    Example:
        >>> reusable_empty((2, 3), np.float16).shape  # small: np.empty
        (2, 3)
        >>> big = reusable_empty((9 << 20,), np.float32)
        >>> other = reusable_empty((9 << 20,), np.float32)
        >>> np.shares_memory(big, other)  # both alive: never the same memory
        False
    """
    dtype = np.dtype(dtype)
    count = math.prod(int(v) for v in shape)  # exact Python ints, without numpy's reduction per array
    nbytes = count * dtype.itemsize
    if not _USABLE or nbytes < MIN_BYTES:
        return np.empty(shape, dtype)
    with _LOCK:
        fits = [b for b in _FREE if nbytes <= len(b) <= 2 * nbytes]
        buf = min(fits, key=len) if fits else None
        if buf is not None:
            _FREE.remove(buf)
    if buf is None:
        buf = mmap.mmap(-1, nbytes, flags=_FLAGS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # as numpy asks for its own large arrays: fewer faults on first use
            try:
                buf.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
    array = np.frombuffer(buf, dtype, count).reshape(shape)
    # The reshaped array refers to the flat one, and every view to one of them: when the flat one goes, nothing
    # reads this memory any more.
    weakref.finalize(array.base, _release, buf)
    return array


def free_bytes() -> int:
    """Bytes of the unreferenced buffers the pool keeps for the next large arrays.

    Example:
        >>> release_free_buffers()
        >>> free_bytes()
        0
    """
    with _LOCK:
        return sum(len(b) for b in _FREE)


def release_free_buffers() -> None:
    """Unmap every unreferenced buffer of the pool now (the arrays still in use keep theirs), so resident memory
    drops at once instead of when the system takes the pages back.

    Example:
        >>> a = reusable_empty((9 << 20,), np.float32)
        >>> del a
        >>> free_bytes() > 0
        True
        >>> release_free_buffers()
        >>> free_bytes()
        0
    """
    with _LOCK:
        old = list(_FREE)
        _FREE.clear()
    for b in old:
        _close(b)


def _close(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # an array on it is still being torn down: unmapped when that one lets go
        pass


def _physical_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _release(buf: mmap.mmap) -> None:
    if hasattr(mmap, "MADV_FREE"):  # the system may take the pages back; until it does, reuse costs no fault
        try:
            buf.madvise(mmap.MADV_FREE)
        except OSError:
            pass
    physical = _physical_bytes()
    keep = KEEP_FREE_FRACTION * physical if physical else 0
    with _LOCK:
        _FREE.append(buf)
        old = []
        while _FREE and sum(len(b) for b in _FREE) > keep:
            old.append(_FREE.pop(0))
    for b in old:
        _close(b)
