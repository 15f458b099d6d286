"""The values of a recipe space (``{field: [values]}``: ``vc.map_many``'s ``recipes_or_space``, ``vc.ambiguity``'s
``space``, the figure's ``axes``) checked one by one before any combination is built: a space expands to every
valid combination and skips the others, so a typo (``"f4"``, ``"layercm"``) would otherwise vanish silently.

Example:
    >>> check_space({"site": ["F1", "F4"], "layer": [0, -1]}, "space")
    >>> check_space({"site": ["F1", "f4"]}, "space")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    vitcam_nb.core.errors.RecipeError: space: site 'f4' is not a value of the field; did you mean 'F4'? ...
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from vitcam_nb.core.errors import ArgumentTypeError, RecipeError
from vitcam_nb.core.recipe import (
    ATTN_ROWS,
    HEAD_RULES,
    LAYER_FUSIONS,
    NORMALIZES,
    RELUS,
    RESHAPES,
    SITES,
    TARGETS,
    UPSAMPLES,
    WEIGHT_TOKENS,
    Recipe,
    is_int,
    weighting_names,
)

__all__ = ["check_space", "did_you_mean"]


def _choices() -> dict[str, tuple]:
    return {"site": SITES, "target": TARGETS, "weight_tokens": WEIGHT_TOKENS, "reshape": RESHAPES,
            "upsample": UPSAMPLES, "weighting": tuple(weighting_names()), "attn_rows": ATTN_ROWS,
            "layer_fusion": LAYER_FUSIONS, "relu": RELUS, "normalize": NORMALIZES, "heads": HEAD_RULES}


def did_you_mean(value: Any, allowed: Any) -> str:
    """`` did you mean 'X'?`` for the allowed value closest to ``value`` (case first), or "".

    Example:
        >>> did_you_mean("f4", ["F1", "F4"]), did_you_mean("layercm", ["gradcam", "layercam"]), did_you_mean(3, ["a"])
        (" did you mean 'F4'?", " did you mean 'layercam'?", '')
    """
    if not isinstance(value, str):
        return ""
    names = [str(a) for a in allowed]
    same = [a for a in names if a.lower() == value.lower()]
    close = same or difflib.get_close_matches(value, names, n=1, cutoff=0.6)
    return f" did you mean {close[0]!r}?" if close else ""


def _alone(field: str, value: Any) -> None:
    """A recipe with ``field=value`` and what the field needs to apply (a fused layer tuple, site F3 for a head
    index, ...): the field's own checks, none of the combination's."""
    if field == "layer":
        several = isinstance(value, (list, tuple)) or value == "all"
        Recipe(layer=value, layer_fusion="mean" if several else "none")
    elif field == "heads":
        Recipe(site="F3", heads=value)
    elif field == "text_tokens":
        Recipe(site="xattn", text_tokens=value)
    elif field == "k":
        Recipe(weighting="gscorecam", k=value) if value is not None else Recipe()
    else:
        Recipe(**{field: value})


_NONE = object()


def _same(a: Any, b: Any) -> bool:
    # The same value of the same kind (1 and True, or 1 and 1.0, are different layer values); an array never matches.
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError):
        return False


def check_space(space: Any, name: str) -> None:
    """Refuse (:class:`~vitcam_nb.core.errors.RecipeError` naming ``name``, the field and the value, with the
    closest valid value) a space whose field is no recipe field, whose value no recipe can take, whatever the
    other fields, or that lists a value twice; lists of values only (a bare value is one value).

    Example:
        >>> check_space({"weighting": ["gradcam", "layercm"]}, "recipes_or_space")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        vitcam_nb.core.errors.RecipeError: recipes_or_space: weighting 'layercm' is not a value of the field; did ...
    """
    if not isinstance(space, Mapping):
        raise ArgumentTypeError(f"{name}: expected a space {{field: [values]}}, got {type(space).__name__}")
    fields = [f.name for f in dataclasses.fields(Recipe)]
    choices = _choices()
    for field, values in space.items():
        if field not in fields:
            raise RecipeError(f"{name}: {field!r} is not a recipe field;{did_you_mean(field, fields)} fields are "
                              f"{fields}")
        listed = list(values) if isinstance(values, (list, tuple)) else [values]
        twice = next((v for i, v in enumerate(listed) if any(_same(v, w) for w in listed[:i])), _NONE)
        if twice is not _NONE:  # a repeated value would count one recipe twice (a share, a cell weighted double)
            raise RecipeError(f"{name}: {field} lists {twice!r} more than once; give each value once")
        for value in listed:
            if field in choices and not (field == "heads" and is_int(value)):
                try:
                    known = value in choices[field]
                except TypeError:  # an unhashable value is no choice
                    known = False
                if not known:
                    raise RecipeError(f"{name}: {field} {value!r} is not a value of the field;"
                                      f"{did_you_mean(value, choices[field])} values are {list(choices[field])}")
                continue
            try:
                _alone(field, value)
            except (RecipeError, TypeError) as exc:
                raise RecipeError(f"{name}: {field} {value!r} is no value of the field ({exc})") from exc
