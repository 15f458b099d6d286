"""The space of recipes a description allows: which fields a description leaves open, the documented default
values of each open field, and the canonical recipe of each combination (fields that do not apply to it take
their default; combinations no recipe expresses are skipped and counted).

Default space of a field left open (``space={field: [...]}`` overrides any of them):

========================  ===================================================================================
field                     values
========================  ===================================================================================
site                      every site the trace holds (F1..F6; F2 when the attention matrices were traced)
layer                     every traced block
target                    logit, prob, logprob
class\\_                   top1 (the predicted class; a paper that reports no class shows the prediction)
weight_tokens             patch, all, cls
weighting                 the gradient weightings: gradcam, hirescam, gradcampp, xgradcam, layercam
heads                     channels, mean_then_relu, relu_then_mean, max (F2/F3 only)
attn_rows                 cls, mean, patch_mean (F2 only)
layer_fusion              none (one block per map; open it with ``space`` to fuse every block)
relu                      after, none
normalize                 minmax, max (both put a map on a scale of at most 1; "none" keeps each map's raw
                          scale: pass it in ``space`` and the spread and variance shares mostly measure scale)
reshape                   raster
upsample                  none, bilinear (open: every map is compared on the image grid, see below)
text_tokens               all, cls on a trace with cross-attention (xattn); all otherwise (it applies to xattn)
k                         unset (the channel count of gScore-CAM, a weighting outside the default space)
========================  ===================================================================================

The comparison grid. While ``upsample`` takes one value (reported, or one value in ``space``) the maps are
compared on the token grid, where upsampling adds nothing. While it is open, every map is computed at the image
resolution as :func:`vitcam_nb.cam` gives it, and ``"none"`` means the token grid shown as blocks (each token
repeated over its patch, nearest-neighbour). On an integer patch grid ``"none"`` and ``"nearest"`` therefore give
the same picture: a finding (the two readings of an unstated upsampling agree), not a duplicate to remove. An
image over 64 x 64 px is compared on its own pixels at a stride (every 4th pixel of a 224 px image, 4 per side of
a 16 px patch: :func:`vitcam_nb.evaluate.ambiguity.grid.image_sample`), which bounds the cost of thousands of maps.
A generative VLM's answer trace opens the LM sites, the LM's layers and the answer tokens (and the sequence score)
as well: :mod:`vitcam_nb.evaluate.ambiguity.vlm_space`.
``text_tokens`` is open on cross-attention traces because the published recipes differ exactly there: ALBEF's
visualisation takes the [CLS] text row (:func:`vitcam_nb.presets.albef_itm_gradcam`), a demo that averages over the
words (as BLIP's in LAVIS) reads every text row, which ``"all"`` approximates (A and G averaged before the product).

Example:
    >>> open_fields({"site": "F1", "layer": -1})[:3]
    ['target', 'class_', 'weight_tokens']
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vitcam_nb.compute.vlm import VLM_SITES
from vitcam_nb.core.card_schema import CARD_FIELDS
from vitcam_nb.core.errors import ArgumentError, RecipeError
from vitcam_nb.core.recipe import ATTN_ROWS, HEAD_RULES, HEAD_SITES, RELUS, TARGETS, WEIGHT_TOKENS, Recipe
from vitcam_nb.core.weighting import WEIGHTINGS

__all__ = ["CATEGORY_FIELDS", "DEFAULT_SPACE", "OPEN", "canonical", "default_space", "design_bytes",
           "enumerate_cells", "open_fields", "parse_reported"]

#: The value that marks a field (or a whole checklist category) as left open in ``reported``.
OPEN = "open"

#: The checklist category each recipe field is reported in (the paper card's fields: one table for both).
CATEGORY_FIELDS = CARD_FIELDS

#: Default values of the open fields that do not depend on the trace (site and layer do: see the table).
DEFAULT_SPACE: dict[str, tuple] = {
    "target": TARGETS,
    "class_": ("top1",),
    "weight_tokens": WEIGHT_TOKENS,
    "weighting": ("gradcam", "hirescam", "gradcampp", "xgradcam", "layercam"),
    "heads": HEAD_RULES,
    "attn_rows": ATTN_ROWS,
    "layer_fusion": ("none",),
    "relu": RELUS,
    "normalize": ("minmax", "max"),
    "reshape": ("raster",),
    "upsample": ("none", "bilinear"),
    "text_tokens": ("all", "cls"),
    "k": (None,),
}
_FIELDS = [f.name for f in dataclasses.fields(Recipe)]
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Recipe)}


def parse_reported(reported: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """Split a description into the fields it fixes (field -> value) and the fields it leaves open explicitly
    (a field or a whole checklist category given the value ``"open"``).

    Example:
        >>> parse_reported({"site": "F1", "aggregation": "open"})
        ({'site': 'F1'}, ['weighting', 'heads', 'layer_fusion', 'relu', 'k'])
    """
    fixed, opened = {}, []
    for key, value in dict(reported or {}).items():
        if key in CATEGORY_FIELDS:
            if value != OPEN:
                raise ArgumentError(f"reported: a checklist category ({key!r}) can only be left open, with the value "
                                    f"{OPEN!r}; name its fields {list(CATEGORY_FIELDS[key])} to report them")
            opened += list(CATEGORY_FIELDS[key])
        elif key in _FIELDS:
            if isinstance(value, str) and value == OPEN:
                opened.append(key)
            else:
                fixed[key] = value
        else:
            raise ArgumentError(f"reported: unknown key {key!r}; use recipe fields {_FIELDS} or checklist categories "
                                f"{list(CATEGORY_FIELDS)}")
    return fixed, opened


def open_fields(fixed: Mapping[str, Any]) -> list[str]:
    """The recipe fields a description does not fix, in the recipe's order.

    Example:
        >>> "site" in open_fields({"layer": -1}), "layer" in open_fields({"layer": -1})
        (True, False)
    """
    return [f for f in _FIELDS if f not in fixed]


def default_space(field: str, sites: Sequence[str], layers: Sequence[int]) -> tuple:
    """The documented default values of an open field on a trace with ``sites`` and ``layers``.

    Example:
        >>> default_space("layer", ["F1"], [0, 1]), default_space("target", ["F1"], [0, 1])
        ((0, 1), ('logit', 'prob', 'logprob'))
    """
    if field == "site":
        return tuple(sites)
    if field == "layer":
        return tuple(int(v) for v in layers)
    if field == "text_tokens" and "xattn" not in sites:
        return ("all",)  # off cross-attention the field does not apply: a second value would only repeat cells
    return DEFAULT_SPACE[field]


def canonical(choice: Mapping[str, Any], keep: Sequence[str] = ()) -> tuple | None:
    """The recipe a combination of field values means, as a hashable tuple of values in field order: fields
    that do not apply take their default (heads off F2/F3 or with a weighting that projects all channels,
    attn_rows off F2, weight_tokens with a per-token weighting or at a VLM's LM sites, text_tokens off xattn, the
    layer of the projector (it has one) and of a fused recipe: every block; a rollout's weighting, heads and
    target; TAM's weighting, target and layer at ``lm_logit``). Fields in ``keep`` (those the description
    states) are never changed: a combination that contradicts them is no recipe. None if no recipe expresses it.

    Example:
        >>> canonical({**Recipe().to_dict(), "heads": "max"}) == canonical(Recipe().to_dict())
        True
    """
    c = {**_DEFAULTS, **{k: tuple(v) if isinstance(v, list) else v for k, v in choice.items()}}
    stated = {f: c[f] for f in keep if f in c}
    weighting = WEIGHTINGS.get(c["weighting"]) if c["weighting"] in WEIGHTINGS.names() else None
    if c["layer_fusion"] in ("rollout", "grad_rollout"):
        c.update(weighting="gradcam", heads="channels", weight_tokens="patch")
        if c["layer_fusion"] == "rollout":
            c.update(target="logit")
        weighting = WEIGHTINGS.get("gradcam")
    if c["layer_fusion"] != "none":
        c["layer"] = "all"
    if c["site"] not in HEAD_SITES or (weighting is not None and weighting.all_channels):
        c["heads"] = "channels"
    if c["site"] != "F2":
        c["attn_rows"] = "cls"
    if weighting is not None and not weighting.pools_tokens:
        c["weight_tokens"] = "patch"
    if c["site"] != "xattn":
        c["text_tokens"] = "all"
    if c["site"] in VLM_SITES:  # image tokens only: no class token to weight or to leave out
        c["weight_tokens"] = "patch"
    if c["site"] == "projector" and c["layer_fusion"] == "none":  # one layer: the layer is no choice
        c["layer"] = _DEFAULTS["layer"]
    if c["site"] == "lm_logit":  # TAM: a fixed method on the LM head's logits of the last layer, no gradient
        if c["layer_fusion"] != "none":
            return None
        c.update(weighting="tam", target="logit", layer=-1, heads="channels", weight_tokens="patch")
    if any(c[f] != v for f, v in stated.items()):
        return None
    key = tuple(c[f] for f in _FIELDS)
    try:
        return key if _valid(key) else None
    except TypeError:  # an unhashable value (a dict) is no recipe value
        return None


@functools.lru_cache(maxsize=65536)
def _valid(key: tuple) -> bool:
    # Many combinations share a canonical recipe: validate each once.
    try:
        Recipe(**dict(zip(_FIELDS, key)))
    except RecipeError:
        return False
    return True


def enumerate_cells(space: Mapping[str, Sequence], max_cells: int, n_samples: int, seed: int
                    ) -> tuple[np.ndarray, str]:
    """The cells of the factorial over ``space`` (field -> values) as level codes (cells, fields): all of them
    when there are at most ``max_cells``, else ``n_samples`` drawn uniformly with replacement from
    ``numpy.random.default_rng(seed)``; and a sentence that states the design.

    Example:
        >>> cells, design = enumerate_cells({"a": [1, 2], "b": [1, 2, 3]}, 100, 10, 0)
        >>> cells.shape, design
        ((6, 2), 'exact: the full factorial of 6 combinations')
    """
    sizes = [len(v) for v in space.values()]
    total = math.prod(sizes)  # a Python int: numpy's int64 product wraps (4 x 65,536 values gave 0)
    if total <= max_cells:
        cells = np.array(list(itertools.product(*(range(n) for n in sizes))), dtype=np.int64).reshape(total, -1)
        return cells, f"exact: the full factorial of {total} combinations"
    rng = np.random.default_rng(seed)
    cells = np.stack([rng.integers(0, n, n_samples) for n in sizes], axis=1)
    return cells, (f"sampled: {n_samples} of the {total} combinations drawn uniformly with replacement "
                   f"(seed {seed}); 95 % bootstrap confidence intervals")


def design_bytes(sizes: Mapping[str, int], max_cells: int, max_recipes: int, n_samples: int, n_boot: int,
                 pixels: int, mask_pixels: int = 0) -> int:
    """An upper bound of the bytes the ambiguity analysis of open fields with ``sizes`` values each holds at once,
    whichever design :func:`enumerate_cells` picks (an exact design whose recipes exceed ``max_recipes`` is redone
    sampled, so both count): per cell its codes, its map on the token grid (``pixels``) and the float64 copies
    the variance shares and the bootstrap make; per factor and category the level indicator (levels x cells);
    per recipe its map, the Spearman matrix and the upsampled map against a mask of ``mask_pixels``.

    Example:
        >>> design_bytes({"a": 2, "b": 3}, 100, 10, 50, 10, 196) < 10**7
        True
    """
    total = math.prod(sizes.values())
    designs = [(n_samples, n_samples, n_boot)]
    if total <= max_cells:
        designs.append((total, min(total, max_recipes), 0))
    groups = [[sizes[f] for f in fields if f in sizes] for fields in CATEGORY_FIELDS.values()]
    levels = [[n] for n in sizes.values()] + [g for g in groups if g]

    def need(cells: int, recipes: int, boot: int) -> int:
        indicator = sum(min(math.prod(g), cells) for g in levels) * cells * 8
        per_cell = pixels * 4 + pixels * 8 * (4 if boot else 2) + len(sizes) * 24 + 400
        per_recipe = pixels * 12 + recipes * 16 + mask_pixels * 12 + 400
        return cells * per_cell + indicator * (2 if boot else 1) + recipes * per_recipe + boot * len(levels) * 40

    return max(need(*d) for d in designs)
