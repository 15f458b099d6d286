"""How much resident memory a pass may add, and handing freed memory back only when it would add more.

A pass on the CPU writes every captured tensor and its gradients into the trace's final arrays as the backward
pass produces them (:mod:`vitcam_nb.capture.prealloc`). The memory autograd frees on the way (the graph, block by
block, and each block's gradient transients) stays in the process's heap, where the next block's transients reuse
it without touching the system. Handing it back after every block (glibc's ``malloc_trim``) kept the peak low but
made each reused page fault in again: about 280,000 page faults per ViT-B/16 trace, a third of its time on a
virtual machine. :class:`ResidentCap` hands memory back only when the resident memory the pass added goes above
:data:`PEAK_OVER_ARRAYS` times the arrays it fills, so a pass whose heap already has room (every trace after the
first in a process) never does, and the first one does a few times near the end of its backward pass.

Example:
    >>> cap = ResidentCap(read=lambda: 100, trim=lambda: None)
    >>> cap.limit(50)  # arrays of 50 bytes: at most 100 + 1.15 * 50 resident
    >>> cap(), cap.trims
    (None, 0)
"""

from __future__ import annotations

import os
from collections.abc import Callable

from vitcam_nb.capture.runtime import release_freed_memory

__all__ = ["PEAK_OVER_ARRAYS", "ResidentCap", "resident_bytes"]

#: The resident memory a pass may add, as a multiple of the arrays it fills, before it hands freed memory back.
#: Measured peaks land about 0.07 above it (one block's backward transients between two checks):
#: ``benchmarks/memsizes.py``.
PEAK_OVER_ARRAYS = 1.15


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (``/proc/self/statm``), or ``None`` where there is no such file
    (macOS, Windows: the cap then never hands memory back, as ``malloc_trim`` does nothing there either).

    Example:
        >>> n = resident_bytes()
        >>> n is None or n > 0
        True
    """
    # The file is opened once per process and read again from its start on every call (a pass reads it after each
    # gradient it writes; opening it each time cost a sizeable part of a 10-ms model's trace). A forked child opens
    # its own: /proc/self names the process that opened it.
    try:
        pid = os.getpid()
        if _STATM.get("pid") != pid:
            _STATM.update(pid=pid, fd=os.open("/proc/self/statm", os.O_RDONLY))
        return int(os.pread(_STATM["fd"], 256, 0).split()[1]) * _PAGE
    except (OSError, IndexError, ValueError, AttributeError):  # AttributeError: no os.pread (Windows)
        return None


_STATM: dict[str, int] = {}


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class ResidentCap:
    """Called after each write of a pass: hands freed memory back to the system when the resident memory added
    since the cap was made is above ``factor`` times the bytes given to :meth:`limit` (the arrays the pass fills).
    Until :meth:`limit` is called it does nothing.

    Args:
        factor: the allowed rise, as a multiple of the arrays' bytes.
        read: reads the resident bytes (default :func:`resident_bytes`; ``None`` from it: never hand back).
        trim: hands freed memory back (default :func:`~vitcam_nb.capture.runtime.release_freed_memory`).

    Example:
        >>> seen = iter([1000, 1000, 1300])  # at creation, then two checks
        >>> cap = ResidentCap(read=lambda: next(seen), trim=lambda: None)
        >>> cap.limit(200)  # 1000 + 1.15 * 200 = 1230
        >>> cap(); cap()
        >>> cap.trims
        1
    """

    def __init__(self, factor: float = PEAK_OVER_ARRAYS, *, read: Callable[[], int | None] | None = None,
                 trim: Callable[[], None] | None = None):
        # Looked up when called, not when defined, so the module's functions stay the one place to change.
        self.factor = factor
        self._read = read or (lambda: resident_bytes())
        self._trim = trim or (lambda: release_freed_memory())
        self.start = self._read()
        self.ceiling: float | None = None
        #: how many times the cap handed memory back
        self.trims = 0

    def limit(self, array_bytes: int) -> None:
        """Set the ceiling: the resident memory at creation plus ``factor`` times ``array_bytes``."""
        if self.start is not None:
            self.ceiling = self.start + self.factor * array_bytes

    def __call__(self) -> None:
        if self.ceiling is None:
            return
        now = self._read()
        if now is not None and now > self.ceiling:
            self._trim()
            self.trims += 1
