"""The static fallback: a PNG of a widget's current view added to its display bundle, so that a notebook
viewed without a widget manager (nbconvert, GitHub, a closed kernel) still shows the figure.

Example:
    >>> import matplotlib.pyplot as plt
    >>> "image/png" in png_bundle({"text/plain": "widget"}, plt.figure)
    True
"""

from __future__ import annotations

import base64
import io
from typing import Any

__all__ = ["STATIC_PNG", "png_bundle"]

#: Add a PNG of the current view to every widget's display bundle. Set False to save space.
STATIC_PNG = True


def png_bundle(data: dict, make_figure: Any) -> dict:
    """Add ``image/png`` of ``make_figure()`` to a display bundle (widgets stay preferred where they work).

    Example:
        >>> import matplotlib.pyplot as plt
        >>> "image/png" in png_bundle({"text/plain": "widget"}, plt.figure)
        True
    """
    if not STATIC_PNG:
        return data
    try:
        import matplotlib.pyplot as plt

        fig = make_figure()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
        plt.close(fig)
    except Exception:  # a static preview must never break the live widget
        return data
    return {**data, "image/png": base64.b64encode(buf.getvalue()).decode("ascii")}
