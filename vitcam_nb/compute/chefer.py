"""Transformer Attribution (Chefer, Gur & Wolf, CVPR 2021) from one ``chefer_lrp`` trace, with no model call.

A trace made with ``rule="chefer_lrp"`` and site ``F2`` holds, per target and block, the LRP relevance ``R_A`` of
the attention map (its ``attn_grad``: under that rule the stored "gradient" is the relevance, started from the
one-hot of the class as the official code starts it) and the plain gradient ``dA`` of the class logit at the
same map (``attn_plain_grad``, from a second batched backward of the same pass). Per block,
``Abar = mean over heads of relu(dA * R_A)``; the rollout starts from the identity, ``R = I`` and
``R = R + Abar @ R`` for each listed block from the first up (the official ``start_layer``; default: every block);
the map is the class token's row of ``R`` over the patch columns. The method is a published method of the
"published" trace kind (:mod:`vitcam_nb.compute.published`), with its own checklist lines.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1", sites=["F2"], rule="chefer_lrp")
    >>> vc.cam(tr, vc.presets.transformer_attribution(), grid=True).shape
    (4, 4)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.published import CITATION_OF, METHODS, PublishedKind
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.kinds import TRACE_KINDS
from vitcam_nb.core.presets_rules import RULE_PRESET_CITATIONS
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.rules import DEFAULT_RULE
from vitcam_nb.core.weighting import Weighting, register_weighting

__all__ = ["TRANSFORMER_ATTRIBUTION_FORMULA", "transformer_attribution_map"]

NAME = "transformer_attribution"
RULE = "chefer_lrp"
TRANSFORMER_ATTRIBUTION_FORMULA = (
    "map[p] = R[cls, p], R = (I + Abar_L) ... (I + Abar_s) over the listed blocks s..L (rollout from the identity), "
    "Abar_l = mean over heads of relu(dA_l * R_A_l), R_A_l the LRP relevance of block l's attention under backward "
    "rule chefer_lrp (attn_grad) and dA_l the plain gradient of the class logit there (attn_plain_grad)")


def _check(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int]) -> None:
    have = str(trace.attrs.get("backward_rule", DEFAULT_RULE))
    if have != RULE:
        raise RecipeError(f"weighting: transformer_attribution reads LRP relevance under backward rule {RULE!r}, but "
                          f"this trace was made with rule {have!r}; trace again with vc.trace(model, image, "
                          f"rule={RULE!r}, sites=[..., 'F2'])")
    missing = [n for n in ("attn_grad", "attn_plain_grad") if n not in trace.variables]
    if missing:
        raise RecipeError(f"weighting: transformer_attribution reads {missing}, which this trace does not hold; trace "
                          f"again with vc.trace(model, image, rule={RULE!r}, sites=[..., 'F2'])")
    if recipe.target != "logit":
        raise RecipeError(f"target: transformer_attribution starts its relevance from the one-hot of the class (the "
                          f"logit); {recipe.target!r} is not a relevance this trace holds. Use target='logit'")
    blocks = [int(view.layers[p]) for p in layer_pos]
    last = view.num_layers - 1
    if blocks != list(range(blocks[0], last + 1)):
        raise RecipeError(f"layer: the rollout runs from a start block up to the last block {last} without gaps (the "
                          f"official start_layer); got blocks {blocks}. Trace every block from the start up and use "
                          "layer='all' or a tuple (s, ..., last)")


def transformer_attribution_map(view: TraceView, trace: xr.Dataset, recipe: Recipe,
                                layer_pos: list[int]) -> np.ndarray:
    """The class token's row of the relevance-weighted rollout over the patch keys, from a ``chefer_lrp`` trace.

    Example:
        >>> transformer_attribution_map.__name__
        'transformer_attribution_map'
    """
    _check(view, trace, recipe, layer_pos)
    weights, _ = view.target_weights(recipe)
    (t,) = weights  # target='logit': the class's own position
    relevance = view.arrays["attn_grad"]
    plain = trace["attn_plain_grad"].values
    n = relevance.shape[-1]
    rollout = np.eye(n)
    for p in sorted(layer_pos):
        a_bar = np.maximum(plain[t, p].astype(np.float64) * relevance[t, p].astype(np.float64), 0).mean(axis=0)
        rollout = rollout + a_bar @ rollout
    return rollout[view.token_index("cls", "attn_rows"), view.patch]


class TransformerAttributionKind(PublishedKind):
    """The published kind for ``transformer_attribution``: its checklist states the rollout, not a sum.

    Example:
        >>> import vitcam_nb as vc
        >>> CHEFER.accepts(None, vc.presets.transformer_attribution())
        False
    """

    name = NAME

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        return recipe is not None and recipe.weighting == NAME and super().accepts(trace, recipe)

    def checklist(self, recipe: Recipe, trace: Any) -> Checklist:
        out = super().checklist(recipe, trace)
        out["aggregation"]["heads"] = "mean over heads of relu(dA * R_A), per block"
        out["aggregation"]["layer fusion"] = ("rollout from the identity over the listed blocks, first to last: R = R "
                                              "+ Abar @ R (the official start_layer is the first listed block)")
        return out


def _refuse(*_args: Any, **_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    raise RecipeError("weighting: transformer_attribution is computed on single-image traces of one token grid "
                      "(vc.trace of a timm ViT with rule='chefer_lrp') only")


METHODS[NAME] = (transformer_attribution_map, TRANSFORMER_ATTRIBUTION_FORMULA, "Transformer Attribution")
CITATION_OF[NAME] = RULE_PRESET_CITATIONS[NAME]
register_weighting(Weighting(NAME, TRANSFORMER_ATTRIBUTION_FORMULA, _refuse, title="Transformer Attribution",
                             method=True), replace=True)
CHEFER = TransformerAttributionKind()
# Lookup priority: before flat: a method recipe on a flat trace.
TRACE_KINDS.register(CHEFER.name, CHEFER, replace=True, priority=50)
