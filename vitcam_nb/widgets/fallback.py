"""The static fallback: a PNG of a widget's current view added to its display bundle, and a ``text/plain`` that
says what the widget shows, so that a notebook viewed without a widget manager (nbconvert, a code-hosting page,
VS Code's viewer, a closed kernel) still shows the figure and names it.

The bundle is made when the widget is displayed: the picture is the view at that moment. Jupyter stores that
bundle in the notebook; a later change in the page updates the live view, not the stored picture (display the
widget again, or call ``.static()``, to store a newer one). nbconvert shows the picture where the notebook holds no
widget state (JupyterLab's default, ``scripts/notebooks.py``); a notebook saved with widget state (``jupyter
nbconvert --execute`` stores it unless ``--ExecutePreprocessor.store_widget_state=False``) is drawn by a widget
manager that nbconvert's page loads from a CDN, and offline shows nothing there.

Example:
    >>> import matplotlib.pyplot as plt
    >>> sorted(static_bundle({"text/plain": "<object at 0x7f>"}, plt.figure, "a widget"))
    ['image/png', 'text/plain']
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["STATIC_PNG", "figure_png", "static_bundle", "summary"]

#: Add a PNG of the current view to every widget's display bundle. Set False to save space.
STATIC_PNG = True
#: The resolution of the stored picture (dots per inch of the matplotlib figure).
DPI = 80
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_NOTE = ("A live widget: where widgets cannot run (nbconvert, a code-hosting page, a viewer without a kernel) this "
         "output shows its picture, the view when it was displayed.")


def figure_png(fig: Any) -> bytes:
    """The PNG bytes of a matplotlib figure as the fallback stores it (the figure is closed).

    Example:
        >>> import matplotlib.pyplot as plt
        >>> figure_png(plt.figure())[:4]
        b'\\x89PNG'
    """
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    finally:
        plt.close(fig)
    return buf.getvalue()


def static_bundle(bundle: Any, make_figure: Callable[[], Any], summary: str) -> Any:
    """A widget's display bundle with ``text/plain`` set to ``summary`` (what it shows) and ``image/png`` of
    ``make_figure()`` (its current view); the live view stays, and stays preferred where widgets run.

    ``bundle`` is what ``_repr_mimebundle_`` of ipywidgets (a dict) or anywidget (a ``(data, metadata)`` pair)
    returned; the same shape comes back. A picture that cannot be drawn never breaks the live widget: the text
    then says why there is none.

    Example:
        >>> import matplotlib.pyplot as plt
        >>> data, _ = static_bundle(({"text/plain": "<obj>"}, {}), plt.figure, "an empty figure")
        >>> data["text/plain"].startswith("an empty figure"), "image/png" in data
        (True, True)
    """
    if bundle is None:
        return None
    data, metadata = bundle if isinstance(bundle, tuple) else (bundle, None)
    data = {**data, "text/plain": f"{summary}\n{_NOTE}"}
    if STATIC_PNG:
        try:
            data["image/png"] = base64.b64encode(figure_png(make_figure())).decode("ascii")
        except Exception as exc:  # a static picture must never break the live widget; the text says why
            data["text/plain"] = f"{summary}\nNo static picture: {type(exc).__name__}: {exc}"
    return data if metadata is None else (data, metadata)


def summary(widget: str, recipes: Mapping[str, Any], trace: Any, where: Sequence[str] = ()) -> str:
    """One line naming what a widget shows: its recipes by id and in words, the trace, the model (``text/plain``
    of its display).

    Example:
        >>> from vitcam_nb.core.recipe import Recipe
        >>> text = summary("Explorer", {"recipe": Recipe()}, None)
        >>> text.startswith(f"vitcam_nb Explorer: recipe {Recipe().id} (F1@-1 target=logit")
        True
    """
    attrs = getattr(trace, "attrs", {})
    shown = "; ".join(f"{name} {r.id} ({r.to_string()})" for name, r in recipes.items())
    origin = f"trace {attrs.get('trace_id', '?')} of model {attrs.get('model_name', '?')}"
    return f"vitcam_nb {widget}: {shown}; " + ", ".join([origin, *where])
