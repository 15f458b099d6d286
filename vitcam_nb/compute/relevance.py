"""The relevance read-outs of the backward-rule presets (``cp_lrp``, ``attnlrp``, ``libragrad``): input x the
rule's modified gradient at the hidden state entering a block (site ``resid_pre``; block 0: the patch embedding
with position embedding and prefix tokens), summed over channels, per patch token. They are published methods of
the "published" trace kind (:mod:`vitcam_nb.compute.published`), registered here, and each refuses a trace that
was not traced with its rule.

``libragrad_fullgrad`` is LibraGrad's own read-out, Libra FullGrad+ (Mehri et al., CVPR 2025, section 2.1: FullGrad+
is the sum over the layers of input x gradient at each layer's input plus, for every bias, bias x its gradient):
per patch token, the sum over the listed blocks of ``h.dh`` at ``resid_pre`` and of the block's bias terms. Each bias
term is read from the trace without the bias values, by the completeness of an affine map: for ``y = W x + b`` with
``dx = W^T dy`` (autograd's own rule on a Linear), ``b.dy = y.dy - x.dx`` per token. Under ``libragrad`` every
sublayer is affine at the evaluated point (attention, LayerNorm's std and GELU's gate held constant), so per block:

- norm1's bias: ``F1.dF1 - x.(dx - dm)`` (x = resid_pre, m = resid_mid: ``dx - dm`` is the gradient x gets
  through norm1 alone), norm2's likewise with ``m`` and the block output ``F6``;
- qkv's biases: ``v.dv - F1.dF1`` (q and k get no gradient: the attention is a constant);
- proj's bias: ``attn_out.d(attn_out) - F3.dF3``; fc1's and fc2's biases together: ``F5.dF5 - F4.dF4``.

``F1`` and ``F4`` cancel in the sum, so the read-out needs the sites resid_pre, resid_mid, F6, v, F3, attn_out and
F5. The final norm's and the head's biases act on the class token only, which is not on the patch grid.

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
from vitcam_nb.core.presets_rules import FULLGRAD_CITATION, RULE_PRESET_CITATIONS
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.rules import DEFAULT_RULE
from vitcam_nb.core.weighting import Weighting, register_weighting

__all__ = ["FULLGRAD_FORMULA", "FULLGRAD_SITES", "RELEVANCE_FORMULA", "input_relevance", "libra_fullgrad"]

RELEVANCE_FORMULA = ("map[p] = sum over the listed blocks l of sum_k h_l[p,k] R_l[p,k], h_l the hidden state entering "
                     "block l (resid_pre) and R_l its gradient under backward rule {rule} (input x modified gradient)")
FULLGRAD = "libragrad_fullgrad"
FULLGRAD_RULE = "libragrad"
#: The sites the Libra FullGrad+ read-out reads at every listed block.
FULLGRAD_SITES = ("resid_pre", "resid_mid", "F6", "v", "F3", "attn_out", "F5")
FULLGRAD_FORMULA = ("map[p] = sum over the listed blocks l of x_l[p].dx_l[p] (x_l = resid_pre) + the block's bias "
                    "terms b.db per token, each read as y.dy - x.dx across its affine sublayer under rule libragrad: "
                    "-x.(dx - dm) + v.dv + attn_out.d(attn_out) - F3.dF3 - m.(dm - dF6) + F5.dF5 (m = resid_mid, "
                    "F1 and F4 cancel); Libra FullGrad+ (Mehri et al. 2025)")
TITLES = {"cp_lrp": "CP-LRP", "attnlrp": "AttnLRP", "libragrad": "LibraGrad (input x gradient read-out)"}


def input_relevance(rule: str) -> Callable[[TraceView, xr.Dataset, Recipe, list[int]], np.ndarray]:
    """The read-out of ``rule``: per patch token, ``sum_k h[p,k] dh[p,k]`` at ``resid_pre`` summed over the listed
    blocks, from a trace made with ``rule`` (any other is refused naming the rule it needs).

    Example:
        >>> input_relevance("cp_lrp").__name__
        'cp_lrp_relevance'
    """

    def method(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
        _check_rule(trace, rule, "'resid_pre'")
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


def _check_rule(trace: xr.Dataset, rule: str, sites: str) -> None:
    have = str(trace.attrs.get("backward_rule", DEFAULT_RULE))
    if have != rule:
        raise RecipeError(f"weighting: {rule} reads relevance under backward rule {rule!r}, but this trace was "
                          f"made with rule {have!r}; trace again with vc.trace(model, image, rule={rule!r}, "
                          f"sites=[..., {sites}])")


def libra_fullgrad(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    """Libra FullGrad+ per patch token: input x gradient at every listed block's input plus the block's bias terms,
    each bias term read as ``y.dy - x.dx`` across its affine sublayer (see the module docstring), from a
    ``libragrad`` trace holding the sites :data:`FULLGRAD_SITES` at those blocks.

    Example:
        >>> libra_fullgrad.__name__
        'libra_fullgrad'
    """
    _check_rule(trace, FULLGRAD_RULE, ", ".join(repr(s) for s in FULLGRAD_SITES))
    missing = [s for s in FULLGRAD_SITES if s not in view.sites]
    if missing:
        raise RecipeError(f"weighting: {FULLGRAD} reads the sites {list(FULLGRAD_SITES)} of every listed block; this "
                          f"trace lacks {missing}. Trace again with vc.trace(model, image, rule={FULLGRAD_RULE!r}, "
                          f"sites={list(FULLGRAD_SITES)}) (a timm ViT with plain attention: the v site)")
    weights, _ = view.target_weights(recipe)

    def act(site: str) -> np.ndarray:
        return view.arrays["act"][layer_pos, view.sites.index(site)].astype(np.float64)

    def grad(site: str) -> np.ndarray:
        return combine(view.arrays["grad"], weights, (layer_pos, view.sites.index(site))).astype(np.float64)

    def ixg(site: str) -> np.ndarray:
        return (act(site) * grad(site)).sum(-1)

    x, m = act("resid_pre"), act("resid_mid")
    dx, dm, dy = grad("resid_pre"), grad("resid_mid"), grad("F6")
    biases = (-(x * (dx - dm)).sum(-1) + ixg("v") + ixg("attn_out") - ixg("F3") - (m * (dm - dy)).sum(-1)
              + ixg("F5"))
    return ((x * dx).sum(-1) + biases).sum(0)[view.patch]


def _refuse(*_args: Any, **_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    raise RecipeError("weighting: a relevance read-out is computed on single-image traces of one token grid "
                      "(vc.trace of a timm ViT with a backward rule) only")


for _rule, _title in TITLES.items():
    METHODS[_rule] = (input_relevance(_rule), RELEVANCE_FORMULA.format(rule=_rule), _title)
    CITATION_OF[_rule] = RULE_PRESET_CITATIONS[_rule]
    register_weighting(Weighting(_rule, RELEVANCE_FORMULA.format(rule=_rule), _refuse, title=_title, method=True),
                       replace=True)
METHODS[FULLGRAD] = (libra_fullgrad, FULLGRAD_FORMULA, "Libra FullGrad+")
CITATION_OF[FULLGRAD] = FULLGRAD_CITATION
register_weighting(Weighting(FULLGRAD, FULLGRAD_FORMULA, _refuse, title="Libra FullGrad+", method=True), replace=True)
