"""Whether a checklist still says what its recipe is: its ``recipe.id`` the id of its ``recipe.json``, its items
that name a recipe choice (site, weighting, heads, layer fusion) naming the recipe's, and every other item the
recipe determines (on the trace facts the checklist states) the recipe's own words
(:mod:`vitcam_nb.core.checklist_facts` regenerates them and says which items only the trace could confirm).

A checklist's text is made from its recipe (``Recipe.checklist``, ``vc.cam``); a text edited afterwards (heads
"max over heads" under a ``relu_then_mean`` recipe) would report a computation that did not happen.

Example:
    >>> import vitcam_nb as vc
    >>> c = vc.Recipe(site="F3", heads="relu_then_mean").checklist()
    >>> contradictions(c)
    []
    >>> c["aggregation"]["heads"] = "max over heads"
    >>> contradictions(c)[0][:40]
    "aggregation/heads: 'max over heads' name"
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from vitcam_nb.core.checklist import CONTRADICTIONS
from vitcam_nb.core.checklist_facts import module_problem, regenerated
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.recipe import HEAD_RULES, LAYER_FUSIONS, SITES, Recipe, weighting_names

__all__ = ["CHOICE_ITEMS", "contradictions"]

#: The checklist items that open with the recipe's value of a field ("relu_then_mean: ReLU of each ...").
CHOICE_ITEMS = {("feature representation", "site"): "site", ("aggregation", "weighting"): "weighting",
                ("aggregation", "heads"): "heads", ("aggregation", "layer fusion"): "layer_fusion"}


def _values(field: str) -> tuple[str, ...]:
    return {"site": SITES, "weighting": tuple(weighting_names()), "heads": HEAD_RULES,
            "layer_fusion": LAYER_FUSIONS}[field]


def contradictions(checklist: Mapping[str, Any]) -> list[str]:
    """What in ``checklist`` contradicts its recipe (empty: nothing). An item that opens with another value of its
    field than the recipe's contradicts it; one that opens with the recipe's value followed by ``:`` must be the
    text the recipe gives (a kind of trace that words an item otherwise, as a published method, names no value
    first and is left as it is). A recipe JSON that is no recipe, or an id not its, is named too.

    Example:
        >>> contradictions({"recipe": {"id": "000000000000", "json": '{"site": "F1"}'}})[0][:36]
        'recipe/id: 000000000000 is not the i'
    """
    entry = checklist.get("recipe")
    if not isinstance(entry, Mapping) or not isinstance(entry.get("json"), str):
        return []
    try:
        recipe = Recipe.from_dict(json.loads(entry["json"]))
    except (RecipeError, ValueError, TypeError) as exc:
        return [f"recipe/json: not a recipe ({exc})"]
    found = []
    if "id" in entry and str(entry["id"]) != recipe.id:
        found.append(f"recipe/id: {entry['id']} is not the id of its recipe JSON ({recipe.id}): a stale id")
    generic = None
    for (category, item), field in CHOICE_ITEMS.items():
        text = checklist.get(category, {}).get(item) if isinstance(checklist.get(category), Mapping) else None
        if not isinstance(text, str):
            continue
        value = str(getattr(recipe, field))
        first = re.match(r"[A-Za-z0-9_]+", text)
        if first and first.group(0) in _values(field) and first.group(0) != value:
            found.append(f"{category}/{item}: {text[:60]!r} names {field} {first.group(0)!r}, the recipe {value!r}")
        elif text == value or text.startswith(value + ":"):
            generic = generic if generic is not None else recipe.checklist()
            want = generic.get(category, {}).get(item)
            if isinstance(want, str) and text != want:
                found.append(f"{category}/{item}: {text[:60]!r} is not what the recipe states ({want[:60]!r})")
    return found + _regenerated_problems(checklist, recipe)


def _regenerated_problems(checklist: Mapping[str, Any], recipe: Recipe) -> list[str]:
    """Every item the recipe determines that says otherwise (``checklist_facts.regenerated``); the items only the
    trace could confirm are recorded on a :class:`Checklist` as its ``unchecked`` tuple."""
    want, unchecked = regenerated(checklist, recipe)
    found = []
    for category, items in checklist.items():
        if not isinstance(items, Mapping) or category == "recipe" and not isinstance(want.get(category), Mapping):
            continue
        for item, text in items.items():
            wanted = want.get(category, {}).get(item) if isinstance(want.get(category), Mapping) else None
            if f"{category}/{item}" in unchecked or wanted is None or (category, item) == ("recipe", "id"):
                continue
            if text != wanted:
                found.append(f"{category}/{item}: {str(text)[:60]!r} is not what the recipe states "
                             f"({str(wanted)[:60]!r})")
    layer = checklist.get("feature representation", {}).get("layer") \
        if isinstance(checklist.get("feature representation"), Mapping) else None
    blocks = re.search(r"of 0\.\.(\d+)", layer) if isinstance(layer, str) else None
    if problem := module_problem(checklist, recipe, int(blocks.group(1)) + 1 if blocks else None):
        found.append(problem)
    if hasattr(checklist, "unchecked"):
        checklist.unchecked = tuple(unchecked)  # type: ignore[attr-defined]
    return found


if contradictions not in CONTRADICTIONS:  # Checklist.from_json runs it (see vitcam_nb.core.checklist.CONTRADICTIONS)
    CONTRADICTIONS.append(contradictions)
