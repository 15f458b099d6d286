"""What every widget shares: the trace facts the controls need, the control table sent to the browser,
request coercion, grid/image encoding, the ES-module bundle and the static (PNG) fallback."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.cam import cam
from vitcam_nb.errors import DegenerateMapWarning, RecipeError
from vitcam_nb.taxonomy import (
    ATTN_ROWS,
    HEAD_RULES,
    HEAD_SITES,
    LAYER_FUSIONS,
    NORMALIZES,
    POOLED_WEIGHTINGS,
    RELUS,
    RESHAPES,
    ROLLOUTS,
    SITES,
    TARGETS,
    UPSAMPLES,
    WEIGHT_TOKENS,
    WEIGHTINGS,
    Checklist,
    Recipe,
)

STATIC_DIR = Path(__file__).parent / "static"
COLORMAPS = ("jet", "viridis", "inferno", "gray")
DEBOUNCE_MS = 30

#: Add a PNG of the current view to every widget's display bundle, so that a notebook viewed without a
#: widget manager (nbconvert, GitHub, a closed kernel) still shows the figure. Set False to save space.
STATIC_PNG = True

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
}
GROUPS = ("feature representation", "gradient target", "token handling", "aggregation", "spatial reconstruction")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Recipe)}

# When a control applies (all conditions must hold). A control that does not apply is hidden, and a
# request from the browser resets it to its default: Recipe validation demands exactly that default.
APPLIES: dict[str, list[dict[str, Any]]] = {
    "heads": [{"field": "site", "in": list(HEAD_SITES)}, {"field": "layer_fusion", "not_in": list(ROLLOUTS)}],
    "attn_rows": [{"field": "site", "in": ["F2"]}],
    "text_tokens": [{"field": "site", "in": ["xattn"]}],
    "weight_tokens": [{"field": "weighting", "in": list(POOLED_WEIGHTINGS)},
                      {"field": "layer_fusion", "not_in": list(ROLLOUTS)}],
    "weighting": [{"field": "layer_fusion", "not_in": list(ROLLOUTS)}],
    "target": [{"field": "layer_fusion", "not_in": ["rollout"]}],
    "class_": [{"field": "layer_fusion", "not_in": ["rollout"]}],
}


@dataclass(frozen=True)
class TraceFacts:
    """What the controls need to know about a trace: sites, layers, heads, traced classes and labels."""

    sites: tuple[str, ...]
    layers: tuple[int, ...]
    num_layers: int
    num_heads: int
    classes: tuple[int, ...]
    labels: dict[int, str]
    ranked: tuple[int, ...]
    image: np.ndarray
    text_tokens: tuple[str, ...] = ()

    @classmethod
    def of(cls, trace: xr.Dataset) -> TraceFacts:
        """Read the facts from a trace Dataset.

        Example:
            >>> facts = TraceFacts.of(tr)  # doctest: +SKIP
        """
        if not isinstance(trace, xr.Dataset):
            hint = ("; widgets show one stage of a hierarchical trace: pass vc.stages.stage_dataset(tr, stage)"
                    if isinstance(trace, xr.DataTree) else "")
            raise TypeError(f"trace: expected an xarray.Dataset from vitcam_nb.trace(), got "
                            f"{type(trace).__name__}{hint}")
        for name in ("image", "logits", "target_class", "layer"):
            if name not in trace.variables:
                raise ValueError(f"trace: has no {name!r}; pass a Dataset made by vitcam_nb.trace()")
        traced = {str(s) for s in trace["site"].values} if "site" in trace.variables else set()
        if "attn" in trace.variables or "attn_window" in trace.variables:
            traced.add("F2")
        if "xattn" in trace.variables:
            traced.add("xattn")
        text = tuple(str(v) for v in trace["text_token_str"].values) if "text_token_str" in trace.variables else ()
        sites = tuple(s for s in SITES if s in traced)
        layers = tuple(int(v) for v in trace["layer"].values)
        num_layers = int(trace.attrs.get("num_layers", max(layers) + 1))
        classes = tuple(int(c) for c in trace["target_class"].values if int(c) >= 0)
        logits = np.asarray(trace["logits"].values, dtype=np.float64)
        if "class_label" in trace.variables:
            names = [str(v) for v in trace["class_label"].values]
        else:
            names = [str(i) for i in range(logits.size)]
        labels = {c: names[c] if c < len(names) else str(c) for c in classes}
        ranked = tuple(int(c) for c in np.argsort(-logits, kind="stable"))
        image = np.asarray(trace["image"].values)
        if image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"trace: image has shape {image.shape}; expected (y, x, 3)")
        if image.dtype != np.uint8:
            image = np.clip(image, 0, 255).astype(np.uint8)
        return cls(sites=sites, layers=layers, num_layers=num_layers,
                   num_heads=int(trace.attrs.get("num_heads", 1)), classes=classes, labels=labels,
                   ranked=ranked, image=image, text_tokens=text)

    def top_ranks(self) -> list[int]:
        """The N of every "topN" class choice whose class was traced.

        Example:
            >>> TraceFacts.of(tr).top_ranks()  # doctest: +SKIP
            [1, 2, 3, 4, 5]
        """
        return [n for n in range(1, len(self.ranked) + 1) if self.ranked[n - 1] in self.classes][:len(self.classes)]


def default_recipe(facts: TraceFacts) -> Recipe:
    """The package default recipe, moved to a site and class this trace holds if it lacks F1 or top1.

    Example:
        >>> default_recipe(TraceFacts.of(tr)).site  # doctest: +SKIP
        'F1'
    """
    changes: dict[str, Any] = {}
    if facts.sites and _DEFAULTS["site"] not in facts.sites:
        # A token site first: F2's default query row is CLS, which not every model has.
        changes["site"] = next((s for s in facts.sites if s != "F2"), facts.sites[0])
    if facts.classes and 1 not in facts.top_ranks():
        changes["class_"] = facts.classes[0]
    if facts.layers and (_DEFAULTS["layer"] % facts.num_layers) not in facts.layers:
        changes["layer"] = facts.layers[-1]
    return Recipe(**changes)


def _pairs(values: tuple | list, text: Mapping | None = None) -> list[list]:
    return [[v, f"{v} · {text[v]}" if text and v in text else str(v)] for v in values]


def controls(facts: TraceFacts) -> dict[str, Any]:
    """The control table the browser renders: one entry per recipe field, with allowed values and labels,
    plus the condition under which it applies. Labels are plain text (the browser never parses HTML).

    Example:
        >>> [f["name"] for f in controls(TraceFacts.of(tr))["fields"]][:2]  # doctest: +SKIP
        ['site', 'layer']
    """
    classes = [[f"top{n}", f"top{n} · {facts.labels[facts.ranked[n - 1]]}"] for n in facts.top_ranks()]
    classes += [[c, f"{facts.labels[c]} ({c})"] for c in facts.classes]
    heads = [[h, h] for h in HEAD_RULES] + [[i, f"head {i}"] for i in range(facts.num_heads)]
    g = dict(zip(("feature", "target", "tokens", "aggregation", "spatial"), GROUPS))
    fields: list[dict[str, Any]] = [
        {"name": "site", "group": g["feature"], "kind": "select", "values": _pairs(facts.sites, SITE_TEXT)},
        {"name": "layer", "group": g["feature"], "kind": "layer", "layers": list(facts.layers),
         "num_layers": facts.num_layers},
        {"name": "target", "group": g["target"], "kind": "select", "values": _pairs(TARGETS)},
        {"name": "class_", "label": "class", "group": g["target"], "kind": "select", "values": classes},
        {"name": "weight_tokens", "label": "weight tokens", "group": g["tokens"], "kind": "select",
         "values": _pairs(WEIGHT_TOKENS)},
        {"name": "weighting", "group": g["aggregation"], "kind": "select", "values": _pairs(WEIGHTINGS)},
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
    for field in fields:
        field.setdefault("label", field["name"])
        field["default"] = _DEFAULTS[field["name"]]
        field["when"] = APPLIES.get(field["name"], [])
    return {"fields": fields, "colormaps": list(COLORMAPS), "debounce_ms": DEBOUNCE_MS}


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
        for name, rules in APPLIES.items():
            if not _holds(rules, out):
                out[name] = _DEFAULTS[name]
    if "layer_fusion" in changed:
        single = isinstance(out.get("layer"), int) and not isinstance(out.get("layer"), bool)
        if out.get("layer_fusion", "none") != "none" and single:
            out["layer"] = "all"
        elif out.get("layer_fusion", "none") == "none" and not single:
            out["layer"] = facts.layers[-1] if facts.layers else -1
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
    raise TypeError(f"recipe: expected a vitcam_nb.Recipe, a dict of fields or recipe JSON, got {type(value).__name__}")


@dataclass
class GridResult:
    """One recipe computed on the token grid, with everything the widgets display about it."""

    recipe: Recipe
    grid: np.ndarray
    checklist: dict
    methods: str
    degenerate: str
    notes: str

    @property
    def checklist_md(self) -> str:
        """The checklist as a markdown table (what the widget's copy button copies)."""
        return Checklist(self.checklist).to_markdown()


def compute_grid(trace: xr.Dataset, recipe: Recipe) -> GridResult:
    """``vc.cam(trace, recipe, grid=True)`` with its report; the degenerate warning becomes a field.

    Example:
        >>> compute_grid(tr, Recipe()).grid.dtype  # doctest: +SKIP
        dtype('float32')
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateMapWarning)
        m = cam(trace, recipe, grid=True)
    grid = np.ascontiguousarray(m.values, dtype="<f4")
    # The grid is computed with upsample="none"; the report describes the recipe as chosen (its upsampling).
    return GridResult(recipe=recipe, grid=grid, checklist=json.loads(recipe.checklist(trace).to_json()),
                      methods=recipe.describe(trace), degenerate=str(m.attrs.get("degenerate", "")),
                      notes=str(m.attrs.get("degenerate_layers", "")))


def grid_bytes(grid: np.ndarray) -> bytes:
    """float32 little-endian bytes of an array (the binary buffer the browser reads).

    Example:
        >>> len(grid_bytes(np.zeros((2, 3))))
        24
    """
    return np.ascontiguousarray(grid, dtype="<f4").tobytes()


def grid_from_bytes(data: bytes, shape: list[int] | tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`grid_bytes`.

    Example:
        >>> float(grid_from_bytes(grid_bytes(np.ones((2, 2))), [2, 2]).sum())
        4.0
    """
    return np.frombuffer(bytes(data), dtype="<f4").reshape(tuple(int(s) for s in shape))


def image_rgba(image: np.ndarray) -> bytes:
    """RGBA bytes (opaque) of an (H, W, 3) uint8 image, sent to the browser once.

    Example:
        >>> len(image_rgba(np.zeros((2, 2, 3), np.uint8)))
        16
    """
    h, w = image.shape[:2]
    out = np.empty((h, w, 4), np.uint8)
    out[..., :3] = image
    out[..., 3] = 255
    return out.tobytes()


def error_text(exc: BaseException) -> str:
    """The message shown in a widget for a refused change (no traceback).

    Example:
        >>> error_text(KeyError("x"))
        "KeyError: 'x'"
    """
    if isinstance(exc, RecipeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


@lru_cache(maxsize=8)
def esm(name: str) -> str:
    """The ES module of one widget: the shared core followed by the widget's own file (no build step:
    both are plain JavaScript in ``static/``; anywidget loads a module from a string, so the core is
    prepended rather than imported).

    Example:
        >>> "export default" in esm("explorer.js")
        True
    """
    core = (STATIC_DIR / "core.js").read_text(encoding="utf-8")
    own = (STATIC_DIR / name).read_text(encoding="utf-8")
    return f"{core}\n// ---- {name} ----\n{own}"


@lru_cache(maxsize=1)
def css() -> str:
    """The shared stylesheet of the widgets.

    Example:
        >>> ".vc-widget" in css()
        True
    """
    return (STATIC_DIR / "widgets.css").read_text(encoding="utf-8")


def png_bundle(data: dict, make_figure: Any) -> dict:
    """Add ``image/png`` of ``make_figure()`` to a display bundle (widgets stay preferred where they work).

    Example:
        >>> import matplotlib.pyplot as plt
        >>> "image/png" in png_bundle({"text/plain": "widget"}, plt.figure)
        True
    """
    if not STATIC_PNG:
        return data
    try:
        import matplotlib.pyplot as plt

        fig = make_figure()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
        plt.close(fig)
    except Exception:  # a static preview must never break the live widget
        return data
    return {**data, "image/png": base64.b64encode(buf.getvalue()).decode("ascii")}


def diff_fields(a: Recipe, b: Recipe) -> list[dict[str, Any]]:
    """Every recipe field with both values and whether they differ.

    Example:
        >>> [d["name"] for d in diff_fields(Recipe(), Recipe(site="F4")) if d["differs"]]
        ['site']
    """
    da, db = a.to_dict(), b.to_dict()
    return [{"name": k, "a": json.dumps(da[k]), "b": json.dumps(db[k]), "differs": da[k] != db[k]} for k in da]
