"""The recipe: one fully specified Grad-CAM-for-ViT variant. A :class:`Recipe` names every choice of the
taxonomy, validates it, and has a canonical JSON form and a stable id (docs/architecture.md, "Recipes and
formulas").

Example:
    >>> r = Recipe(site="F4", layer=-2)
    >>> r.replace(weighting="layercam").weighting
    'layercam'
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from vitcam_nb.core.errors import ArgumentTypeError, RecipeError
from vitcam_nb.core.kinds import kind_for
from vitcam_nb.core.recipe_canonical import canonical_form, resolve_class, resolve_tokens
from vitcam_nb.core.recipe_text import parse_fields, to_string
from vitcam_nb.core.schema import HEAD_SITES, SITES, TOKEN_SITES
from vitcam_nb.core.weighting import WEIGHTINGS, weighting_names

if TYPE_CHECKING:
    from vitcam_nb.core.checklist import Checklist

__all__ = ["ATTN_ROWS", "HEAD_RULES", "HEAD_SITES", "INTEGRATED_ROLLOUTS", "LATER_FIELDS", "LAYER_FUSIONS",
           "NORMALIZES", "RELUS", "RESHAPES", "ROLLOUTS", "SITES", "STAGE_BLOCK", "TARGETS", "TOKEN_SITES", "UPSAMPLES",
           "WEIGHT_TOKENS",
           "Recipe", "is_int", "pooled_weightings", "recipe_arguments", "weighting_names"]

TARGETS = ("logit", "prob", "logprob")
WEIGHT_TOKENS = ("patch", "all", "cls")
RESHAPES = ("raster",)
UPSAMPLES = ("bilinear", "bicubic", "nearest", "none")
HEAD_RULES = ("channels", "mean_then_relu", "relu_then_mean", "max")
ATTN_ROWS = ("cls", "mean", "patch_mean")
LAYER_FUSIONS = ("none", "mean", "sum", "max", "rollout", "grad_rollout", "transition", "bt_head", "bt_token")
RELUS = ("after", "none")
NORMALIZES = ("minmax", "max", "none")

# The last three multiply the rollout by the integrated gradient of the last attention (stored by vc.score).
INTEGRATED_ROLLOUTS = ("transition", "bt_head", "bt_token")
ROLLOUTS = ("rollout", "grad_rollout", *INTEGRATED_ROLLOUTS)
# Fields added after 0.1.0: left out of the canonical JSON while at their default, so older ids stay valid.
LATER_FIELDS = ("text_tokens", "k")
# A Swin-style block address "stage.block" (block may be negative, counted from the end of the stage).
STAGE_BLOCK = re.compile(r"([0-9]+)\.(-?[0-9]+)")

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
    weighting: channel aggregation formula, a name registered in ``vitcam_nb.core.weighting.WEIGHTINGS``
        (gradcam, hirescam, gradcam_elementwise, gradcampp, xgradcam, layercam, eigencam, eigengradcam,
        gradient; the formulas are in the checklist and in ``vitcam_nb.compute.kernels``).
    heads: head aggregation on F2/F3: "channels", "mean_then_relu", "relu_then_mean", "max" or a head index.
    attn_rows: F2 query rows: "cls", "mean", "patch_mean".
    layer_fusion: "none", "mean", "sum", "max", "rollout", "grad_rollout"; "transition" (TAM), "bt_head",
        "bt_token" (Beyond Intuition) read the integrated gradients ``vc.score`` stores.
    relu: "after" (ReLU on each layer map) or "none".
    normalize: "minmax", "max" or "none".
    text_tokens: site "xattn" only: text query rows, "all" (mean over the text tokens), "cls" (the first,
        [CLS]/[ENC] token), a token position, or a word (every token whose text equals it).
    k: weighting "gscorecam" only (and required there): Score-CAM on the k channels with the largest
        gradient weight; None otherwise. Left out of the id while None, so older ids are unchanged.
"""


def _choice(field: str, value: Any, allowed: tuple) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise RecipeError(f"{field}: got {value!r}; allowed values are {list(allowed)}")


def is_int(value: Any) -> bool:
    """An integer that is not a bool (numpy integers count).

    Example:
        >>> is_int(3), is_int(True), is_int(np.int64(2))
        (True, False, True)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def pooled_weightings() -> tuple[str, ...]:
    """Weightings whose channel weights pool gradients over tokens, so that ``weight_tokens`` matters.

    Example:
        >>> pooled_weightings()
        ('gradcam', 'gradcampp', 'xgradcam')
    """
    return tuple(w.name for w in WEIGHTINGS.values() if w.pools_tokens)


def _plain_int(value: Any) -> Any:
    """numpy integers (e.g. from ``tr.layer.values``) become Python ints so the JSON stays canonical."""
    return int(value) if is_int(value) else value


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
    k: int | None = None

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
        object.__setattr__(self, "k", _plain_int(self.k))
        if self.k is not None and (not is_int(self.k) or self.k < 1):
            raise RecipeError(f"k: expected None or an int >= 1 (channels kept by gscorecam), got {self.k!r}")
        _choice("site", self.site, SITES)

        def canonical(v: Any) -> Any:  # "01.0" and "1.0" name the same block, so they get one id
            m = STAGE_BLOCK.fullmatch(v) if isinstance(v, str) else None
            return f"{int(m.group(1))}.{int(m.group(2))}" if m else v
        layer = tuple(canonical(v) for v in layer) if isinstance(layer, tuple) else canonical(layer)
        object.__setattr__(self, "layer", layer)

        def one_layer(v: Any) -> bool:
            return is_int(v) or (isinstance(v, str) and STAGE_BLOCK.fullmatch(v) is not None)
        if isinstance(layer, tuple):
            if not layer or not all(one_layer(v) for v in layer) or len(set(layer)) != len(layer):
                raise RecipeError(f"layer: a tuple must hold distinct ints or 'stage.block' strings, got {layer!r}")
            if len({is_int(v) for v in layer}) > 1:  # an index counts all blocks, "s.b" within a stage: not one list
                raise RecipeError(f"layer: a tuple must hold block indices or 'stage.block' addresses, not both, "
                                  f"got {layer!r}")
        elif not (one_layer(layer) or layer == "all"):
            raise RecipeError(f"layer: expected an int (negative from the end), 'stage.block' (e.g. '2.-1'), "
                              f"a tuple of these or 'all', got {layer!r}")
        if is_int(self.text_tokens):
            if self.text_tokens < 0:
                raise RecipeError(f"text_tokens: got {self.text_tokens}; a token position must be >= 0")
        elif not isinstance(self.text_tokens, str) or not self.text_tokens.strip():
            raise RecipeError(f"text_tokens: got {self.text_tokens!r}; expected 'all', 'cls', a token position "
                              "or a word")
        _choice("target", self.target, TARGETS)
        if is_int(self.class_):
            if self.class_ < 0:
                raise RecipeError(f"class_: got {self.class_}; expected a class index >= 0 or 'topN'")
        elif not (isinstance(self.class_, str) and re.fullmatch(r"top[1-9]\d*", self.class_)):
            raise RecipeError(f"class_: got {self.class_!r}; expected a class index or 'top1', 'top2', ...")
        _choice("weight_tokens", self.weight_tokens, WEIGHT_TOKENS)
        _choice("reshape", self.reshape, RESHAPES)
        _choice("upsample", self.upsample, UPSAMPLES)
        _choice("weighting", self.weighting, weighting_names())
        if is_int(self.heads):
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
        weighting = WEIGHTINGS.get(self.weighting)
        if self.weight_tokens != "patch" and not weighting.pools_tokens:
            raise RecipeError(f"weight_tokens: only weightings that pool gradients over tokens "
                              f"{list(pooled_weightings())} use it; {self.weighting} is per token, "
                              "so leave weight_tokens at 'patch'")
        if weighting.scores:
            self._check_scored(weighting.name)
        elif self.k is not None:
            raise RecipeError(f"k: only weighting 'gscorecam' keeps the top-k channels; {self.weighting} uses "
                              "every channel, so leave k at None")
        if weighting.all_channels and self.heads != "channels":
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
            if self.layer_fusion in INTEGRATED_ROLLOUTS and self.target != "logit":
                raise RecipeError(f"target: {self.layer_fusion} integrates the gradient of the logit along the path "
                                  "alpha * x; prob and logprob are not derivable from it. Use target='logit'")

    def _check_scored(self, name: str) -> None:
        """A weighting read from vc.score's stored model outputs: token sites, the logit, no rollout."""
        if self.site not in TOKEN_SITES:
            raise RecipeError(f"site: {name} scores the channels of a token site {list(TOKEN_SITES)}, not "
                              f"{self.site!r}")
        scored = WEIGHTINGS.get(name).scored_target
        if scored != "logit" and self.target != scored:  # logits (with their logsumexp) give every target
            raise RecipeError(f"target: {name} scores perturbed inputs by {scored!r}; use target={scored!r}")
        if name == "gscorecam" and self.target != "logit":
            raise RecipeError("target: gscorecam ranks channels by the gradient of the logit z_c; use "
                              "target='logit' (scorecam and ablationcam also take 'prob' and 'logprob')")
        if name == "gscorecam" and self.k is None:
            raise RecipeError("k: gscorecam keeps the top-k channels by gradient; set k (e.g. k=300 as in "
                              "Chen et al. 2022, at most the channels of the site)")
        if name != "gscorecam" and self.k is not None:
            raise RecipeError(f"k: only weighting 'gscorecam' keeps the top-k channels; {name} scores every "
                              "channel, so leave k at None")

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

    def to_string(self) -> str:
        """The canonical one-line spelling: every field stated, in a fixed order; :meth:`parse` reads it back.

        Example:
            >>> r = Recipe(site="F4", layer=2, weighting="layercam")
            >>> r.to_string().split()[0], Recipe.parse(r.to_string()) == r
            ('F4@2', True)
        """
        return to_string(self)

    @classmethod
    def parse(cls, text: str) -> Recipe:
        """The recipe a line of text names: the canonical :meth:`to_string` form, or a shorter hand-written one
        (fields in any order, missing ones at their defaults, a value of one field only without its key).

        Example:
            >>> Recipe.parse("F1@11 logit gradcam") == Recipe(site="F1", layer=11)
            True
        """
        choices = {"target": TARGETS, "weight_tokens": WEIGHT_TOKENS, "reshape": RESHAPES, "upsample": UPSAMPLES,
                   "weighting": weighting_names(), "heads": HEAD_RULES, "attn_rows": ATTN_ROWS,
                   "layer_fusion": LAYER_FUSIONS, "relu": RELUS, "normalize": NORMALIZES}
        if isinstance(text, str) and any(c.isdecimal() and not c.isascii() for c in text):
            raise RecipeError(f"text: {text!r} holds digits other than 0-9; write layers and indices in ASCII digits")
        return cls(**parse_fields(text, choices))

    def resolve(self, trace: Any) -> Recipe:
        """This recipe in its canonical form on ``trace``: every layer an absolute block (``layer=-1`` on a 6-block
        model is 5, ``"all"`` the blocks the trace holds), block tuples sorted, one block unfused
        ``class_="topK"`` the class the trace ranks K-th where that is one class for the whole trace
        (:mod:`vitcam_nb.core.recipe_canonical` says why each is the same map); layers the trace does not hold are
        refused. ``id`` itself hashes the recipe as written (a 0.1 contract).

        Example:
            >>> import timm, numpy as np, vitcam_nb as vc
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3)
            >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1")
            >>> Recipe(layer=-1).resolve(tr).layer, Recipe(layer="all", layer_fusion="mean").resolve(tr).layer
            (2, (0, 1, 2))
        """
        if not isinstance(trace, (xr.Dataset, xr.DataTree)):
            raise ArgumentTypeError(f"trace: expected a trace (xarray.Dataset from vitcam_nb.trace()), got "
                                    f"{type(trace).__name__}")
        return resolve_tokens(resolve_class(canonical_form(kind_for(trace, self).resolve(trace, self)), trace), trace)

    def canonical_id(self, trace: Any) -> str:
        """The id of :meth:`resolve` (trace): one id for every spelling of the same map on that trace. The map is
        computed once and dropped, so that a recipe ``vc.cam`` refuses on this trace is refused with its error.

        Example:
            >>> import timm, numpy as np, vitcam_nb as vc
            >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3)
            >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1")
            >>> Recipe(layer=(-1, 0), layer_fusion="mean").canonical_id(tr) == Recipe(layer=(0, 2),
            ...                                                                  layer_fusion="mean").canonical_id(tr)
            True
            >>> Recipe().canonical_id(tr) == Recipe(layer=2, class_=int(tr.logits.argmax())).id  # top1: that class
            True
        """
        if isinstance(trace, (xr.Dataset, xr.DataTree)) and "image" not in trace.sizes:  # a store: layers checked
            kind_for(trace, self).compute(trace, self)  # compute warns of nothing (TraceKind.compute)
        return self.resolve(trace).id

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

        It is the checklist the recipe's map on ``trace`` carries (``vc.cam(trace, r).attrs["checklist"]``):
        the trace's kind renders it.

        Example:
            >>> list(Recipe().checklist())[:2]
            ['feature representation', 'gradient target']
        """
        return kind_for(_reportable(trace), self).checklist(self, trace)

    def describe(self, trace: Any = None) -> str:
        """A methods paragraph that a paper can paste.

        Example:
            >>> "F1" in Recipe().describe()
            True
        """
        return kind_for(_reportable(trace), self).describe(self, trace)


def recipe_arguments(recipe: Recipe | None, grid: bool, fields: Mapping[str, Any]) -> Recipe:
    """The recipe a ``vc.cam``-style call means: ``recipe`` (or one built from ``fields``), changed by
    ``fields``, on the token grid (``upsample="none"``) when ``grid``.

    Example:
        >>> recipe_arguments(None, True, {"site": "F4"}).upsample
        'none'
    """
    if recipe is None:
        recipe = Recipe.from_dict(fields)
    elif not isinstance(recipe, Recipe):
        raise ArgumentTypeError(f"recipe: expected a vitcam_nb.Recipe, got {type(recipe).__name__}")
    elif fields:
        recipe = recipe.replace(**fields)
    if not isinstance(grid, bool):
        raise ArgumentTypeError(f"grid: expected True or False, got {grid!r}")
    return recipe.replace(upsample="none") if grid and recipe.upsample != "none" else recipe


def _reportable(trace: Any) -> xr.Dataset | xr.DataTree | None:
    # Any object may be described (its attrs are read when it has some); only xarray traces pick a kind.
    return trace if isinstance(trace, (xr.Dataset, xr.DataTree)) else None


