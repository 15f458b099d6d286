"""Griffe extension for the API reference: the package's docstrings cross-reference with Sphinx roles
(``:func:`~vitcam_nb.x.f```), which the Markdown renderer shows as raw text. Each role becomes an optional
mkdocs-autorefs cross-reference: a link where the API reference renders the object, code text elsewhere (an
unresolved optional reference renders as its title, with no warning, so ``mkdocs build --strict`` is unaffected).

``~`` shows the last name only, as in Sphinx; a name without dots is read relative to the docstring's class, then
its module.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from typing import Any

import griffe

#: A Sphinx cross-reference role: ``:func:`name```, ``:class:`~a.b.C```, ``:meth:`C.f()``` ...
ROLE = re.compile(r":(?:py:)?(?:func|mod|class|meth|data|attr|exc|obj|const):`(~?)([^`<>]+?)(?:\(\))?`")


def rewrite(text: str, module: str = "", owners: dict[str, str] | None = None,
            canonical: Callable[[str], str] = str) -> str:
    """``text`` with each role as ``<autoref identifier=... optional><code>title</code></autoref>``.

    Example:
        >>> rewrite("see :func:`~vitcam_nb.api.cam`")
        'see <autoref identifier="vitcam_nb.api.cam" optional><code>cam</code></autoref>'
    """

    def one(match: re.Match) -> str:
        short, name = match.group(1) == "~", match.group(2).strip()
        title = name.rsplit(".", 1)[-1] if short else name
        first = name.split(".", 1)[0]
        if (owners or {}).get(first):  # a member of the docstring's class: C.f
            identifier = f"{owners[first]}.{name}"
        elif "." in name or not module:
            identifier = name
        else:
            identifier = f"{module}.{name}"
        identifier = canonical(identifier)
        return (f'<autoref identifier="{html.escape(identifier, quote=True)}" optional>'
                f"<code>{html.escape(title)}</code></autoref>")

    return ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring's Sphinx roles when griffe loads the object."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        module = obj.path if obj.is_module else obj.module.path
        cls = obj if obj.is_class else (obj.parent if obj.parent is not None and obj.parent.is_class else None)
        owners = {name: cls.path for name in cls.members} if cls is not None else {}
        obj.docstring.value = rewrite(obj.docstring.value, module, owners, lambda path: _canonical(obj, path))


def _canonical(obj: Any, path: str) -> str:
    """The path of the object ``path`` names where it is defined (a name imported into a module, ``vitcam_nb.core.
    rules.TraceError``, is ``vitcam_nb.core.errors.TraceError``), so that the reference names one object; ``path``
    itself where griffe has not loaded it yet."""
    root, _, rest = path.partition(".")
    if root != obj.package.name or not rest:
        return path
    try:
        found = obj.package[rest]
    except Exception:  # not loaded yet, or an alias griffe cannot follow: the path as written
        return path
    return str(getattr(found, "target_path", None) or found.path) if found.is_alias else found.path
