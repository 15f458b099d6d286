"""The control table the browser renders (one entry per recipe field, with allowed values, labels and when it
applies) and the turning of the browser's draft back into recipe fields.

Example:
    >>> import vitcam_nb as vc
    >>> as_recipe({"site": "F4"}).site
    'F4'
    >>> [d["name"] for d in diff_fields(vc.Recipe(), vc.Recipe(site="F4")) if d["differs"]]
    ['site']
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from vitcam_nb.compute.maps import DEGENERATE_CAUSES
from vitcam_nb.core.checklist import CATEGORIES
from vitcam_nb.core.errors import ArgumentTypeError, RecipeError
from vitcam_nb.core.presets import CITATIONS, PRESETS, names
from vitcam_nb.core.recipe import (
    ATTN_ROWS,
    HEAD_RULES,
    HEAD_SITES,
    LAYER_FUSIONS,
    NORMALIZES,
    RELUS,
    RESHAPES,
    ROLLOUTS,
    TARGETS,
    UPSAMPLES,
    WEIGHT_TOKENS,
    Recipe,
    is_int,
    pooled_weightings,
)
from vitcam_nb.core.weighting import channel_weighting_names
from vitcam_nb.widgets.facts import TraceFacts

__all__ = ["COLORMAPS", "DEBOUNCE_MS", "SITE_TEXT", "answer_choices", "applies", "as_recipe", "coerce_request",
           "controls", "diff_fields", "preset_menu"]

COLORMAPS = ("inferno", "viridis", "gray", "jet")  # inferno first: the perceptually uniform default
DEBOUNCE_MS = 30
SITE_TEXT = {
    "F1": "LayerNorm before attention",
    "F2": "softmax attention (per head)",
    "F3": "attention output, before proj",
    "F4": "LayerNorm before the MLP",
    "F5": "MLP output",
    "F6": "block output (residual)",
    "resid_pre": "block input (residual)",
    "attn_out": "attention output, after proj",
    "resid_mid": "residual after attention",
    "xattn": "cross-attention, text queries x image keys",
    "projector": "VLM projector output per image token",
    "lm_resid": "LM layer input (residual) at the image tokens",
    "lm_attn": "LM attention, answer rows x image tokens",
}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Recipe)}


def applies() -> dict[str, list[dict[str, Any]]]:
    """When a control applies (all conditions must hold). A control that does not apply is hidden, and a
    request from the browser resets it to its default: Recipe validation demands exactly that default.

    Example:
        >>> applies()["attn_rows"]
        [{'field': 'site', 'in': ['F2']}]
    """
    return {
        "heads": [{"field": "site", "in": list(HEAD_SITES)}, {"field": "layer_fusion", "not_in": list(ROLLOUTS)}],
        "attn_rows": [{"field": "site", "in": ["F2"]}],
        "text_tokens": [{"field": "site", "in": ["xattn"]}],
        "weight_tokens": [{"field": "weighting", "in": list(pooled_weightings())},
                          {"field": "layer_fusion", "not_in": list(ROLLOUTS)}],
        "weighting": [{"field": "layer_fusion", "not_in": list(ROLLOUTS)}],
        "target": [{"field": "layer_fusion", "not_in": ["rollout"]}],
        "class_": [{"field": "layer_fusion", "not_in": ["rollout"]}],
    }


def _pairs(values: tuple | list, text: Mapping | None = None) -> list[list]:
    return [[v, f"{v} · {text[v]}" if text and v in text else str(v)] for v in values]


def controls(facts: TraceFacts) -> dict[str, Any]:
    """The control table the browser renders: one entry per recipe field, with allowed values and labels,
    plus the condition under which it applies; the preset menu; the table that names a degenerate map's cause
    on its badge. Labels are plain text (the browser never parses HTML).

    Example:
        >>> [f["name"] for f in controls(TraceFacts.of(tr))["fields"]][:2]  # doctest: +SKIP
        ['site', 'layer']
    """
    classes = [[f"top{n}", f"top{n} · {facts.labels[facts.ranked[n - 1]]}"] for n in facts.top_ranks()]
    classes += answer_choices(facts) if facts.answer else [[c, f"{facts.labels[c]} ({c})"] for c in facts.classes]
    heads = [[h, h] for h in HEAD_RULES] + [[i, f"head {i}"] for i in range(facts.num_heads)]
    g = dict(zip(("feature", "target", "tokens", "aggregation", "spatial"), CATEGORIES))
    fields: list[dict[str, Any]] = [
        {"name": "site", "group": g["feature"], "kind": "select", "values": _pairs(facts.sites, SITE_TEXT)},
        {"name": "layer", "group": g["feature"], "kind": "layer", "layers": list(facts.layers),
         "num_layers": facts.num_layers,
         # a VLM's projector and LM sites have layers of their own: the slider follows the chosen site
         **({"by_site": {s: dict(zip(("layers", "num_layers"), (list(ls), n)))
                         for s, ls, n in ((s, *facts.layers_of(s)) for s, _ in facts.site_layers)}}
            if facts.site_layers else {})},
        {"name": "target", "group": g["target"], "kind": "select", "values": _pairs(TARGETS)},
        {"name": "class_", "label": "class", "group": g["target"], "kind": "select", "values": classes},
        {"name": "weight_tokens", "label": "weight tokens", "group": g["tokens"], "kind": "select",
         "values": _pairs(WEIGHT_TOKENS)},
        {"name": "weighting", "group": g["aggregation"], "kind": "select",
         "values": _pairs(channel_weighting_names())},
        {"name": "heads", "group": g["aggregation"], "kind": "select", "values": heads},
        {"name": "attn_rows", "label": "attention rows", "group": g["aggregation"], "kind": "select",
         "values": _pairs(ATTN_ROWS)},
        {"name": "layer_fusion", "label": "layer fusion", "group": g["aggregation"], "kind": "select",
         "values": _pairs(LAYER_FUSIONS)},
        {"name": "relu", "label": "ReLU", "group": g["aggregation"], "kind": "select", "values": _pairs(RELUS)},
        {"name": "reshape", "group": g["spatial"], "kind": "select", "values": _pairs(RESHAPES)},
        {"name": "upsample", "label": "upsampling", "group": g["spatial"], "kind": "select",
         "values": _pairs(UPSAMPLES)},
        {"name": "normalize", "label": "normalisation", "group": g["spatial"], "kind": "select",
         "values": _pairs(NORMALIZES)},
    ]
    if facts.text_tokens:
        words = [["all", "all · mean over the text"], ["cls", f"cls · {facts.text_tokens[0]}"]]
        words += [[i, f"{i} · {w}"] for i, w in enumerate(facts.text_tokens)]
        fields.insert(6, {"name": "text_tokens", "label": "text tokens", "group": g["tokens"], "kind": "select",
                          "values": words})
    rules = applies()
    for field in fields:
        field.setdefault("label", field["name"])
        field["default"] = _DEFAULTS[field["name"]]
        field["when"] = rules.get(field["name"], [])
    return {"fields": fields, "colormaps": list(COLORMAPS), "debounce_ms": DEBOUNCE_MS, "presets": preset_menu(facts),
            "degenerate_causes": [list(pair) for pair in DEGENERATE_CAUSES]}


def answer_choices(facts: TraceFacts) -> list[list]:
    """The class control of a generative VLM's answer trace: each answer token by its index and decoded text,
    then the sequence log-prob (the last class). Plain text: the browser never parses it as HTML.

    Example:
        >>> answer_choices(facts)  # doctest: +SKIP
        [[0, 'answer token 0 · red'], [1, 'sequence log-prob (sum of the answer tokens' log-probs)']]
    """
    last = max(facts.classes, default=-1)
    return [[c, f"answer token {c} · {facts.labels[c]}" if c < last else
             f"{facts.labels[c]} (sum of the answer tokens' log-probs)"] for c in facts.classes]


def preset_menu(facts: TraceFacts) -> list[list]:
    """The Explorer's preset menu: ``[name, label, recipe fields]`` for every preset whose site the trace has
    (choosing one sets all its fields; presets that read ``vc.score`` outputs say so when they are missing).

    Example:
        >>> [row[0] for row in preset_menu(facts)][:2]  # doctest: +SKIP
        ['pytorch_grad_cam_vit', 'gradcam']
    """
    menu = []
    for name in names():  # the taxonomy's order, whichever preset module the process imported first
        recipe = PRESETS[name]()
        if recipe.site in facts.sites:
            fields = recipe.to_dict()
            if facts.answer and not is_int(fields["class_"]):
                fields["class_"] = 0  # "topN" ranks unlike scores on an answer trace: its first answer token
            menu.append([name, f"{name} · {CITATIONS[name].split(',')[0]}", fields])
    return menu


def _holds(rules: list[dict[str, Any]], values: Mapping[str, Any]) -> bool:
    for rule in rules:
        value = values.get(rule["field"], _DEFAULTS[rule["field"]])
        if "in" in rule and value not in rule["in"]:
            return False
        if "not_in" in rule and value in rule["not_in"]:
            return False
    return True


def coerce_request(values: Mapping[str, Any], changed: list[str] | tuple[str, ...], facts: TraceFacts
                   ) -> dict[str, Any]:
    """Turn the browser's draft into recipe fields: hidden controls go back to their defaults, and a
    switch of layer fusion moves a single layer to all traced layers (or back to the last one).

    Example:
        >>> coerce_request({"site": "F1", "heads": "max"}, ["site"], facts)["heads"]  # doctest: +SKIP
        'channels'
    """
    if not isinstance(values, Mapping):
        raise RecipeError(f"request: expected an object of recipe fields, got {type(values).__name__}")
    out = dict(values)
    for _ in range(2):  # a reset can hide another control (weighting -> weight_tokens)
        for name, rules in applies().items():
            if not _holds(rules, out):
                out[name] = _DEFAULTS[name]
    if "layer_fusion" in changed:
        single = isinstance(out.get("layer"), int) and not isinstance(out.get("layer"), bool)
        if out.get("layer_fusion", "none") != "none" and single:
            out["layer"] = "all"
        elif out.get("layer_fusion", "none") == "none" and not single:
            layers = facts.layers_of(str(out.get("site", _DEFAULTS["site"])))[0]
            out["layer"] = layers[-1] if layers else -1
    # a single layer kept across a site switch that lacks it (tower block 3 -> a 2-layer LM) moves to the new
    # site's last layer rather than being refused (only where sites differ in layers: elsewhere a layer out of range
    # is refused, naming the range)
    if facts.site_layers:
        out["layer"] = facts.fit_layer(str(out.get("site", _DEFAULTS["site"])),
                                       out.get("layer", _DEFAULTS["layer"]))
    if isinstance(out.get("layer"), list):
        out["layer"] = tuple(out["layer"])
    return out


def as_recipe(value: Any) -> Recipe:
    """A Recipe from a Recipe, a mapping of fields or recipe JSON.

    Example:
        >>> as_recipe({"site": "F4"}).site
        'F4'
    """
    if isinstance(value, Recipe):
        return value
    if isinstance(value, Mapping):
        return Recipe.from_dict(value)
    if isinstance(value, str):
        return Recipe.from_json(value)
    raise ArgumentTypeError(f"recipe: expected a vitcam_nb.Recipe, a dict of fields or recipe JSON, got "
                            f"{type(value).__name__}")


def diff_fields(a: Recipe, b: Recipe) -> list[dict[str, Any]]:
    """Every recipe field with both values and whether they differ.

    Example:
        >>> [d["name"] for d in diff_fields(Recipe(), Recipe(site="F4")) if d["differs"]]
        ['site']
    """
    da, db = a.to_dict(), b.to_dict()
    return [{"name": k, "a": json.dumps(da[k]), "b": json.dumps(db[k]), "differs": da[k] != db[k]} for k in da]
