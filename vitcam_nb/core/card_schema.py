"""The paper card: what a paper reports about its Grad-CAM, one field per recipe choice in the five categories of
the audit, as a versioned JSON Schema (``vitcam_nb/data/audit/paper_card.schema.json``, draft 2020-12) and a
small validator for the part of JSON Schema that file uses (so the kit needs no ``jsonschema`` at run time).

Every choice field holds a value the kit allows, ``"not reported"`` or, where a choice can be moot (heads at a site
without heads, for instance), ``"not applicable"``.

Example:
    >>> card = template()
    >>> card["aggregation"]["weighting"]
    'not reported'
    >>> validate_card(card) == card
    True
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitcam_nb.core.errors import VitcamError

__all__ = ["AUDIT_DIR", "CARD_FIELDS", "CARD_VERSION", "NOT_APPLICABLE", "NOT_REPORTED", "PaperCardError",
           "card_choices", "load_schema", "template", "validate_card"]

#: The folder of the audit's data files: the schema, the template, the audit's figures and the example cards.
AUDIT_DIR = Path(__file__).resolve().parents[1] / "data" / "audit"
#: The schema version a card states in ``card_version`` (and the schema in ``version``).
CARD_VERSION = "1.0.0"
NOT_REPORTED = "not reported"
NOT_APPLICABLE = "not applicable"
#: The recipe fields of each checklist category, as a card holds them (``text_tokens`` and ``k`` are optional).
CARD_FIELDS = {
    "feature representation": ("site", "layer"),
    "gradient target": ("target", "class_"),
    "token handling": ("weight_tokens", "attn_rows", "text_tokens"),
    "aggregation": ("weighting", "heads", "layer_fusion", "relu", "k"),
    "spatial reconstruction": ("reshape", "upsample", "normalize"),
}


class PaperCardError(VitcamError, ValueError):
    """A paper card that does not follow the schema; the message names the field and what is allowed.

    Example:
        >>> str(PaperCardError("card.paper.year: expected an int"))
        'card.paper.year: expected an int'
    """


@functools.cache
def _schema_text() -> str:
    return (AUDIT_DIR / "paper_card.schema.json").read_text(encoding="utf-8")


def load_schema() -> dict[str, Any]:
    """The paper-card JSON Schema (a fresh copy).

    Example:
        >>> load_schema()["version"] == CARD_VERSION
        True
    """
    return json.loads(_schema_text())


def template() -> dict[str, Any]:
    """A blank card: every field ``"not reported"``, ready to fill in (``paper_card_template.json``).

    Example:
        >>> template()["paper"]["justification"]
        'not reported'
    """
    return json.loads((AUDIT_DIR / "paper_card_template.json").read_text(encoding="utf-8"))


def card_choices(card: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe fields of a (valid) card, category by category flattened: field -> value as written.

    Example:
        >>> card_choices(template())["site"]
        'not reported'
    """
    return {f: card[c][f] for c, fields in CARD_FIELDS.items() for f in fields if f in card.get(c, {})}


def validate_card(card: Any) -> dict[str, Any]:
    """Check a card (a dict or its JSON text) against the schema; return it as a dict, else raise
    :class:`PaperCardError` naming the first field that breaks it and what the field allows.

    Example:
        >>> bad = template()
        >>> bad["aggregation"]["weighting"] = "gradcamx"
        >>> validate_card(bad)
        Traceback (most recent call last):
        ...
        vitcam_nb.core.card_schema.PaperCardError: card.aggregation.weighting: 'gradcamx' is not allowed; ...
    """
    if isinstance(card, (str, bytes)):
        try:
            card = json.loads(card)
        except (ValueError, RecursionError) as exc:  # bad JSON, bytes that are no UTF-8, nesting too deep
            raise PaperCardError(f"card: not valid JSON ({type(exc).__name__}: {exc})"[:300]) from exc
    if not isinstance(card, Mapping):
        raise PaperCardError(f"card: expected a JSON object (dict) or its text, got {type(card).__name__}")
    schema = load_schema()
    try:
        problem = _check(card, schema, schema, "card")
    except RecursionError as exc:  # a structure nested deeper than the checker's recursion: no card is that deep
        raise PaperCardError("card: nested too deeply to be a paper card") from exc
    if problem:
        raise PaperCardError(problem)
    return copy.deepcopy(dict(card))


_TYPES = {"object": Mapping, "array": list, "string": str, "boolean": bool}


def _is_type(value: Any, name: str) -> bool:
    if name in ("integer", "number"):
        numeric = isinstance(value, int) or (name == "number" and isinstance(value, float))
        return numeric and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    while "$ref" in schema:  # local references only ("#/$defs/name"), which is all the card schema uses
        node: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _check(value: Any, schema: Mapping[str, Any], root: Mapping[str, Any], path: str) -> str | None:
    """The first violation of ``schema`` by ``value`` at ``path`` as a message, or None."""
    schema = _resolve(schema, root)
    if "anyOf" in schema:
        if all(_check(value, branch, root, path) for branch in schema["anyOf"]):
            return f"{path}: {value!r} is not allowed; expected {_describe(schema, root)}"
        return None
    if "const" in schema and not _same(value, schema["const"]):
        return f"{path}: expected {schema['const']!r}, got {value!r}"
    if "enum" in schema and not any(_same(value, v) for v in schema["enum"]):
        return f"{path}: {value!r} is not allowed; expected one of {schema['enum']}"
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        if not any(_is_type(value, n) for n in names):
            return f"{path}: expected {' or '.join(names)}, got {type(value).__name__} {value!r}"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return f"{path}: expected a non-empty string"
        if "pattern" in schema and not re.search(schema["pattern"], value):
            return f"{path}: {value!r} does not match {schema['pattern']!r}"
    if _is_type(value, "number") and "minimum" in schema and value < schema["minimum"]:
        return f"{path}: expected at least {schema['minimum']}, got {value!r}"
    if isinstance(value, list):
        return _check_array(value, schema, root, path)
    if isinstance(value, Mapping):
        return _check_object(value, schema, root, path)
    return None


def _check_array(value: list, schema: Mapping[str, Any], root: Mapping[str, Any], path: str) -> str | None:
    if len(value) < schema.get("minItems", 0):
        return f"{path}: expected at least {schema['minItems']} item(s), got {value!r}"
    if schema.get("uniqueItems") and len({json.dumps(v, sort_keys=True) for v in value}) != len(value):
        return f"{path}: items must be distinct, got {value!r}"
    for i, item in enumerate(value):
        if "items" in schema and (problem := _check(item, schema["items"], root, f"{path}[{i}]")):
            return problem
    return None


def _check_object(value: Mapping, schema: Mapping[str, Any], root: Mapping[str, Any], path: str) -> str | None:
    for key in schema.get("required", ()):
        if key not in value:
            return f"{path}.{key}: missing (write {NOT_REPORTED!r} when the paper does not say)"
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if not isinstance(key, str):
            return f"{path}: keys must be strings, got {key!r}"
        if key in props:
            problem = _check(item, props[key], root, f"{path}.{key}")
        elif extra is False:
            problem = f"{path}.{key}: unknown field; fields are {list(props)}"
        elif isinstance(extra, Mapping):
            problem = _check(item, extra, root, f"{path}.{key}")
        else:
            problem = None
        if problem:
            return problem
    return None


def _same(a: Any, b: Any) -> bool:
    # JSON equality: true is not 1 (Python's == says it is).
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _describe(schema: Mapping[str, Any], root: Mapping[str, Any]) -> str:
    """What a field allows, in words, from its schema (for error messages)."""
    schema = _resolve(schema, root)
    if "anyOf" in schema:
        return " or ".join(_describe(branch, root) for branch in schema["anyOf"])
    if "const" in schema:
        return repr(schema["const"])
    if "enum" in schema:
        return f"one of {schema['enum']}"
    kind = schema.get("type")
    if kind == "array":
        return f"a list of ({_describe(schema.get('items', {}), root)})"
    if kind == "integer":
        return f"an int >= {schema['minimum']}" if "minimum" in schema else "an int"
    if "pattern" in schema:
        return f"a string matching {schema['pattern']!r}"
    return f"a {kind}" if kind else "a value"
