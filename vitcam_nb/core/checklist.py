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

import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from vitcam_nb.core.card_schema import CARD_FIELDS, CARD_VERSION, NOT_REPORTED, PaperCardError, validate_card
from vitcam_nb.core.errors import ArgumentError, ArgumentTypeError
from vitcam_nb.core.escape import escape_markdown
from vitcam_nb.core.version import __version__

__all__ = ["CATEGORIES", "CONTRADICTIONS", "Checklist"]

#: The five reporting categories every ViT Grad-CAM figure should state, in order.
CATEGORIES = ("feature representation", "gradient target", "token handling", "aggregation",
              "spatial reconstruction")
#: Functions naming what in a checklist contradicts its recipe; ``vitcam_nb.core.checklist_check`` adds its own
#: when the package is imported (it needs the recipe, whose module imports this one: a hook, not an import).
CONTRADICTIONS: list[Callable[[Mapping[str, Any]], list[str]]] = []
#: Recipe fields a card states only where the recipe states them.
_LATER = ("text_tokens", "k")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of two equal keys: a checklist saying two things of one item would say only the second
    keys = [k for k, _ in pairs]
    twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if twice is not None:
        raise ArgumentError(f"key {twice!r} appears twice in one object")
    return dict(pairs)


class Checklist(dict):
    """The checklist: category -> {item: text}. Renders as a markdown table in notebooks.

    Example:
        >>> import vitcam_nb as vc
        >>> print(vc.Recipe().checklist().to_markdown().splitlines()[0])
        | category | item | value |
    """

    #: Items :meth:`from_json` could not check against the recipe: facts only the trace confirms ("category/item";
    #: :mod:`vitcam_nb.core.checklist_facts`). Empty for a checklist not read by ``from_json``.
    unchecked: tuple[str, ...] = ()

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
                # a value that is not text (a number, a nested mapping) is shown as JSON, never as a Python repr
                shown = value if isinstance(value, str) else json.dumps(value, sort_keys=False, default=str)
                cells = (escape_markdown(text, inline=True) for text in (category, item, shown))
                lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def to_json(self, *, card: bool = False, paper: Mapping[str, Any] | None = None) -> str:
        """JSON in the checklist's own order (what a map's ``attrs["checklist"]`` holds); with ``card=True`` a
        paper card instead (:mod:`vitcam_nb.core.card_schema`): every recipe choice read from the checklist's
        recipe, the checklist itself under ``"checklist"``, and ``paper`` (title, year, doi, url, library,
        justification, note) over the defaults ``"not reported"`` and library ``vitcam_nb <version>``.

        Example:
            >>> Checklist({"a": {"b": 1}}).to_json()
            '{"a": {"b": 1}}'
            >>> import vitcam_nb as vc
            >>> card = json.loads(vc.Recipe(site="F4").checklist().to_json(card=True, paper={"year": 2026}))
            >>> card["feature representation"], card["paper"]["year"]
            ({'site': 'F4', 'layer': -1}, 2026)
        """
        if not card:
            if paper is not None:
                raise ArgumentTypeError("paper: only a paper card (card=True) has paper metadata")
            return json.dumps(self, sort_keys=False)
        if paper is not None and not isinstance(paper, Mapping):
            raise ArgumentTypeError(f"paper: expected a dict of paper metadata, got {type(paper).__name__}")
        out: dict[str, Any] = {"card_version": CARD_VERSION, "paper": {
            "title": NOT_REPORTED, "year": NOT_REPORTED, "doi": NOT_REPORTED, "library": f"vitcam_nb {__version__}",
            "justification": NOT_REPORTED, **dict(paper or {})}}
        choices = self._recipe_fields() or {f: self[c][f] for c, fields in CARD_FIELDS.items()
                                            if isinstance(self.get(c), Mapping) for f in fields if f in self[c]}
        if not choices:  # else every field of the card would read "not reported", though nothing said so
            raise ArgumentError("card: this checklist states no recipe (no recipe.json item) and no card fields; make "
                                "it with Recipe.checklist() or vc.cam, or start from card_schema.template()")
        for category, fields in CARD_FIELDS.items():
            # text_tokens and k are stated only where the recipe states them (Recipe.to_dict drops their defaults)
            out[category] = {f: choices.get(f, NOT_REPORTED) for f in fields if f in choices or f not in _LATER}
        out["checklist"] = json.loads(json.dumps(self))
        return json.dumps(validate_card(out), sort_keys=False)

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> Checklist:
        """Rebuild a checklist from :meth:`to_json` output, or from a paper card (its text or dict): the card's
        ``"checklist"`` when it has one (it must agree with the card's fields), else the card's choices by
        category, ``"not reported"`` included. A checklist with a recipe is refused (``ArgumentError`` naming the
        item) when an item its recipe determines says otherwise; the items only its trace could confirm are
        listed in the result's ``unchecked``.

        Example:
            >>> c = Checklist({"aggregation": {"weighting": "gradcam"}})
            >>> Checklist.from_json(c.to_json()) == c
            True
            >>> from vitcam_nb.core.card_schema import template
            >>> Checklist.from_json(template())["feature representation"]
            {'site': 'not reported', 'layer': 'not reported'}
        """
        if isinstance(text, (str, bytes, bytearray)):
            try:
                data = json.loads(text, object_pairs_hook=_no_duplicates)
            except (ValueError, RecursionError) as exc:  # bad JSON, bytes that are no UTF-8, nesting too deep
                raise ArgumentError(f"text: not valid checklist JSON ({type(exc).__name__}: {exc})"[:300]) from exc
        else:
            data = text
        if not isinstance(data, Mapping):
            raise ArgumentTypeError(f"text: expected checklist JSON or a paper card, got {type(data).__name__}")
        if "card_version" not in data:
            bad = [k for k, v in data.items() if not isinstance(v, Mapping)]
            if bad:
                raise ArgumentError(f"text: category {bad[0]!r} must map items to text")
            nested = [f"{k}/{i}" for k, v in data.items() for i, t in v.items() if isinstance(t, (Mapping, list))]
            if nested:
                raise ArgumentError(f"text: item {nested[0]!r} must be text or a number, not a nested structure")
            checklist = cls({k: dict(v) for k, v in data.items()})
            checklist._check_recipe()
            return checklist
        card = validate_card(data)
        if "checklist" not in card:
            return cls({c: dict(card[c]) for c in CARD_FIELDS})
        checklist = cls(card["checklist"])
        checklist._check_recipe()
        if json.loads(checklist.to_json(card=True, paper=card["paper"])) != {**card, "checklist": card["checklist"]}:
            raise PaperCardError("card.checklist: its recipe disagrees with the card's fields; edit both or drop "
                                 "'checklist'")
        return checklist

    def _recipe_fields(self) -> dict[str, Any]:
        """The recipe's fields as its JSON states them (the ``recipe`` item), or {} when the checklist has none."""
        entry = self.get("recipe")
        if not isinstance(entry, Mapping) or "json" not in entry:
            return {}
        text = entry["json"]
        if not isinstance(text, str):  # a number there states no recipe, and would let every item go unchecked
            raise ArgumentError(f"text: item 'recipe/json' must be the recipe's JSON text, got "
                                f"{type(text).__name__} {text!r:.60}")
        try:
            fields = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ArgumentError(f"text: the checklist's recipe.json is not valid recipe JSON ({exc})"[:300]) from exc
        if not isinstance(fields, dict):
            raise ArgumentError(f"text: the checklist's recipe.json is not a JSON object ({type(fields).__name__})")
        return fields

    def _check_recipe(self) -> None:
        """Refuse a checklist whose recipe id is not its recipe JSON's, or whose text names another choice than its
        recipe (the checks in :data:`CONTRADICTIONS`: :func:`vitcam_nb.core.checklist_check.contradictions`)."""
        if not self._recipe_fields():
            return
        # Imported by name on first use (as core.registry fills its tables): the check needs the recipe, whose module
        # imports this one, and importing it here registers it whichever module a caller imported first.
        importlib.import_module("vitcam_nb.core.checklist_check")
        found = [problem for check in CONTRADICTIONS for problem in check(self)]
        if found:
            raise ArgumentError(f"text: the checklist contradicts its own recipe: {found[0]}; it was edited after "
                                "it was made (regenerate it with Recipe.checklist or vc.cam)")
