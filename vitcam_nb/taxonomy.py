"""The Grad-CAM-for-ViT taxonomy: a :class:`Recipe` names every choice, validates it, has a canonical JSON
form and a stable id, and renders the reporting checklist of DESIGN.md section 6."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from vitcam_nb.errors import RecipeError

TOKEN_SITES = ("F1", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid")
SITES = ("F1", "F2", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid", "xattn")
TARGETS = ("logit", "prob", "logprob")
WEIGHT_TOKENS = ("patch", "all", "cls")
RESHAPES = ("raster",)
UPSAMPLES = ("bilinear", "bicubic", "nearest", "none")
WEIGHTINGS = ("gradcam", "hirescam", "gradcam_elementwise", "gradcampp", "xgradcam", "layercam",
              "eigencam", "eigengradcam", "gradient")
HEAD_RULES = ("channels", "mean_then_relu", "relu_then_mean", "max")
ATTN_ROWS = ("cls", "mean", "patch_mean")
LAYER_FUSIONS = ("none", "mean", "sum", "max", "rollout", "grad_rollout")
RELUS = ("after", "none")
NORMALIZES = ("minmax", "max", "none")

# Weightings whose channel weights pool gradients over tokens, so the choice of tokens matters.
POOLED_WEIGHTINGS = ("gradcam", "gradcampp", "xgradcam")
GRADIENT_FREE = ("eigencam",)
ROLLOUTS = ("rollout", "grad_rollout")
HEAD_SITES = ("F2", "F3", "xattn")
# Fields added after 0.1.0: left out of the canonical JSON while at their default, so older ids stay valid.
LATER_FIELDS = ("text_tokens",)
# A Swin-style block address "stage.block" (block may be negative, counted from the end of the stage).
STAGE_BLOCK = re.compile(r"(\d+)\.(-?\d+)")

WEIGHTING_FORMULAS = {
    "gradcam": "alpha_k = mean over weight tokens of G[t,k]; map[t] = sum_k alpha_k A[t,k] (Selvaraju et al. 2017)",
    "hirescam": "map[t] = sum_k G[t,k] A[t,k] (Draelos & Carin 2020)",
    "gradcam_elementwise": "map[t] = sum_k relu(G[t,k] A[t,k])",
    "gradcampp": "alpha_k = sum_t relu(G[t,k]) a[t,k], a = G^2 / (2 G^2 + (sum_t A[t,k]) G^3 + 1e-6), "
                 "a = 0 where G = 0; map[t] = sum_k alpha_k A[t,k] (Chattopadhay et al. 2018)",
    "xgradcam": "alpha_k = sum_t G[t,k] A[t,k] / (sum_t A[t,k] + 1e-7); map[t] = sum_k alpha_k A[t,k] "
                "(Fu et al. 2020)",
    "layercam": "map[t] = sum_k relu(G[t,k]) A[t,k] (Jiang et al. 2021)",
    "eigencam": "projection of the centred activations on their first right singular vector, sign fixed so "
                "that the largest-magnitude token is positive (Muhammad & Yeasin 2020)",
    "eigengradcam": "projection of the centred G*A on its first right singular vector, sign fixed so that "
                    "the largest-magnitude token is positive",
    "gradient": "map[t] = sum_k G[t,k] (gradient only, as in LeGrad-style maps)",
}
HEAD_RULE_TEXT = {
    "channels": "heads are channels: contributions summed over all heads",
    "mean_then_relu": "per-head maps averaged over heads, then the ReLU",
    "relu_then_mean": "ReLU of each per-head map, then averaged over heads",
    "max": "maximum over per-head maps",
}
ATTN_ROW_TEXT = {
    "cls": "the CLS query row",
    "mean": "the mean over all query rows",
    "patch_mean": "the mean over patch query rows",
}
FUSION_TEXT = {
    "none": "a single layer",
    "mean": "per-layer maps (ReLU, normalised, upsampled) averaged over layers",
    "sum": "per-layer maps (ReLU, normalised, upsampled) summed over layers",
    "max": "per-layer maps (ReLU, normalised, upsampled), pixelwise maximum over layers",
    "rollout": "attention rollout R = prod_l (0.5 mean_h A_l + 0.5 I) (Abnar & Zuidema 2020)",
    "grad_rollout": "gradient-weighted rollout R <- R + mean_h(relu(G_l * A_l)) R from R = I (Chefer et al. 2021b)",
}

_FIELDS_DOC = """
    site: feature location, F1..F6, an extended site (resid_pre, attn_out, resid_mid) or "xattn"
        (cross-attention of text queries to image keys, vision-language models).
    layer: block index (negative counts from the end), "stage.block" for hierarchical models (e.g. "2.-1"),
        a tuple of these, or "all". For site "xattn" it indexes the cross-attention layers.
    target: scalar differentiated: "logit", "prob" or "logprob" (the last two derived exactly from the trace).
    class_: class index, or "topN" for the N-th highest logit (default "top1").
    weight_tokens: tokens whose gradients form channel weights: "patch" (prefix tokens dropped), "all", "cls".
    reshape: token-to-grid rule; "raster" (row-major grid from patch_row/patch_col).
    upsample: "bilinear", "bicubic", "nearest" or "none" (stay on the token grid).
    weighting: channel aggregation formula (see WEIGHTING_FORMULAS).
    heads: head aggregation on F2/F3: "channels", "mean_then_relu", "relu_then_mean", "max" or a head index.
    attn_rows: F2 query rows: "cls", "mean", "patch_mean".
    layer_fusion: "none", "mean", "sum", "max", "rollout", "grad_rollout".
    relu: "after" (ReLU on each layer map) or "none".
    normalize: "minmax", "max" or "none".
    text_tokens: site "xattn" only: text query rows, "all" (mean over the text tokens), "cls" (the first,
        [CLS]/[ENC] token), a token position, or a word (every token whose text equals it).
"""


def _choice(field: str, value: Any, allowed: tuple) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise RecipeError(f"{field}: got {value!r}; allowed values are {list(allowed)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _plain_int(value: Any) -> Any:
    """numpy integers (e.g. from ``tr.layer.values``) become Python ints so the JSON stays canonical."""
    return int(value) if _is_int(value) else value


@dataclasses.dataclass(frozen=True)
class Recipe:
    __doc__ = f"""One fully specified Grad-CAM-for-ViT variant. Frozen, validated, hashable.

    Fields (every one has a single default, stated in the checklist):
    {_FIELDS_DOC}
    Example:
        >>> r = Recipe(site="F1", layer=-1, target="logit", weighting="gradcam")
        >>> Recipe.from_json(r.to_json()) == r
        True
        >>> len(r.id)
        12
    """

    site: str = "F1"
    layer: int | tuple[int, ...] | str = -1
    target: str = "logit"
    class_: int | str = "top1"
    weight_tokens: str = "patch"
    reshape: str = "raster"
    upsample: str = "bilinear"
    weighting: str = "gradcam"
    heads: str | int = "channels"
    attn_rows: str = "cls"
    layer_fusion: str = "none"
    relu: str = "after"
    normalize: str = "minmax"
    text_tokens: str | int = "all"

    def __post_init__(self) -> None:
        layer = self.layer
        if isinstance(layer, (list, tuple)):
            layer = tuple(_plain_int(v) for v in layer)
        else:
            layer = _plain_int(layer)
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "class_", _plain_int(self.class_))
        object.__setattr__(self, "heads", _plain_int(self.heads))
        object.__setattr__(self, "text_tokens", _plain_int(self.text_tokens))
        _choice("site", self.site, SITES)

        def canonical(v: Any) -> Any:  # "01.0" and "1.0" name the same block, so they get one id
            m = STAGE_BLOCK.fullmatch(v) if isinstance(v, str) else None
            return f"{int(m.group(1))}.{int(m.group(2))}" if m else v
        layer = tuple(canonical(v) for v in layer) if isinstance(layer, tuple) else canonical(layer)
        object.__setattr__(self, "layer", layer)

        def one_layer(v: Any) -> bool:
            return _is_int(v) or (isinstance(v, str) and STAGE_BLOCK.fullmatch(v) is not None)
        if isinstance(layer, tuple):
            if not layer or not all(one_layer(v) for v in layer) or len(set(layer)) != len(layer):
                raise RecipeError(f"layer: a tuple must hold distinct ints or 'stage.block' strings, got {layer!r}")
        elif not (one_layer(layer) or layer == "all"):
            raise RecipeError(f"layer: expected an int (negative from the end), 'stage.block' (e.g. '2.-1'), "
                              f"a tuple of these or 'all', got {layer!r}")
        if _is_int(self.text_tokens):
            if self.text_tokens < 0:
                raise RecipeError(f"text_tokens: got {self.text_tokens}; a token position must be >= 0")
        elif not isinstance(self.text_tokens, str) or not self.text_tokens.strip():
            raise RecipeError(f"text_tokens: got {self.text_tokens!r}; expected 'all', 'cls', a token position "
                              "or a word")
        _choice("target", self.target, TARGETS)
        if _is_int(self.class_):
            if self.class_ < 0:
                raise RecipeError(f"class_: got {self.class_}; expected a class index >= 0 or 'topN'")
        elif not (isinstance(self.class_, str) and re.fullmatch(r"top[1-9]\d*", self.class_)):
            raise RecipeError(f"class_: got {self.class_!r}; expected a class index or 'top1', 'top2', ...")
        _choice("weight_tokens", self.weight_tokens, WEIGHT_TOKENS)
        _choice("reshape", self.reshape, RESHAPES)
        _choice("upsample", self.upsample, UPSAMPLES)
        _choice("weighting", self.weighting, WEIGHTINGS)
        if _is_int(self.heads):
            if self.heads < 0:
                raise RecipeError(f"heads: got {self.heads}; a head index must be >= 0")
        else:
            _choice("heads", self.heads, HEAD_RULES)
        _choice("attn_rows", self.attn_rows, ATTN_ROWS)
        _choice("layer_fusion", self.layer_fusion, LAYER_FUSIONS)
        _choice("relu", self.relu, RELUS)
        _choice("normalize", self.normalize, NORMALIZES)
        self._check_combination()

    def _check_combination(self) -> None:
        default = Recipe.__dataclass_fields__
        single = not isinstance(self.layer, tuple) and self.layer != "all"
        if self.layer_fusion == "none" and not single:
            raise RecipeError(f"layer: {self.layer!r} names several layers but layer_fusion is 'none'; "
                              f"choose layer_fusion from {list(LAYER_FUSIONS[1:])}")
        if self.heads != default["heads"].default and self.site not in HEAD_SITES:
            raise RecipeError(f"heads: applies to sites {list(HEAD_SITES)} only, not {self.site}; "
                              f"leave it at {default['heads'].default!r}")
        if self.attn_rows != default["attn_rows"].default and self.site != "F2":
            raise RecipeError(f"attn_rows: applies to site F2 (attention rows) only, not {self.site}; "
                              f"leave it at {default['attn_rows'].default!r}")
        if self.text_tokens != default["text_tokens"].default and self.site != "xattn":
            raise RecipeError(f"text_tokens: applies to site 'xattn' (cross-attention rows) only, not "
                              f"{self.site}; leave it at {default['text_tokens'].default!r}")
        if self.weight_tokens != "patch" and self.weighting not in POOLED_WEIGHTINGS:
            raise RecipeError(f"weight_tokens: only weightings that pool gradients over tokens "
                              f"{list(POOLED_WEIGHTINGS)} use it; {self.weighting} is per token, "
                              "so leave weight_tokens at 'patch'")
        if self.weighting in ("eigencam", "eigengradcam") and self.heads != "channels":
            raise RecipeError(f"heads: {self.weighting} projects all channels at once; heads must be "
                              f"'channels', got {self.heads!r}")
        if self.layer_fusion in ROLLOUTS:
            if self.site != "F2":
                raise RecipeError(f"site: layer_fusion={self.layer_fusion!r} is computed from the attention "
                                  f"matrices; it needs site 'F2', got {self.site!r}")
            if self.weighting != "gradcam" or self.heads != "channels":
                raise RecipeError(f"weighting: {self.layer_fusion} has its own formula (mean over heads); "
                                  "leave weighting at 'gradcam' and heads at 'channels'")
            if self.layer_fusion == "rollout" and (self.target != "logit" or self.class_ != "top1"):
                raise RecipeError("target: attention rollout uses no gradient; leave target at 'logit' and "
                                  "class_ at 'top1'")

    # -- identity -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, in declaration order, JSON-ready (tuples become lists).

        Example:
            >>> Recipe().to_dict()["site"]
            'F1'
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in LATER_FIELDS or getattr(self, f.name) != f.default}
        if isinstance(out["layer"], tuple):
            out["layer"] = list(out["layer"])
        return out

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, compact separators; equal recipes give equal strings.

        Example:
            >>> Recipe().to_json()[:20]
            '{"attn_rows":"cls","'
        """
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        """Rebuild a recipe from :meth:`to_json` output (unknown keys are refused).

        Example:
            >>> Recipe.from_json('{"site": "F4"}').site
            'F4'
        """
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as exc:
            raise RecipeError(f"text: not valid recipe JSON ({exc})") from exc
        if not isinstance(data, Mapping):
            raise RecipeError(f"text: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """Build a recipe from a mapping of field names, refusing unknown fields.

        Example:
            >>> Recipe.from_dict({"layer": [0, 1], "layer_fusion": "mean"}).layer
            (0, 1)
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise RecipeError(f"{unknown[0]}: unknown recipe field; fields are {names}")
        return cls(**data)

    @property
    def id(self) -> str:
        """Short stable id: the first 12 hex digits of the SHA-256 of the canonical JSON.

        Example:
            >>> Recipe().id == Recipe(site="F1").id
            True
        """
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:12]

    def replace(self, **changes: Any) -> Recipe:
        """A copy with some fields changed (validated again).

        Example:
            >>> Recipe().replace(site="F4").site
            'F4'
        """
        names = [f.name for f in dataclasses.fields(self)]
        for key in changes:
            if key not in names:
                raise RecipeError(f"{key}: unknown recipe field; fields are {names}")
        return dataclasses.replace(self, **changes)

    # -- reporting ----------------------------------------------------------------------------------
    def checklist(self, trace: Any = None) -> Checklist:
        """The reporting checklist in the five categories of the audit; with a trace, model facts too.

        Example:
            >>> list(Recipe().checklist())[:2]
            ['feature representation', 'gradient target']
        """
        return build_checklist(self, trace)

    def describe(self, trace: Any = None) -> str:
        """A methods paragraph that a paper can paste.

        Example:
            >>> "F1" in Recipe().describe()
            True
        """
        return describe(self, trace)


class Checklist(dict):
    """The checklist: category -> {item: text}. Renders as a markdown table in notebooks.

    Example:
        >>> print(Recipe().checklist().to_markdown().splitlines()[0])
        | category | item | value |
    """

    def to_markdown(self) -> str:
        lines = ["| category | item | value |", "| --- | --- | --- |"]
        for category, items in self.items():
            for item, value in items.items():
                lines.append(f"| {category} | {item} | {str(value).replace('|', '/')} |")
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def to_json(self) -> str:
        return json.dumps(self, sort_keys=False)


def _layer_text(recipe: Recipe, num_layers: int | None = None) -> str:
    if recipe.layer == "all":
        return "all traced blocks"
    values = recipe.layer if isinstance(recipe.layer, tuple) else (recipe.layer,)
    if num_layers is None:
        text = ", ".join(map(str, values)) + (" (the last block)" if values == (-1,) else "")
    else:
        absolute = [v % num_layers if _is_int(v) else f"{v} (stage.block)" for v in values]
        text = ", ".join(map(str, absolute)) + f" of 0..{num_layers - 1}"
        if absolute == [num_layers - 1]:
            text += " (the last block)"
    return ("blocks " if len(values) > 1 else "block ") + text


def _target_text(recipe: Recipe) -> tuple[str, str]:
    cls = f"class {recipe.class_}" if _is_int(recipe.class_) else \
        f"the class ranked {recipe.class_[3:]} by logit ({recipe.class_})"
    if recipe.layer_fusion == "rollout":
        return "none: attention rollout uses no gradient", "not applicable"
    scalar = {"logit": "the raw logit z_c (pre-softmax)",
              "prob": "the softmax probability p_c",
              "logprob": "the log-probability log p_c"}[recipe.target]
    how = "direct: stored gradient of z_c" if recipe.target == "logit" else (
        "derived exactly from the stored gradients: dp_c = p_c (dz_c - dE), E = sum_j p_j z_j with p detached"
        if recipe.target == "prob" else "derived exactly: dlog p_c = dz_c - dE, E = sum_j p_j z_j, p detached")
    if recipe.weighting == "eigencam":
        return "none: EigenCAM uses no gradient", "not applicable"
    return f"{scalar} of {cls}", how


def _preset_citation(recipe: Recipe) -> str:
    from vitcam_nb.presets import citation

    return citation(recipe)


def _stage_modules(template: str, layer: Any, stages: list[list[int]]) -> str:
    """Module paths of a hierarchical model's blocks named by ``layer`` (global ints or "stage.block")."""
    where = {g: (s, b) for s, ids in enumerate(stages) for b, g in enumerate(ids)}
    total = len(where)
    wanted = list(where) if layer == "all" else list(layer) if isinstance(layer, tuple) else [layer]
    paths = []
    for v in wanted:
        if isinstance(v, str):
            s, b = (int(x) for x in STAGE_BLOCK.fullmatch(v).groups())
            if s >= len(stages) or not -len(stages[s]) <= b < len(stages[s]):
                continue
            s, b = s, b % len(stages[s])
        elif -total <= v < total:
            s, b = where[v % total]
        else:
            continue
        paths.append(template.replace("{stage}", str(s)).replace("{block}", str(b)))
    return ", ".join(paths) or template


def build_checklist(recipe: Recipe, trace: Any = None) -> Checklist:
    """Build the checklist of ``recipe``; pass a trace to add module paths, tokens and model facts.

    Example:
        >>> build_checklist(Recipe())["aggregation"]["weighting"][:7]
        'gradcam'
    """
    attrs = dict(getattr(trace, "attrs", {}) or {})
    hook = attrs.get(f"hook_{recipe.site}", "")
    module, _, io = hook.partition(":")
    if module and "{block}" in module and "stage_layers" in attrs:
        module = _stage_modules(module, recipe.layer, json.loads(attrs["stage_layers"]))
    elif module and _is_int(recipe.layer) and "num_layers" in attrs:
        module = module.replace("{layer}", str(recipe.layer % int(attrs["num_layers"])))
    elif module:
        module = module.replace("{layer}", "<l>") + " for each block l listed"
    scalar, how = _target_text(recipe)
    prefix = int(attrs.get("num_prefix_tokens", -1))
    if trace is not None and "token_kind" in getattr(trace, "coords", {}):
        kinds = [str(k) for k in trace["token_kind"].values[:prefix]] if prefix > 0 else []
        prefix_text = f"{prefix} ({', '.join(kinds)})" if kinds else "none"
    else:
        prefix_text = "see trace"
    site_text = recipe.site
    if recipe.site == "F2":
        site_text += f" (softmax attention, key tokens of {ATTN_ROW_TEXT[recipe.attn_rows]})"
    weighting = recipe.weighting if recipe.layer_fusion not in ROLLOUTS else "not used"
    heads = recipe.heads if recipe.site in HEAD_SITES else "not applicable (no heads at this site)"
    if _is_int(recipe.heads):
        heads_text = f"head {recipe.heads} only"
    elif recipe.site in HEAD_SITES:
        heads_text = f"{heads}: {HEAD_RULE_TEXT[recipe.heads]}"
        if recipe.layer_fusion in ROLLOUTS:
            heads_text = "mean over heads (the rollout's own rule)"
    else:
        heads_text = heads
    weight_tokens = {"patch": "patch tokens only (prefix tokens dropped)", "all": "all tokens incl. prefix",
                     "cls": "the CLS token only"}[recipe.weight_tokens]
    if recipe.weighting not in POOLED_WEIGHTINGS or recipe.layer_fusion in ROLLOUTS:
        weight_tokens = "none (the formula is per token, no channel weights are pooled)"
    grid = f"{attrs['grid_h']} x {attrs['grid_w']} grid" if "grid_h" in attrs else "patch grid of the model"
    size = attrs.get("img_size", "the input size")
    checklist = Checklist({
        "feature representation": {
            "site": site_text,
            "module": module or "see trace (hook template per site)",
            "input or output": io or "see trace",
            "layer": _layer_text(recipe, int(attrs["num_layers"]) if "num_layers" in attrs else None),
        },
        "gradient target": {
            "scalar": scalar,
            "derivation": how,
            "scores": str(attrs.get("target_scores", "classifier logits" if attrs else "see trace")),
        },
        "token handling": {
            "prefix tokens present": prefix_text,
            "map over": "patch tokens only (prefix tokens have no grid position and are dropped from the map)",
            "weight tokens": weight_tokens,
        },
        "aggregation": {
            "weighting": f"{weighting}: {WEIGHTING_FORMULAS[recipe.weighting]}" if weighting != "not used"
            else "not used",
            "heads": heads_text,
            "relu": ("ReLU applied to the rollout map before normalisation" if recipe.layer_fusion in ROLLOUTS
                     else "ReLU applied to each layer map before normalisation") if recipe.relu == "after"
            else "no ReLU (signed map)",
            "layer fusion": f"{recipe.layer_fusion}: {FUSION_TEXT[recipe.layer_fusion]}",
        },
        "spatial reconstruction": {
            "reshape": f"raster: row-major {grid} from the patch_row/patch_col of each token",
            "upsampling": "none (token grid)" if recipe.upsample == "none" else
            f"{recipe.upsample} to {size} (half-pixel centres, align_corners=False)",
            "normalisation": {"minmax": "min-max to [0, 1] per layer and again after upsampling and fusion",
                              "max": "divided by the maximum per layer and again after fusion",
                              "none": "none (raw values)"}[recipe.normalize],
        },
        "recipe": {"id": recipe.id, "json": recipe.to_json(), "preset": _preset_citation(recipe) or "none"},
    })
    if attrs:
        checklist["model and input"] = {
            "model": f"{attrs.get('model_name', '?')} ({attrs.get('pretrained_tag', '') or 'no tag'})",
            "weights sha256": str(attrs.get("weights_sha256", "?")),
            "input size": str(size),
            "preprocessing": str(attrs.get("preprocessing", "?")),
            "attention backend": "explicit softmax attention (fused_attn=False) so F2 exists",
            "trace id": str(attrs.get("trace_id", "?")),
            "versions": f"vitcam_nb {attrs.get('vitcam_nb_version', '?')}, torch "
                        f"{attrs.get('torch_version', '?')}, timm {attrs.get('timm_version', '?')}",
        }
    return checklist


def describe(recipe: Recipe, trace: Any = None) -> str:
    """Render the recipe as a methods paragraph.

    Example:
        >>> describe(Recipe()).startswith("Heatmaps were computed")
        True
    """
    c = build_checklist(recipe, trace)
    fr, gt, th, ag, sr = (c[k] for k in ("feature representation", "gradient target", "token handling",
                                         "aggregation", "spatial reconstruction"))
    model = ""
    if "model and input" in c:
        mi = c["model and input"]
        model = f" on {mi['model']} (weights sha256 {mi['weights sha256'][:12]}…, input {mi['input size']})"
    where = f"{fr['site']} at {fr['layer']}"
    if fr["module"] and not fr["module"].startswith("see"):
        where += f" (the {fr['input or output']} of {fr['module']})"
    return (
        f"Heatmaps were computed with vitcam_nb recipe {recipe.id}{model}. "
        f"Feature representation: {where}. "
        f"Gradient target: {gt['scalar']}; {gt['derivation']}. "
        f"Token handling: prefix tokens {th['prefix tokens present']}; the map covers {th['map over']}; "
        f"channel weights pooled over: {th['weight tokens']}. "
        f"Aggregation: {ag['weighting']}; heads: {ag['heads']}; {ag['relu']}; layer fusion: {ag['layer fusion']}. "
        f"Spatial reconstruction: {sr['reshape']}; upsampling {sr['upsampling']}; normalisation {sr['normalisation']}."
    )
