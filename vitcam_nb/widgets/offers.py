"""What an exported page offers: only the axis values and presets it can show. A value of an axis whose every
combination the trace refuses, and a preset the page's table does not reach as itself, are left out, and one
paragraph says, in words for a reader without Python, what was left out and why.

Example:
    >>> left_out_text([("weighting", "scorecam", *reason(["weighting: scorecam needs model outputs this trace "
    ...                                                   "does not hold (no 'score' variable)"], ["site"]))], {})
    'Not in this page: weighting scorecam (extra model passes are needed that were not run for this trace).'
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from vitcam_nb.core.recipe import Recipe, is_int

__all__ = ["Offer", "keep_shown", "key", "left_out_text", "reason", "shown_presets"]

PASSES = "extra model passes are needed that were not run for this trace"
NO_MAP = "no choice of this page's other settings gives a map on this trace"
# Reasons with a list: the items of every left-out thing with the same reason are named once, together.
SETTING = "a setting is needed that this page does not offer: {}"
FIXED = "set through fields this page keeps fixed: {}"
VALUES = "set through values this page does not hold: {}"
_FIELDS = tuple(Recipe().to_dict())
# Every trace refusal of a weighting that needs vc.score outputs says so in these words (core/weighting).
_MISSING_OUTPUTS = "this trace does not hold"

#: (what: "weighting", "preset", ...; its name; why it is left out; the items the reason lists)
Offer = tuple[str, str, str, tuple[str, ...]]


def key(value: Any) -> str:
    """The identity of an axis value, as the page compares them (JSON text).

    Example:
        >>> key([0, 1]) == key((0, 1))
        True
    """
    return json.dumps(value, sort_keys=True)


def reason(messages: Sequence[str], varied: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """Why every combination of a value was refused, in words for a reader, from the refusal messages (each
    names its argument first), and the settings it names.

    Example:
        >>> reason(["k: gscorecam keeps the top-k channels by gradient; set k"], ["site", "weighting"])
        ('a setting is needed that this page does not offer: {}', ('k',))
    """
    if any(_MISSING_OUTPUTS in m for m in messages):
        return PASSES, ()
    # An argument the page does not vary; "KeyError: ..." (an unexpected refusal's type) names none.
    named = {m.split(":", 1)[0] for m in messages}
    missing = tuple(sorted(n for n in named if n.isidentifier() and n.islower() and n not in varied))
    return (SETTING, missing) if missing else (NO_MAP, ())


def keep_shown(names: Sequence[str], values: Mapping[str, list], combos: Sequence[tuple], entries: Sequence[dict]
               ) -> tuple[dict[str, list], list[tuple], list[dict], list[Offer]]:
    """Drop every axis value whose combinations are all refusals (dropped combinations are all refusals, so no
    map is lost), keeping the product order; returns the kept values, combinations and entries and what left.

    Example:
        >>> keep_shown(["w"], {"w": ["a", "b"]}, [("a",), ("b",)], [{"g": 0}, {"e": "w: b needs x"}])[0]
        {'w': ['a']}
    """
    shown: list[set[str]] = [set() for _ in names]
    for combo, entry in zip(combos, entries):
        if "e" not in entry:
            for a, value in enumerate(combo):
                shown[a].add(key(value))
    kept = {n: [v for v in values[n] if key(v) in shown[a]] for a, n in enumerate(names)}
    left: list[Offer] = []
    for a, name in enumerate(names):
        for value in values[name]:
            if key(value) not in shown[a]:
                why = {e["e"] for c, e in zip(combos, entries) if key(c[a]) == key(value)}
                left.append((name, str(value), *reason(sorted(why), names)))
    pairs = [(c, e) for c, e in zip(combos, entries) if all(key(v) in shown[a] for a, v in enumerate(c))]
    return kept, [c for c, _ in pairs], [e for _, e in pairs], left


def _index(names: Sequence[str], kept: Mapping[str, list], draft: Mapping[str, Any], num_layers: int) -> int | str:
    """The entry the page shows for ``draft`` (as standalone.js looks it up), or the first field whose value
    the page does not hold."""
    index = 0
    for name in names:
        value = draft.get(name)
        if name == "layer" and is_int(value):
            value = value % num_layers
        keys = [key(v) for v in kept[name]]
        if key(value) not in keys:
            return name
        index = index * len(keys) + keys.index(key(value))
    return index


def shown_presets(menu: list[list], names: Sequence[str], kept: Mapping[str, list], entries: Sequence[dict],
                  start: Mapping[str, Any], num_layers: int, left: Sequence[Offer],
                  labels: Mapping[str, str]) -> tuple[list[list], list[Offer]]:
    """The presets whose choice shows a map of exactly their recipe in the page, and why each other one is not
    offered (``menu`` rows are ``[name, label, recipe fields]``, as :func:`~vitcam_nb.widgets.controls.
    preset_menu` gives them; ``start`` is the page's first recipe, whose fields the page keeps where no axis
    varies them).

    Example:
        >>> start = Recipe(layer=1).to_dict()
        >>> shown_presets([["p", "p", Recipe(site="F4", layer=1).to_dict()]], ["site"], {"site": ["F1"]}, [{"g": 0}],
        ...               start, 2, [], {})[1]
        [('preset', 'p', 'set through values this page does not hold: {}', ('site F4',))]
    """
    gone = {(name, value): (why, items) for name, value, why, items in left}
    out: list[list] = []
    dropped: list[Offer] = []

    def absolute(fields: Mapping[str, Any]) -> dict[str, Any]:
        layer = fields.get("layer")
        return {**fields, "layer": layer % num_layers if is_int(layer) else layer}

    for row in menu:
        want = absolute(Recipe.from_dict(row[2]).to_dict())
        fixed = [labels.get(f, f) for f in _FIELDS if f not in names and key(want[f]) != key(absolute(start)[f])]
        found = _index(names, kept, want, num_layers) if not fixed else None
        if fixed:
            why: tuple[str, tuple[str, ...]] = (FIXED, tuple(fixed))
        elif isinstance(found, str):
            value = want[found]
            why = gone.get((found, str(value)), (VALUES, (f"{labels.get(found, found)} {value}",)))
        elif "e" in entries[found]:
            why = reason([entries[found]["e"]], names)
        elif absolute(json.loads(entries[found]["r"])) != want:
            why = (NO_MAP, ())
        else:
            out.append(row)
            continue
        dropped.append(("preset", row[0], *why))
    return out, dropped


def left_out_text(left: Sequence[Offer], labels: Mapping[str, str]) -> str:
    """One paragraph for a reader: what the page does not offer and why ("" when nothing was left out).

    Example:
        >>> left_out_text([("preset", "a", FIXED, ("ReLU",)), ("preset", "b", FIXED, ("heads", "ReLU"))], {})
        'Not in this page: preset a, b (set through fields this page keeps fixed: ReLU, heads).'
    """
    groups: dict[tuple[str, str], tuple[list[str], dict[str, None]]] = {}
    for what, name, why, items in left:
        names, listed = groups.setdefault((what, why), ([], {}))
        names.append(name)
        listed.update(dict.fromkeys(items))
    parts = [f"{labels.get(what, what)} {', '.join(names)} ({why.format(', '.join(listed))})"
             for (what, why), (names, listed) in groups.items()]
    return f"Not in this page: {'; '.join(parts)}." if parts else ""
