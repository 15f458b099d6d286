"""Checks of the arguments many public functions share (a path, an ``overwrite`` flag), so that each is refused the
same way, by name, before any work: a kit error, never pathlib's or Python's own.

Example:
    >>> as_path("path", "maps.zarr").name
    'maps.zarr'
    >>> as_flag("overwrite", False)
    False
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError, TraceFileError

__all__ = ["as_flag", "as_path", "as_store_path"]


def as_path(name: str, value: object) -> Path:
    """``value`` as a :class:`~pathlib.Path`; anything but a ``str`` or ``os.PathLike`` is refused naming ``name``.

    Example:
        >>> as_path("out", "report")
        PosixPath('report')
    """
    if isinstance(value, str) and not value:
        raise ArgumentError(f"{name}: expected a file or folder path, got an empty string")
    if isinstance(value, (str, os.PathLike)):
        try:
            return Path(value)
        except TypeError:  # an os.PathLike whose __fspath__ gives bytes
            pass
    raise ArgumentTypeError(f"{name}: expected a file or folder path (a str or os.PathLike), got "
                            f"{type(value).__name__}")


def as_flag(name: str, value: object) -> bool:
    """``value`` as a bool; only ``True`` and ``False`` are taken, so that ``overwrite="no"`` never means yes.

    Example:
        >>> as_flag("overwrite", np.True_)
        True
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ArgumentTypeError(f"{name}: expected True or False, got {value!r:.80}")


def as_store_path(value: object, what: str) -> Path:
    """``value`` as the path of a zarr store (``what`` names it in a refusal): a path ending in ``.zarr`` whose
    folder exists.

    Example:
        >>> as_store_path("/tmp/maps.zarr", "a map_many store").name
        'maps.zarr'
    """
    path = as_path("path", value)
    if path.suffix != ".zarr":  # exactly: x.ZARR is another folder than x.zarr on most file systems
        raise TraceFileError(f"path: {what} is a zarr folder and its path ends in .zarr (lower case), got {path}")
    if not path.parent.exists():
        raise TraceFileError(f"path: folder {path.parent} does not exist")
    return path
