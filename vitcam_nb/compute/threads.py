"""Thread use while maps are computed: numpy's BLAS pools are held to one thread for the duration of a call and
given back as the user had them. A map is a few small matrix products (a 14x14 grid upsampled by 224x14
matrices); a multi-threaded BLAS pool gains nothing on those, and on a busy machine each product waits for
a second core (measured: a 60-map gallery 71 ms alone, 265-305 ms with one other CPU-bound process).

Example:
    >>> from threadpoolctl import threadpool_info
    >>> before = [p["num_threads"] for p in threadpool_info()]
    >>> with small_array_threads():
    ...     inside = {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}
    >>> inside <= {1}, [p["num_threads"] for p in threadpool_info()] == before
    (True, True)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["small_array_threads"]

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"depth": 0, "saved": []}


@functools.lru_cache(maxsize=1)
def _controller() -> Any:
    # Finding the loaded BLAS libraries walks the process's shared objects (about a millisecond): once.
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas").lib_controllers


@contextlib.contextmanager
def small_array_threads() -> Iterator[None]:
    """Hold numpy's BLAS pools to one thread inside the block, then restore the user's settings (also on an
    exception). Nested and concurrent blocks share one limit, given back when the last one exits; pools
    already at one thread are left alone.

    Example:
        >>> with small_array_threads():
        ...     pass
    """
    with _LOCK:
        if _STATE["depth"] == 0:
            saved = [(lib, lib.num_threads) for lib in _controller()]
            _STATE["saved"] = [(lib, n) for lib, n in saved if n != 1]
            for lib, _ in _STATE["saved"]:
                lib.set_num_threads(1)
        _STATE["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["depth"] -= 1
            if _STATE["depth"] == 0:
                for lib, n in _STATE["saved"]:
                    lib.set_num_threads(n)
                _STATE["saved"] = []
