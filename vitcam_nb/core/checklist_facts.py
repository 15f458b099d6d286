"""The checklist a recipe gives on the trace facts a checklist states, item by item: what
:func:`vitcam_nb.core.checklist_check.contradictions` compares a stored checklist with.

A checklist made without a trace (``Recipe.checklist()``) is the recipe's alone: every item is regenerated and
compared. A checklist made on a trace (``vc.cam``; it has a ``model and input`` category) also states facts of that
trace, which the JSON does not otherwise hold. They are read back from the checklist (the model's block count from
``layer``, the input size, the token grid from ``reshape``, a clip's tubelets and frames, the backward rule, the
vitcam_nb version), the recipe's
checklist is made on them, and every item it determines is compared. What only the trace could confirm is
:data:`UNCHECKED`: the module path beyond its block number, which of ``input``/``output[i]`` an adapter reads
(beyond the site's: every adapter reads F3 at the projection's input and the other sites at a module's output),
the prefix tokens, the scores, a target's own items, the model facts, and the scalar and derivation of a target
other than the classifier's logits.

Example:
    >>> import vitcam_nb as vc
    >>> want, unchecked = regenerated(vc.Recipe(site="F4").checklist(), vc.Recipe(site="F4"))
    >>> want["aggregation"]["layer fusion"], unchecked
    ('none: a single layer', [])
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import xarray as xr

from vitcam_nb.core.errors import VitcamError

__all__ = ["UNCHECKED", "module_problem", "regenerated"]

#: Items a checklist made on a trace states from facts its JSON does not hold otherwise (see the module docstring).
UNCHECKED = (("feature representation", "module"), ("feature representation", "input or output"),
             ("gradient target", "scores"), ("token handling", "prefix tokens present"))
#: The site's read of a module: every adapter reads F3 at the projection's input, the others at an output.
_SITE_IO = {"F1": "output", "F2": "output", "F3": "input", "F4": "output", "F5": "output", "F6": "output"}


def _item(checklist: Mapping[str, Any], category: str, item: str) -> str | None:
    items = checklist.get(category)
    text = items.get(item) if isinstance(items, Mapping) else None
    return text if isinstance(text, str) else None


def _facts(checklist: Mapping[str, Any]) -> tuple[dict[str, Any], list[int] | None]:
    """The trace attributes (and blocks, for ``layer="all"``) the checklist states."""
    attrs: dict[str, Any] = {}
    versions = _item(checklist, "model and input", "versions") or ""
    if m := re.match(r"vitcam_nb (\S+),", versions):
        attrs["vitcam_nb_version"] = m.group(1)
    layer = _item(checklist, "feature representation", "layer") or ""
    if m := re.search(r"of 0\.\.(\d+)", layer):
        attrs["num_layers"] = int(m.group(1)) + 1
    traced = None
    if m := re.fullmatch(r"all traced blocks \(([\d, ]+?)(?: of 0\.\.\d+)?\)", layer):
        traced = [int(v) for v in m.group(1).split(",")]
    if (size := _item(checklist, "model and input", "input size")) is not None:
        attrs["img_size"] = size
    if m := re.match(r"raster: row-major (\d+) x (\d+) grid ", _item(checklist, "spatial reconstruction",
                                                                       "reshape") or ""):
        attrs["grid_h"], attrs["grid_w"] = int(m.group(1)), int(m.group(2))
    if m := re.match(r"([A-Za-z0-9_]+):", _item(checklist, "gradient target", "backward rule") or ""):
        attrs["backward_rule"] = m.group(1)
    if (scores := _item(checklist, "gradient target", "scores")) is not None:
        attrs["target_scores"] = scores
    if (tubelet := _item(checklist, "spatial reconstruction", "tubelet size")) is not None:  # a clip's checklist
        attrs["tubelet_size"] = tubelet
        reshape = _item(checklist, "spatial reconstruction", "reshape") or ""
        if m := re.match(r"raster: \(t, y, x\) grid of (\d+) x (\d+) x (\d+) .*\(token order (.*)\)$", reshape):
            attrs.update(grid_t=int(m.group(1)), grid_h=int(m.group(2)), grid_w=int(m.group(3)),
                         token_order=m.group(4))
        if m := re.search(r", \d+ -> (\d+) frames$", _item(checklist, "spatial reconstruction",
                                                              "time interpolation") or ""):
            attrs["clip_frames"] = int(m.group(1))
    return attrs, traced


def regenerated(checklist: Mapping[str, Any], recipe: Any) -> tuple[dict[str, Any], list[str]]:
    """The checklist ``recipe`` gives on the trace facts ``checklist`` states, and the items of ``checklist`` that
    it does not determine ("category/item"), those that only the trace could confirm.

    Example:
        >>> import vitcam_nb as vc
        >>> regenerated({"aggregation": {"relu": "x"}}, vc.Recipe())[0]["aggregation"]["relu"][:4]
        'ReLU'
    """
    if not isinstance(checklist.get("model and input"), Mapping):  # made without a trace: the recipe's alone
        return recipe.checklist(), []
    attrs, traced = _facts(checklist)
    coords: dict[str, Any] = {"layer": traced} if traced else {}
    if "tubelet_size" in attrs:  # the video kind reports on a trace whose tokens have frames
        coords["patch_frame"] = ("token", [])
    fake = xr.Dataset(coords=coords, attrs=attrs)
    try:
        want = recipe.checklist(fake)
    except VitcamError:  # a recipe no kind reports on these facts: nothing is regenerated
        return {}, [f"{c}/{i}" for c, items in checklist.items() if isinstance(items, Mapping) for i in items]
    unchecked = [f"{c}/{i}" for c, i in UNCHECKED if _item(checklist, c, i) is not None]
    unchecked += [f"model and input/{i}" for i in checklist["model and input"]]
    if attrs.get("target_scores", "classifier logits") != "classifier logits":
        unchecked += [f"gradient target/{i}" for i in ("scalar", "derivation")]  # the target's kind is not stored
    for category, items in checklist.items():
        if isinstance(items, Mapping) and category != "model and input":
            unchecked += [f"{category}/{i}" for i in items
                          if i not in want.get(category, {}) and f"{category}/{i}" not in unchecked]
    return want, unchecked


def module_problem(checklist: Mapping[str, Any], recipe: Any, num_layers: int | None) -> str | None:
    """What the ``module`` and ``input or output`` items say against the recipe's block and site, or None.

    Example:
        >>> import vitcam_nb as vc
        >>> item = {"feature representation": {"module": "blocks.0.norm1", "input or output": "output"}}
        >>> module_problem(item, vc.Recipe(layer=-1), 6)[:59]
        "feature representation/module: 'blocks.0.norm1' names block"
    """
    io = _item(checklist, "feature representation", "input or output")
    expected = _SITE_IO.get(recipe.site)
    if io is not None and expected is not None and io != "see trace" and not io.startswith(expected):
        return f"feature representation/input or output: {io[:40]!r}, but site {recipe.site} is read at a " \
               f"module's {expected}"
    module = _item(checklist, "feature representation", "module")
    if module is None or num_layers is None or not isinstance(recipe.layer, int):
        return None
    numbers = [int(part) for part in module.split(".") if part.isdecimal() and part.isascii()]
    block = recipe.layer % num_layers
    if len(numbers) == 1 and numbers[0] != block:  # one numbered component: the block's (a stage path has two)
        return f"feature representation/module: {module[:60]!r} names block {numbers[0]}, the recipe block {block}"
    return None
