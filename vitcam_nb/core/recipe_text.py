"""A recipe as a short line of text a paper can print and a reader can paste back: every field stated, in one
fixed order, so that one recipe has exactly one spelling and the spelling round-trips.

The canonical form is the site and layer, then ``field=value`` for every other field::

    F1@-1 target=logit class=top1 tokens=patch reshape=raster upsample=bilinear weighting=gradcam
    heads=channels rows=cls fusion=none relu=after normalize=minmax

``text_tokens`` (as ``text=``) is written for site ``xattn`` only, ``k`` for ``gscorecam`` only: elsewhere they
must stay at their defaults. :func:`parse` also reads shorter, hand-written lines: fields may come in any order,
missing fields take their defaults, and a value that belongs to one field only may stand alone
(``F2@3 prob layercam none`` is not allowed: ``none`` fits several fields; ``F2@3 prob layercam`` is). One recipe
is one line (a line break inside is refused, never read as one recipe), and ``-0`` is no layer spelling.

This module reads and writes the text only; :meth:`vitcam_nb.Recipe.parse` builds and validates the recipe
(the recipe module imports this one, never the other way round).

Example:
    >>> fields = parse_fields("F1@11 logit gradcam", {"target": ("logit", "prob"), "weighting": ("gradcam",)})
    >>> fields
    {'site': 'F1', 'layer': 11, 'target': 'logit', 'weighting': 'gradcam'}
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from vitcam_nb.core.errors import RecipeError

__all__ = ["KEYS", "parse_fields", "to_string"]

#: Short key in the text -> recipe field, in the canonical order (site and layer come first as ``site@layer``).
KEYS = {"target": "target", "class": "class_", "tokens": "weight_tokens", "reshape": "reshape",
        "upsample": "upsample", "weighting": "weighting", "heads": "heads", "rows": "attn_rows",
        "fusion": "layer_fusion", "relu": "relu", "normalize": "normalize", "text": "text_tokens", "k": "k"}
_BARE = re.compile(r"[A-Za-z0-9_.,\-]+")


def _value(value: Any) -> str:
    """One value as text: ints and plain words bare, anything else as a JSON string."""
    if isinstance(value, tuple):  # one block keeps a trailing comma, so it reads back as a tuple
        return ",".join(_value(v) for v in value) + ("," if len(value) == 1 else "")
    text = str(value)
    if isinstance(value, int) or (_BARE.fullmatch(text) and not _looks_int(text)):
        return text
    return json.dumps(text)


def _looks_int(text: str) -> bool:
    # ASCII digits only: int() also reads Arabic-Indic and other Unicode digits, which no recipe text means as a layer.
    return re.fullmatch(r"-?[0-9]+", text) is not None


def to_string(recipe: Any) -> str:
    """The canonical one-line spelling of ``recipe`` (a :class:`vitcam_nb.Recipe`; every field stated, fixed order).

    Example:
        >>> import vitcam_nb as vc
        >>> to_string(vc.Recipe(site="F2", layer=3, heads=1)).split()[:2]
        ['F2@3', 'target=logit']
    """
    parts = [f"{recipe.site}@{_value(recipe.layer)}"]
    for key, field in KEYS.items():
        value = getattr(recipe, field)
        if field == "text_tokens" and recipe.site != "xattn":
            continue
        if field == "k" and value is None:
            continue
        parts.append(f"{key}={_value(value)}")
    return " ".join(parts)


def _tokens(text: str) -> list[str]:
    """Split on white space, keeping double-quoted values (JSON strings) whole."""
    out, i = [], 0
    pattern = re.compile(r'\s*((?:[^\s"]*"(?:[^"\\]|\\.)*")|[^\s]+)')
    while i < len(text):
        m = pattern.match(text, i)
        if m is None or not m.group(1):
            break
        out.append(m.group(1))
        i = m.end()
    return out


def _read(text: str, field: str) -> Any:
    if text.startswith('"'):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise RecipeError(f"recipe text: {text!r} is not a well-formed quoted value") from exc
    if field == "layer":
        if text == "all":
            return "all"
        if "," in text:
            return tuple(_read(v, "one_layer") for v in text.split(",") if v)
        return _read(text, "one_layer")
    if field == "k" and text == "None":
        return None
    if field == "one_layer" and re.fullmatch(r"-0+", text):  # -0 is block 0, the first: "the last" is -1
        raise RecipeError(f"recipe text: layer {text!r} is block 0 (the first block); write 0, or -1 for the last")
    return int(text) if _looks_int(text) else text


def _bare_fields(choices: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Each bare word -> the fields it is an allowed value of (a word of one field only may stand alone)."""
    words: dict[str, list[str]] = {}
    for field, values in choices.items():
        for v in values:
            words.setdefault(v, []).append(field)
    return words


def parse_fields(text: str, choices: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """The recipe fields a line of text names (see the module's docstring for the form), with ``choices`` (field ->
    allowed words) deciding which bare words belong to which field; refuses anything else with a
    :class:`~vitcam_nb.core.errors.RecipeError` naming the part it cannot read.

    Example:
        >>> parse_fields("F2@-1 prob rows=mean", {"target": ("logit", "prob")})
        {'site': 'F2', 'layer': -1, 'target': 'prob', 'attn_rows': 'mean'}
    """
    if not isinstance(text, str) or not text.strip():
        raise RecipeError(f"recipe text: expected a line like 'F1@-1 target=logit weighting=gradcam', got {text!r}")
    if any(c in text.strip() for c in "\n\r\v\f\x85\u2028\u2029"):  # one recipe is one line: never two read as one
        raise RecipeError(f"recipe text: one recipe is one line, got a line break in {text.strip()[:80]!r}")
    tokens = _tokens(text.strip())
    head, *rest = tokens
    site, at, layer = head.partition("@")
    if not at or not site or not layer:
        raise RecipeError(f"recipe text: the first word must be SITE@LAYER (e.g. 'F1@-1' or 'F2@all'), got {head!r}")
    fields: dict[str, Any] = {"site": site, "layer": _read(layer, "layer")}
    bare = _bare_fields(choices)
    for token in rest:
        key, eq, value = token.partition("=")
        if eq:
            if key not in KEYS:
                raise RecipeError(f"recipe text: unknown key {key!r}{_did_you_mean(key, KEYS)}; keys are "
                                  f"{list(KEYS)}")
            field = KEYS[key]
            parsed = _read(value, field)
            if isinstance(parsed, str) and field in choices and parsed not in choices[field]:
                near = _did_you_mean(parsed, choices[field])
                if near:  # a typo: say which word was meant; anything else is refused by the recipe's own check
                    raise RecipeError(f"recipe text: {key}={parsed!r} is not allowed{near}; allowed values are "
                                      f"{list(choices[field])}")
        elif re.fullmatch(r"top[1-9]\d*", token):
            field, parsed = "class_", token
        elif len(bare.get(token, [])) == 1:
            field, parsed = bare[token][0], token
        elif token in bare:
            raise RecipeError(f"recipe text: {token!r} could be {bare[token]}; write it as key=value")
        else:
            raise RecipeError(f"recipe text: cannot read {token!r}{_did_you_mean(token, bare, fields=bare)}; write "
                              f"fields as key=value with keys {list(KEYS)}")
        if field in fields:
            raise RecipeError(f"recipe text: {field} is given twice ({token!r})")
        fields[field] = parsed
    return fields


def _did_you_mean(word: str, known: Sequence[str] | Mapping[str, Any],
                  fields: Mapping[str, Sequence[str]] | None = None) -> str:
    """' (did you mean ...?)' naming the known words closest to a misspelt one (difflib, at most three; equally close
    words in the order they are listed, so 'gradkam' names 'gradcam' first), or ''."""
    listed = list(known)
    near = difflib.get_close_matches(word, listed, n=3, cutoff=0.75)
    near.sort(key=lambda w: (-difflib.SequenceMatcher(None, word, w).ratio(), listed.index(w)))
    if not near:
        return ""
    if fields is not None:  # a bare word: write it as key=value, so the reader learns the field it belongs to
        keys = {field: key for key, field in KEYS.items()}
        named = [f"{keys.get(f, f)}={w}" for w in near for f in fields[w]]
    else:
        named = [repr(w) for w in near]
    return f" (did you mean {' or '.join(named)}?)"
