"""The widgets' front end: plain ES modules and one stylesheet in ``static/``, bundled per widget with no
build step and no network.

Example:
    >>> "export default" in esm("explorer.js")
    True
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

__all__ = ["STATIC_DIR", "css", "esm"]

STATIC_DIR = Path(__file__).parent / "static"


@lru_cache(maxsize=8)
def esm(name: str) -> str:
    """The ES module of one widget: the shared core followed by the widget's own file (no build step:
    both are plain JavaScript in ``static/``; anywidget loads a module from a string, so the core is
    prepended rather than imported).

    Example:
        >>> "export default" in esm("explorer.js")
        True
    """
    core = (STATIC_DIR / "core.js").read_text(encoding="utf-8")
    own = (STATIC_DIR / name).read_text(encoding="utf-8")
    return f"{core}\n// ---- {name} ----\n{own}"


@lru_cache(maxsize=1)
def css() -> str:
    """The shared stylesheet of the widgets.

    Example:
        >>> ".vc-widget" in css()
        True
    """
    return (STATIC_DIR / "widgets.css").read_text(encoding="utf-8")
