"""TokenTM (Wu et al., CVPR 2024) from a single-image trace, with no model call, as the LibraGrad authors' code
computes it: the rollout of each block's mean attention, its key columns weighted by how the attention sublayer
changes every token's length and direction and its entries by the mean ReLU'd attention gradient, followed by the
MLP sublayer's change (see :func:`vitcam_nb.core.presets_tokentm.tokentm` for the formula and its source). It is a
published method (:data:`vitcam_nb.compute.published.METHODS`), computed by its own trace kind so that the
checklist says the blocks are multiplied, not summed.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    >>> tr = vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets="top1", sites=["F2", "resid_pre", "resid_mid", "F6"])
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
from vitcam_nb.core.presets_tokentm import TOKENTM_CITATION, TOKENTM_TITLE
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.weighting import Weighting, register_weighting

__all__ = ["SITES", "TOKENTM", "TokenTMKind", "tokentm", "transformation_weights"]

#: The sites TokenTM reads: the attention and its gradient, and the residual stream before the block, after its
#: attention sublayer and after the block.
SITES = ("F2", "resid_pre", "resid_mid", "F6")
#: Added to the input token's length before dividing, as the LibraGrad code does (``L_E + epsilon``).
LENGTH_EPS = 1e-8
FORMULA = ("map[p] = C[r,p], C = diag(|x_i|), then per block C <- (I + diag(w_mlp)) (I + (mean_h A_h diag(w_attn)) * "
           "mean_h relu(dy/dA_h)) C, w_i = |y_i| / (|u_i| + 1e-8) * softmax_i(cos(u_i, y_i)) for u -> y = "
           "resid_pre -> resid_mid (attention) and resid_mid -> F6 (MLP), x the first block's input, r the attention "
           "rows (TokenTM as LibraGrad's code computes it)")


def transformation_weights(u: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per token, the length ratio ``|y_i| / (|u_i| + 1e-8)`` times ``NECC_i = exp(cos(u_i, y_i)) / sum_j
    exp(cos(u_j, y_j))`` (the softmax of the cosines over the N tokens, summing to 1): how a sublayer changes each
    token, for the change ``u -> y`` of the residual stream across it.

    Example:
        >>> u = np.array([[1.0, 0.0], [0.0, 2.0]])
        >>> transformation_weights(u, 2 * u).round(6).tolist()  # same directions, twice as long: 2 * 1/2 each
        [1.0, 1.0]
    """
    nu, ny = np.linalg.norm(u, axis=-1), np.linalg.norm(y, axis=-1)
    # The cosine as torch.nn.functional.cosine_similarity takes it (each length floored at 1e-8).
    cos = (u * y).sum(-1) / (np.maximum(nu, 1e-8) * np.maximum(ny, 1e-8))
    necc = np.exp(cos - cos.max())  # the max cancels in the ratio; it keeps exp from overflowing
    return ny / (nu + LENGTH_EPS) * (necc / necc.sum())


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
    if recipe.attn_rows not in ("cls", "mean"):
        raise RecipeError(f"attn_rows: tokentm reads the CLS row or the mean row; choose 'cls' or 'mean', got "
                          f"{recipe.attn_rows!r}")
    cls = None  # the mean row
    if recipe.attn_rows == "cls":
        if "cls" not in set(map(str, view.kinds)):
            raise RecipeError("attn_rows='cls': tokentm reads the CLS row of its contribution matrix, but this model "
                              "has no CLS token; use attn_rows='mean' (the mean over all rows) instead")
        cls = view.token_index("cls", "attn_rows")
    order = sorted(set(layer_pos), key=lambda p: int(view.layers[p]))  # a product over blocks in forward order
    pos = {s: view.sites.index(s) for s in SITES if s != "F2"}
    act = view.arrays["act"]
    weights, _ = view.target_weights(recipe)
    grads = combine(view.arrays["attn_grad"], weights, (order,)).astype(np.float64)
    C = np.diag(np.linalg.norm(act[order[0], pos["resid_pre"]].astype(np.float64), axis=-1))
    for i, p in enumerate(order):
        pre, mid, out = (act[p, pos[s]].astype(np.float64) for s in ("resid_pre", "resid_mid", "F6"))
        # Attention: each KEY column j of the head-mean attention scaled by token j's weight, then entry-wise by
        # the head-mean ReLU'd gradient; the identity is the residual path.
        mixed = view.arrays["attn"][p].astype(np.float64).mean(axis=0) * transformation_weights(pre, mid)[None, :]
        C = C + (mixed * np.maximum(grads[i], 0).mean(axis=0)) @ C
        C = C + transformation_weights(mid, out)[:, None] * C  # MLP: I + diag(w_mlp)
    row = C.mean(axis=0) if cls is None else C[cls]
    return row[view.patch]


def _refuse(*_args: Any, **_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    raise RecipeError("weighting: tokentm multiplies several sites across blocks and is computed on single-image "
                      "traces of one token grid (vc.trace of a ViT-like model) only")


METHODS["tokentm"] = (tokentm, FORMULA, TOKENTM_TITLE)
CITATION_OF["tokentm"] = TOKENTM_CITATION
register_weighting(Weighting("tokentm", FORMULA, _refuse, title=TOKENTM_TITLE, method=True),
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
# Lookup priority: before flat: a method recipe on a flat trace.
TRACE_KINDS.register(TOKENTM.name, TOKENTM, replace=True, priority=40)
