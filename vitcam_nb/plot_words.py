"""The words of a map figure: the recipe in a few words, the class (or answer token) it explains, a map's title.

Shared by :mod:`vitcam_nb.plot` and :mod:`vitcam_nb.plot_views` (drawn and escaped the same way in both).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.core.escape import escape_mathtext
from vitcam_nb.core.recipe_canonical import ranked_entries

__all__ = ["class_name", "map_title", "recipe_dict", "recipe_short"]


def recipe_dict(recipe: Any) -> dict:
    """A recipe as a dict, from a Recipe, its dict or its JSON (a map's ``attrs["recipe"]``).

    Example:
        >>> recipe_dict('{"site": "F1"}')
        {'site': 'F1'}
    """
    if isinstance(recipe, dict):
        return recipe
    if isinstance(recipe, str):
        return json.loads(recipe)
    return recipe.to_dict()


def recipe_short(recipe: Any) -> str:
    """The recipe in a few words: weighting, site, block and target, then any other field off its default.

    ``recipe``: a Recipe, its dict or its JSON (a map's ``attrs["recipe"]``).

    Example:
        >>> from vitcam_nb.core.recipe import Recipe
        >>> recipe_short(Recipe(site="F4", layer=0, relu="none"))
        'gradcam · F4 · block 0 · logit · relu=none'
        >>> recipe_short(Recipe(site="lm_resid", layer=-1, class_=0))
        'gradcam · lm_resid · last LM layer · logit · class_=0'
    """
    from vitcam_nb.core.recipe import Recipe

    d = recipe_dict(recipe)
    layer, site = d.get("layer", -1), str(d.get("site", "F1"))
    # a VLM's LM sites index the language model's decoder layers, not the tower's blocks; its projector has one
    unit = "LM layer" if site in ("lm_resid", "lm_attn") else "block"
    if isinstance(layer, (list, tuple)):
        layer = f"{unit}s " + "+".join(map(str, layer))
    elif layer == -1:
        layer = f"last {unit}"
    elif isinstance(layer, int):
        layer = f"{unit} {layer}"
    else:
        layer = f"{layer} {unit}s"
    parts = [str(d.get("weighting", "gradcam")), site, *([] if site == "projector" else [layer]),
             str(d.get("target", "logit"))]
    default = Recipe().to_dict()
    shown = {"weighting", "site", "layer", "target"}
    parts += [f"{k}={v}" for k, v in d.items() if k not in shown and v != default.get(k)]
    return " · ".join(parts)


def class_name(trace: xr.Dataset, recipe: Any) -> str | None:
    """The name of the class a recipe explains on ``trace`` (``class_`` "top1".. resolved on its logits), or None
    when the trace has no class labels.

    Example:
        >>> class_name(tr, vc.Recipe())  # doctest: +SKIP
        'circle'
    """
    if "logits" not in getattr(trace, "variables", {}) or "class_label" not in trace.coords:
        return None
    cls = recipe_dict(recipe).get("class_", "top1")
    logits = np.asarray(trace["logits"].values, dtype=np.float64).ravel()
    n = ranked_entries(trace.attrs)  # an answer trace ranks its answer tokens only, as vc.cam does
    logits = logits[:n] if n is not None else logits
    if isinstance(cls, str) and cls.startswith("top"):
        rank = int(cls[3:])
        if not 1 <= rank <= logits.size:
            return None
        cls = int(np.argsort(-logits, kind="stable")[rank - 1])
    labels = trace["class_label"].values
    return str(labels[int(cls)]) if 0 <= int(cls) < len(labels) else None


def _sequence_class(trace: xr.Dataset) -> int:
    """The class index of an answer trace's sequence log-prob: right after its answer tokens."""
    return len([v for v in str(trace.attrs.get("answer_ids", "")).split(",") if v.strip()])


def map_title(trace: xr.Dataset, m: xr.DataArray) -> str:
    """A map's title: the recipe in words, then the class or answer token it explains, then a degenerate verdict.

    Example:
        >>> map_title(xr.Dataset(), xr.DataArray(np.zeros((1, 1)), attrs={"recipe": '{"site": "F1"}'}))
        'gradcam · F1 · last block · logit'
    """
    recipe = m.attrs.get("recipe")
    title = recipe_short(recipe) if recipe else f"recipe {m.attrs.get('recipe_id', '?')}"
    name = class_name(trace, recipe) if recipe else None
    if name is not None:  # the model's own label: drawn as written
        # a VLM answer trace's classes are the answer tokens (then the sequence log-prob, its own name)
        word = "class "
        if trace.attrs.get("target_kind") == "answer":
            sequence = str(recipe_dict(recipe).get("class_")) == str(_sequence_class(trace))
            word = "" if sequence else "answer token "
        title += f"\n{word}{escape_mathtext(name)}"
    if m.attrs.get("degenerate"):
        title += "\nDEGENERATE: map is all zeros"
    return title


