"""The relevance read-outs of the backward-rule presets (``cp_lrp``, ``attnlrp``, ``libragrad``): input x the
rule's modified gradient at the hidden state entering a block (site ``resid_pre``; block 0: the patch embedding
with position embedding and prefix tokens), summed over channels, per patch token. They are published methods of
the "published" trace kind (:mod:`vitcam_nb.compute.published`), registered here, and each refuses a trace that
was not traced with its rule.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1).eval()
    >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1", sites=["resid_pre"], rule="attnlrp")
    >>> vc.cam(tr, vc.presets.attnlrp(), grid=True).shape
    (4, 4)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.pipeline import combine
from vitcam_nb.compute.published import CITATION_OF, METHODS
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.presets_rules import RULE_PRESET_CITATIONS
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.rules import DEFAULT_RULE
from vitcam_nb.core.weighting import Weighting, register_weighting

__all__ = ["RELEVANCE_FORMULA", "input_relevance"]

RELEVANCE_FORMULA = ("map[p] = sum over the listed blocks l of sum_k h_l[p,k] R_l[p,k], h_l the hidden state entering "
                     "block l (resid_pre) and R_l its gradient under backward rule {rule} (input x modified gradient)")
TITLES = {"cp_lrp": "CP-LRP", "attnlrp": "AttnLRP", "libragrad": "LibraGrad (input x gradient read-out)"}


def input_relevance(rule: str) -> Callable[[TraceView, xr.Dataset, Recipe, list[int]], np.ndarray]:
    """The read-out of ``rule``: per patch token, ``sum_k h[p,k] dh[p,k]`` at ``resid_pre`` summed over the listed
    blocks, from a trace made with ``rule`` (any other is refused naming the rule it needs).

    Example:
        >>> input_relevance("cp_lrp").__name__
        'cp_lrp_relevance'
    """

    def method(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
        have = str(trace.attrs.get("backward_rule", DEFAULT_RULE))
        if have != rule:
            raise RecipeError(f"weighting: {rule} reads relevance under backward rule {rule!r}, but this trace was "
                              f"made with rule {have!r}; trace again with vc.trace(model, image, rule={rule!r}, "
                              "sites=[..., 'resid_pre'])")
        if "resid_pre" not in view.sites:
            raise RecipeError(f"weighting: {rule} reads site resid_pre, which this trace does not hold; trace again "
                              "with sites=[..., 'resid_pre']")
        si = view.sites.index("resid_pre")
        weights, _ = view.target_weights(recipe)
        h = view.arrays["act"][layer_pos, si].astype(np.float64)
        dh = combine(view.arrays["grad"], weights, (layer_pos, si)).astype(np.float64)
        return (h * dh).sum(-1).sum(0)[view.patch]

    method.__name__ = f"{rule}_relevance"
    return method


def _refuse(*_args: Any, **_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    raise RecipeError("weighting: a relevance read-out is computed on single-image traces of one token grid "
                      "(vc.trace of a timm ViT with a backward rule) only")


for _rule, _title in TITLES.items():
    METHODS[_rule] = (input_relevance(_rule), RELEVANCE_FORMULA.format(rule=_rule), _title)
    CITATION_OF[_rule] = RULE_PRESET_CITATIONS[_rule]
    register_weighting(Weighting(_rule, RELEVANCE_FORMULA.format(rule=_rule), _refuse, title=_title, method=True),
                       replace=True)
