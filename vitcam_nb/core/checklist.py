"""The reporting checklist as a value: category -> {item: text}, in the five categories of the audit.

:mod:`vitcam_nb.compute.report` fills it for a recipe and a trace; this module only says what it is and how
it prints. Every cell is escaped (:func:`vitcam_nb.core.escape.escape_markdown`): model names, tags,
preprocessing and labels come from models and files and must render as text, never as HTML or markdown.

Example:
    >>> c = Checklist({"aggregation": {"weighting": "gradcam"}})
    >>> print(c.to_markdown().splitlines()[2])
    | aggregation | weighting | gradcam |
"""

from __future__ import annotations

import json

from vitcam_nb.core.escape import escape_markdown

__all__ = ["CATEGORIES", "Checklist"]

#: The five reporting categories every ViT Grad-CAM figure should state, in order.
CATEGORIES = ("feature representation", "gradient target", "token handling", "aggregation",
              "spatial reconstruction")


class Checklist(dict):
    """The checklist: category -> {item: text}. Renders as a markdown table in notebooks.

    Example:
        >>> import vitcam_nb as vc
        >>> print(vc.Recipe().checklist().to_markdown().splitlines()[0])
        | category | item | value |
    """

    def to_markdown(self) -> str:
        """A markdown table with one row per item; each cell renders literally (``|``, ``<l>`` and any HTML or
        markdown syntax in a value are escaped as character references).

        Example:
            >>> Checklist({"a": {"b": "c|d <l>"}}).to_markdown().splitlines()[-1]
            '| a | b | c&#124;d &lt;l&gt; |'
        """
        lines = ["| category | item | value |", "| --- | --- | --- |"]
        for category, items in self.items():
            for item, value in items.items():
                cells = (escape_markdown(text, inline=True) for text in (category, item, value))
                lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def to_json(self) -> str:
        """JSON in the checklist's own order (what a map's ``attrs["checklist"]`` holds).

        Example:
            >>> Checklist({"a": {"b": 1}}).to_json()
            '{"a": {"b": 1}}'
        """
        return json.dumps(self, sort_keys=False)
