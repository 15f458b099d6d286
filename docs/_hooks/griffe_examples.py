"""Griffe extension for the API reference: the package's docstrings title their doctests ``Example:``, which
the Google-style parser reads as an admonition (its ``>>>`` lines would render as prose); they are read as the
``Examples:`` section, which renders them as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_TITLE = re.compile(r"^(\s*)Example:\s*$", flags=re.M)


class ExampleSections(griffe.Extension):
    """Rename each docstring's ``Example:`` section to ``Examples:`` when griffe loads the object."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _TITLE.sub(r"\1Examples:", obj.docstring.value)
