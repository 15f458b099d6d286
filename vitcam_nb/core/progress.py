"""The kit's progress bars: :func:`progress_bar` is ``tqdm.auto.tqdm`` with one difference, on a stream that is not a
terminal (a log file, CI, a pipe) it redraws at most every :data:`LOG_INTERVAL_S` seconds instead of ten times a
second, so a long run writes a few lines into a log, not hundreds. A terminal and a notebook get the usual bar.

Example:
    >>> sum(progress_bar(range(3), disable=True))
    3
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["LOG_INTERVAL_S", "progress_bar", "writes_to_terminal"]

#: Seconds between two redraws of a bar written to a stream that is not a terminal.
LOG_INTERVAL_S = 30.0


def writes_to_terminal(stream: object = None) -> bool:
    """Whether ``stream`` (default: ``sys.stderr``, where tqdm writes) is an interactive terminal.

    Example:
        >>> import io
        >>> writes_to_terminal(io.StringIO())
        False
    """
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


def _notebook(cls: type) -> bool:
    # tqdm.auto picks the widget bar inside a Jupyter kernel: it draws no text, so no interval applies.
    return any(c.__module__.startswith("tqdm.notebook") for c in cls.__mro__)


def progress_bar(iterable: Iterable | None = None, **kwargs: Any) -> Any:
    """A ``tqdm.auto.tqdm`` bar over ``iterable`` with tqdm's own keyword arguments; written to a stream that is not
    a terminal, it redraws every :data:`LOG_INTERVAL_S` seconds at most (unless ``mininterval`` is given).

    Example:
        >>> import io
        >>> bar = progress_bar(total=2, file=io.StringIO())
        >>> bar.mininterval
        30.0
        >>> bar.close()
    """
    from tqdm.auto import tqdm

    if not _notebook(tqdm) and not writes_to_terminal(kwargs.get("file")) and "mininterval" not in kwargs:
        # maxinterval too: tqdm's monitor thread would otherwise force a redraw of a slow bar every 10 s.
        kwargs.update(mininterval=LOG_INTERVAL_S, maxinterval=max(LOG_INTERVAL_S, kwargs.get("maxinterval", 0.0)))
    return tqdm(iterable, **kwargs)
