"""TokenTM (Wu et al., CVPR 2024) as a preset: attention rollout weighted by how each block's sublayers change
the tokens' length and direction, read from a plain trace (no extra pass). Importing this module adds it to
:data:`~vitcam_nb.core.presets.PRESETS` and its source to ``CITATIONS``; :mod:`vitcam_nb.compute.tokentm`
computes it.

This is vitcam_nb's reading of the paper, not a copy of its official code (which was not available to us), and
it departs from the paper where a trace does not store what the paper measures: the paper weighs each attention
KEY token by the change the value and output projections make to it (``x_j -> W_O W_V x_j``, per token, before
the attention mixes them); a trace stores the attention sublayer's output after the mixing (``attn_out``), so the
attention's weight here is the change ``resid_pre_i -> attn_out_i`` of each QUERY token. The MLP's per-token
change ``resid_mid_i -> F5_i`` is the paper's quantity.

Example:
    >>> tokentm().weighting, tokentm().site
    ('tokentm', 'F2')
"""

from __future__ import annotations

from vitcam_nb.core.presets import CITATIONS, PRESETS
from vitcam_nb.core.recipe import Recipe

__all__ = ["TOKENTM_CITATION", "tokentm"]

#: Where the method comes from (also added to ``CITATIONS``).
TOKENTM_CITATION = (
    "after Wu, Duan, Kang, Tang & Yan 2024, Token Transformation Matters: Towards Faithful Post-hoc Explanation "
    "for Vision Transformer, CVPR (arXiv:2403.14552; official code not available to us). vitcam_nb's reading from "
    "a plain trace: the attention's transformation weight is measured on each query token (resid_pre -> "
    "attn_out, after the attention mixes the tokens), not on each key token's projected value as the paper does")
CITATIONS["tokentm"] = TOKENTM_CITATION


def tokentm(layer: int | tuple | str = "all", attn_rows: str = "cls") -> Recipe:
    """TokenTM after Wu et al. 2024, as vitcam_nb reads it from one trace (sites F2, resid_pre, attn_out,
    resid_mid, F5). Per token i and sublayer, the transformation weight ``w_i = (|y_i| / |u_i|) * NECC_i`` of the
    change ``u -> y`` (attention: ``resid_pre -> attn_out``; MLP: ``resid_mid -> F5``; both before any layer scale),
    where ``NECC_i = N exp(cos(u_i, y_i)) / sum_j exp(cos(u_j, y_j))`` (the normalised exponential of the cosines,
    mean 1 over the N tokens). The contribution matrix starts as ``C = diag(|x_i|)`` (x: the first block's input) and
    each block updates it in forward order: ``C <- C + diag(w_attn) Abar C``, then ``C <- C + diag(w_mlp) C``,
    ``Abar = mean_h relu(dy/dA_h * A_h)`` (the gradient-weighted attention of Chefer et al. 2021b, recipe's
    target). The map is ``C`` at the CLS row (``attn_rows="mean"``: the mean row), patch columns, min-max.

    Example:
        >>> tokentm().layer, tokentm(layer=(-2, -1)).layer
        ('all', (-2, -1))
    """
    return Recipe(site="F2", layer=layer, weighting="tokentm", attn_rows=attn_rows, layer_fusion="sum",
                  relu="none", normalize="minmax")


PRESETS["tokentm"] = tokentm
