"""A set of paper cards (:mod:`vitcam_nb.core.card_schema`) as the audit's statistics: the share of papers with no
justification, with a justification, that say only "pytorch-grad-cam", the distinct adaptations by their recipes,
and, given traces, how ambiguous each card's description is (:func:`vitcam_nb.evaluate.ambiguity.analysis.ambiguity`).

Definitions (shares are of all cards, as the audit's are of all included papers):

- *no justification* / *justified*: ``paper.justification`` is ``"none"`` / ``"justified"``.
- *pytorch-grad-cam only*: the library is pytorch-grad-cam (its PyPI name ``grad-cam`` too) and the card reports
  no recipe choice at all.
- *adaptation*: the choices a card reports (every field but the ``"not reported"`` ones; ``"not applicable"``
  is a statement and counts). Two cards are the same adaptation when they report the same fields with the same
  values, so cards that differ only in what they leave out are distinct. Cards that report nothing have none.
- *fully specified*: every choice reported; such cards are also counted by their recipe's id.

Example:
    >>> s = summarise(AUDIT_DIR / "example_cards.json")
    >>> s["cards"], s["no_justification"]["share"], s["distinct_adaptations"]["count"]
    (8, 0.5, 5)
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vitcam_nb.core.card_schema import (
    AUDIT_DIR,
    CARD_FIELDS,
    CARD_VERSION,
    NOT_APPLICABLE,
    NOT_REPORTED,
    PaperCardError,
    card_choices,
    validate_card,
)
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.evaluate.ambiguity.analysis import ambiguity

__all__ = ["audit_figures", "load_cards", "summarise"]

_PAPER = ("title", "year", "doi", "url", "library", "justification", "note")
_TEXT = ("title", "doi", "url", "library", "justification", "note")  # CSV cells kept as written
_OPTIONAL = ("url", "note", "text_tokens", "k")
_FIELD_CATEGORY = {f: c for c, fields in CARD_FIELDS.items() for f in fields}
_PGC = ("pytorch-grad-cam", "grad-cam")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Recipe)}


def audit_figures() -> dict[str, Any]:
    """The audit's published figures with their source (``vitcam_nb/data/audit/audit_figures.json``).

    Example:
        >>> audit_figures()["included"]["count"]
        175
    """
    return json.loads((AUDIT_DIR / "audit_figures.json").read_text(encoding="utf-8"))


def load_cards(cards: Any) -> list[dict[str, Any]]:
    """Paper cards from a ``.json`` file (a list of cards, ``{"cards": [...]}`` or one card), a ``.csv`` file (one
    row per card: the paper's fields and the choice fields as columns), a list of dicts or JSON texts, or one card;
    each is validated (:func:`~vitcam_nb.core.card_schema.validate_card`).

    Example:
        >>> [c["paper"]["justification"] for c in load_cards(AUDIT_DIR / "example_cards.csv")][:3]
        ['none', 'none', 'none']
    """
    if isinstance(cards, (str, Path)) and not str(cards).lstrip().startswith("{"):
        path = Path(cards)
        if not path.is_file():
            raise PaperCardError(f"cards: {path} is not a file")
        if path.suffix.lower() not in (".csv", ".json"):
            raise PaperCardError(f"cards: expected a .json or .csv file, got {path.name}")
        try:  # utf-8-sig: a byte-order mark, as spreadsheets write, is read as none
            text = path.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as exc:
            raise PaperCardError(f"cards: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as "
                                 "UTF-8") from exc
        if path.suffix.lower() == ".csv":
            return _from_csv(text, str(path))
        try:
            cards = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise PaperCardError(f"cards: {path} is not valid JSON ({type(exc).__name__}: {exc})"[:300]) from exc
    if isinstance(cards, Mapping) and "cards" in cards:
        cards = cards["cards"]
    if isinstance(cards, (Mapping, str)):
        cards = [cards]
    if not isinstance(cards, Sequence):
        raise PaperCardError(f"cards: expected a path, a list of cards or one card, got {type(cards).__name__}")
    out = []
    for i, card in enumerate(cards):
        try:
            out.append(validate_card(card))
        except PaperCardError as exc:
            raise PaperCardError(f"cards[{i}]: {exc}") from exc
    return out


def _from_csv(text: str, name: str) -> list[dict[str, Any]]:
    try:
        return _csv_cards(text, name)
    except csv.Error as exc:  # a field over csv's limit (128 KB), a NUL byte, an unclosed quote at the end
        raise PaperCardError(f"cards: {name} is not a CSV of cards ({exc}); a card's cells are short text"[:300]) \
            from exc


def _csv_cards(text: str, name: str) -> list[dict[str, Any]]:
    reader = csv.DictReader(io.StringIO(text))
    columns = list(reader.fieldnames or [])
    if not columns:
        raise PaperCardError(f"cards: {name} is empty; a CSV of cards has a header row and one row per card")
    unknown = [c for c in columns if c not in _PAPER and c not in _FIELD_CATEGORY]
    if unknown:
        raise PaperCardError(f"cards: {name} column {unknown[0]!r} is unknown; columns are the paper's {list(_PAPER)} "
                             f"and the choices {list(_FIELD_CATEGORY)}")
    out = []
    for row_number, row in enumerate(reader, start=2):  # row 1 is the header
        card: dict[str, Any] = {"card_version": CARD_VERSION, "paper": {}}
        card.update({c: {} for c in CARD_FIELDS})
        for column, cell in row.items():
            if column is None or cell is None:
                raise PaperCardError(f"cards: {name} row {row_number} does not have one cell per column")
            if cell == "":
                if column in _OPTIONAL:
                    continue
                raise PaperCardError(f"cards: {name} row {row_number}, column {column!r} is empty; write "
                                     f"{NOT_REPORTED!r} when the paper does not say")
            value = cell if column in _TEXT else _cell(cell)
            if column in _PAPER:
                card["paper"][column] = value
            else:
                card[_FIELD_CATEGORY[column]][column] = value
        try:
            out.append(validate_card(card))
        except PaperCardError as exc:
            raise PaperCardError(f"cards: {name} row {row_number}: {exc}") from exc
    if not out:
        raise PaperCardError(f"cards: {name} has a header but no card (no row after it)")
    return out


def _cell(cell: str) -> Any:
    """A CSV cell as JSON when it parses (numbers, lists such as ``[0, 1]``), else the text."""
    try:
        return json.loads(cell)
    except json.JSONDecodeError:
        return cell


def _reported(card: Mapping[str, Any]) -> dict[str, Any]:
    return {f: v for f, v in card_choices(card).items() if v != NOT_REPORTED}


def _share(count: int, n: int) -> dict[str, Any]:
    return {"count": count, "share": count / n if n else None}


def summarise(cards: Any, traces: Any = None, **ambiguity_options: Any) -> dict[str, Any]:
    """The audit's statistics over a set of paper cards (see the module for the definitions); with ``traces`` (one
    trace, a list or a store, as :func:`vitcam_nb.ambiguity` takes them) also each card's ambiguity: the number
    of recipes consistent with what it reports and their median pairwise Spearman correlation (over images, the
    median of the per-image medians). ``ambiguity_options`` go to :func:`vitcam_nb.ambiguity` (``max_recipes``,
    ``n_samples``, ...). The median is None where there are fewer than two non-constant maps. A card that no
    recipe on the trace fits gets its ``error`` instead.

    Example:
        >>> s = summarise(AUDIT_DIR / "example_cards.csv")
        >>> s["pytorch_grad_cam_only"], s["fully_specified"]["distinct_recipes"]
        ({'count': 2, 'share': 0.25}, 2)
    """
    cards = load_cards(cards)
    n = len(cards)
    justification = [c["paper"]["justification"] for c in cards]
    reported = [_reported(c) for c in cards]
    pgc_only = sum(1 for c, r in zip(cards, reported, strict=True)
                   if not r and c["paper"]["library"].strip().lower().split(" ")[0] in _PGC)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(reported):
        if r:
            groups.setdefault(json.dumps(r, sort_keys=True), []).append(i)
    full, recipe_ids, errors = [], [], {}
    for i, card in enumerate(cards):
        if NOT_REPORTED in card_choices(card).values():
            continue
        full.append(i)
        try:
            recipe_ids.append(Recipe.from_dict(_recipe_fields(reported[i])).id)
        except RecipeError as exc:
            errors[i] = str(exc)
    out: dict[str, Any] = {
        "cards": n,
        "justification": {k: _share(justification.count(k), n) for k in ("none", "partial", "justified",
                                                                          NOT_REPORTED)},
        "no_justification": _share(justification.count("none"), n),
        "justified": _share(justification.count("justified"), n),
        "pytorch_grad_cam_only": _share(pgc_only, n),
        "distinct_adaptations": {"count": len(groups), "adaptations": [
            {"reported": json.loads(key), "cards": idx} for key, idx in groups.items()]},
        "fully_specified": {"count": len(full), "cards": full, "distinct_recipes": len(set(recipe_ids)),
                            "recipe_ids": sorted(set(recipe_ids)), "errors": errors},
    }
    if traces is not None:
        done: dict[str, dict[str, Any]] = {}  # cards that report the same choices share one analysis
        for r in reported:
            key = json.dumps(r, sort_keys=True)
            if key not in done:
                done[key] = _ambiguity(traces, r, ambiguity_options)
        out["ambiguity"] = [{**done[json.dumps(r, sort_keys=True)], "card": i} for i, r in enumerate(reported)]
    return out


def _recipe_fields(reported: Mapping[str, Any]) -> dict[str, Any]:
    """Reported choices as recipe fields: lists become tuples; a moot choice takes the recipe's default (what
    the kit writes for it), and a moot ``text_tokens`` or ``k`` is left out."""
    out = {}
    for field, value in reported.items():
        if value == NOT_APPLICABLE:
            if field not in ("text_tokens", "k"):
                out[field] = _DEFAULTS[field]
        else:
            out[field] = tuple(value) if isinstance(value, list) else value
    return out


def _ambiguity(traces: Any, reported: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    try:
        amb = ambiguity(traces, _recipe_fields(reported), **options)
    except RecipeError as exc:  # a description no recipe on these traces fits (bad options still raise)
        return {"reported": dict(reported), "error": str(exc)}
    if hasattr(amb, "summary"):
        summary = amb.summary()
        quartiles = summary["median_spearman_quartiles"]
        return {"reported": dict(reported), "images": summary["images"], "recipes": summary["recipes"],
                "median_spearman": None if quartiles is None else quartiles[1]}
    rho = amb.spread.median_spearman
    return {"reported": dict(reported), "images": 1, "recipes": len(amb.recipes),
            "median_spearman": float(rho) if math.isfinite(rho) else None}
