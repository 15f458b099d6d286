"""TokenTM (Wu et al., CVPR 2024) as a preset: attention rollout weighted by how each block's sublayers change
the tokens' length and direction, read from a plain trace (no extra pass). Importing this module adds it to
:data:`~vitcam_nb.core.presets.PRESETS` and its source to ``CITATIONS``; :mod:`vitcam_nb.compute.tokentm`
computes it.

The formula is TokenTM as the LibraGrad authors' public code computes it (``transform_TokenTM`` in
github.com/NightMachinery/decompv-libragrad-v1, ``decompv/x/ds/utils.py``, the TokenTM baseline of Mehri et al.,
CVPR 2025); TokenTM's own code was not found. Of the paper only its abstract (and third-party summaries of it)
could be read here: they state what the code does (token lengths by the L2 norm, directions by the cosine,
normalised exponentially; a contribution matrix initialised with the tokens' lengths on its diagonal and updated
block by block with the attention and the transformation weights), not its equations, so the equations below are
that code's, and where it departs from the paper's text is not known. Every quantity it reads is in a plain trace.

Example:
    >>> tokentm().weighting, tokentm().site
    ('tokentm', 'F2')
"""

from __future__ import annotations

from vitcam_nb.core.preset_registry import register_preset
from vitcam_nb.core.recipe import Recipe

__all__ = ["TOKENTM_CITATION", "TOKENTM_TITLE", "tokentm"]

#: Where the method comes from (also added to ``CITATIONS``).
TOKENTM_CITATION = (
    "after Wu, Duan, Kang, Tang & Yan 2024, Token Transformation Matters: Towards Faithful Post-hoc Explanation "
    "for Vision Transformer, CVPR (arXiv:2403.14552); the formula as the LibraGrad authors' code computes it "
    "(Mehri, Soleymani Baghshah & Pilehvar 2025, CVPR: github.com/NightMachinery/decompv-libragrad-v1, "
    "decompv/x/ds/utils.py, transform_TokenTM); TokenTM's official code and the paper's equations were not "
    "available to us, only its abstract")
#: The method's name in every map's checklist: it says whose formula the map is.
TOKENTM_TITLE = "TokenTM (as LibraGrad's code computes it)"


@register_preset(TOKENTM_CITATION)
def tokentm(layer: int | tuple | str = "all", attn_rows: str = "cls") -> Recipe:
    """TokenTM after Wu et al. 2024, as the LibraGrad authors' code computes it, from one trace (sites F2,
    resid_pre, resid_mid, F6). Per token i and sublayer, the transformation weight
    ``w_i = |y_i| / (|u_i| + 1e-8) * NECC_i`` of the residual stream's change ``u -> y`` across it (attention:
    ``resid_pre -> resid_mid``; MLP: ``resid_mid -> F6``), where ``NECC_i = exp(cos(u_i, y_i)) / sum_j
    exp(cos(u_j, y_j))`` (the softmax of the cosines over the N tokens). The contribution matrix starts as
    ``C = diag(|x_i|)`` (x: the first block's input) and each block updates it in forward order:
    ``C <- (I + (Abar diag(w_attn)) * Gbar) C``, then ``C <- (I + diag(w_mlp)) C``, with ``Abar = mean_h A_h``
    (each key column j scaled by token j's weight), ``Gbar = mean_h relu(dy/dA_h)`` (recipe's target) and ``*``
    entry-wise. The map is ``C`` at the CLS row (``attn_rows="mean"``: the mean row), patch columns, min-max.

    Example:
        >>> tokentm().layer, tokentm(layer=(-2, -1)).layer
        ('all', (-2, -1))
    """
    return Recipe(site="F2", layer=layer, weighting="tokentm", attn_rows=attn_rows, layer_fusion="sum",
                  relu="none", normalize="minmax")

