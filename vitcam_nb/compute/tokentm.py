"""TokenTM (after Wu et al., CVPR 2024) from a single-image trace, with no model call: the rollout of the
gradient-weighted attention, each block's update weighted by how its attention and MLP change every token's
length and direction (see :func:`vitcam_nb.core.presets_tokentm.tokentm` for the formula and where it departs from
the paper). It is a published method (:data:`vitcam_nb.compute.published.METHODS`), computed by its own trace kind
so that the checklist says the blocks are multiplied, not summed.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    >>> sites = ["F2", "resid_pre", "attn_out", "resid_mid", "F5"]
    >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1", sites=sites)
    >>> vc.cam(tr, vc.presets.tokentm()).shape
    (32, 32)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

from vitcam_nb.compute.pipeline import combine
from vitcam_nb.compute.published import CITATION_OF, METHODS, PublishedKind
from vitcam_nb.compute.view import TraceView
from vitcam_nb.core.checklist import Checklist
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.kinds import TRACE_KINDS
from vitcam_nb.core.presets_tokentm import TOKENTM_CITATION
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.weighting import Weighting, register_weighting

__all__ = ["SITES", "TOKENTM", "TokenTMKind", "tokentm", "transformation_weights"]

#: The sites TokenTM reads: the attention and its gradient, and the residual stream around each sublayer.
SITES = ("F2", "resid_pre", "attn_out", "resid_mid", "F5")
FORMULA = ("map[p] = C[r,p], C = diag(|x_i|) then per block C <- C + diag(w_attn) Abar C, C <- C + diag(w_mlp) C, "
           "Abar = mean_h relu(dy/dA_h A_h), w_i = |y_i|/|u_i| * N softmax_i(cos(u_i, y_i)) for u -> y = "
           "resid_pre -> attn_out (attention) and resid_mid -> F5 (MLP), x the first block's input, r the "
           "attention rows (TokenTM, vitcam_nb's reading)")


def transformation_weights(u: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per token, the length ratio ``|y_i| / |u_i|`` times ``N exp(cos(u_i, y_i)) / sum_j exp(cos(u_j, y_j))``
    (the normalised exponential of the cosines, mean 1 over the N tokens): how a sublayer changes each token.

    Example:
        >>> u = np.array([[1.0, 0.0], [0.0, 2.0]])
        >>> transformation_weights(u, 2 * u).round(3).tolist()  # same directions, twice as long
        [2.0, 2.0]
    """
    nu, ny = np.linalg.norm(u, axis=-1), np.linalg.norm(y, axis=-1)
    cos = (u * y).sum(-1) / np.maximum(nu * ny, 1e-30)
    necc = np.exp(cos - cos.max())
    return ny / np.maximum(nu, 1e-30) * (len(cos) * necc / necc.sum())


def tokentm(view: TraceView, trace: xr.Dataset, recipe: Recipe, layer_pos: list[int]) -> np.ndarray:
    """The TokenTM map over the patch tokens of ``view`` (see :data:`FORMULA`).

    Example:
        >>> import timm, numpy as np, vitcam_nb as vc
        >>> from vitcam_nb.compute.view import TraceView
        >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
        >>> tr = vc.trace(m.eval(), np.zeros((32, 32, 3), np.uint8), targets="top1", sites=list(SITES))
        >>> tokentm(TraceView.of(tr), tr, vc.presets.tokentm(), [0, 1]).shape  # one value per patch token
        (16,)
    """
    have = set(view.sites)
    missing = [s for s in SITES if s not in have]
    if missing:
        raise RecipeError(f"weighting: tokentm reads sites {list(SITES)}; this trace lacks {missing}; trace again "
                          f"with sites=[..., {', '.join(repr(s) for s in missing)}]")
    order = sorted(set(layer_pos), key=lambda p: int(view.layers[p]))  # a product over blocks in forward order
    pos = {s: view.sites.index(s) for s in SITES if s != "F2"}
    act = view.arrays["act"]
    weights, _ = view.target_weights(recipe)
    grads = combine(view.arrays["attn_grad"], weights, (order,)).astype(np.float64)
    x0 = act[order[0], pos["resid_pre"]].astype(np.float64)
    C = np.diag(np.linalg.norm(x0, axis=-1))
    for i, p in enumerate(order):
        u, y = (act[p, pos[s]].astype(np.float64) for s in ("resid_pre", "attn_out"))
        abar = np.maximum(grads[i] * view.arrays["attn"][p].astype(np.float64), 0).mean(axis=0)
        C = C + transformation_weights(u, y)[:, None] * (abar @ C)
        u, y = (act[p, pos[s]].astype(np.float64) for s in ("resid_mid", "F5"))
        C = C + transformation_weights(u, y)[:, None] * C
    if recipe.attn_rows == "cls":
        row = C[view.token_index("cls", "attn_rows")]
    elif recipe.attn_rows == "mean":
        row = C.mean(axis=0)
    else:
        raise RecipeError(f"attn_rows: tokentm reads the CLS row or the mean row; choose 'cls' or 'mean', got "
                          f"{recipe.attn_rows!r}")
    return row[view.patch]


def _refuse(*_args: Any, **_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    raise RecipeError("weighting: tokentm multiplies several sites across blocks and is computed on single-image "
                      "traces of one token grid (vc.trace of a ViT-like model) only")


METHODS["tokentm"] = (tokentm, FORMULA, "TokenTM (vitcam_nb's reading)")
CITATION_OF["tokentm"] = TOKENTM_CITATION
register_weighting(Weighting("tokentm", FORMULA, _refuse, title="TokenTM (vitcam_nb's reading)", method=True),
                   replace=True)


class TokenTMKind(PublishedKind):
    """The published kind for TokenTM, whose checklist says the blocks are multiplied in forward order.

    Example:
        >>> import vitcam_nb as vc
        >>> TOKENTM.accepts(None, vc.presets.tokentm())
        False
    """

    name = "tokentm"

    def accepts(self, trace: Any, recipe: Recipe | None) -> bool:
        return recipe is not None and recipe.weighting == "tokentm" and super().accepts(trace, recipe)

    def checklist(self, recipe: Recipe, trace: Any) -> Checklist:
        out = super().checklist(recipe, trace)
        out["aggregation"]["layer fusion"] = ("a product over the listed blocks in forward order (a rollout inside "
                                              "the formula; the recipe's layer_fusion is not read); no per-layer "
                                              "ReLU or normalisation")
        return out


TOKENTM = TokenTMKind()
TRACE_KINDS.register(TOKENTM.name, TOKENTM, replace=True, first=True)
