"""The token activation map (TAM; Li, Wang, Ding, Wang & Li, "Token Activation Map to Visually Explain Multimodal
LLMs", ICCV 2025, arXiv:2506.23270) as a preset for a generative VLM's answer token. Importing this module adds it
to :data:`~vitcam_nb.core.presets.PRESETS` with its citation and its row of the audit table;
:mod:`vitcam_nb.compute.tam` computes it from a trace's ``lm_logit`` site.

What could be read: the authors' public code (github.com/xmed-lab/TAM @7c7df1d, ``tam.py`` and ``demo.py``: MIT
licence) and the paper's abstract and figure caption (estimated causal inference against the context's
interference, a rank Gaussian filter against activation noise). The paper's method section and its equations could
not be read here (no copy reachable), so the formula is the code's; where the paper's text departs from its code
is not known. Not Transition Attention Maps (``transition_attention_maps``), which shares the acronym.

Example:
    >>> tam().site, tam(token=2).class_
    ('lm_logit', 2)
"""

from __future__ import annotations

from vitcam_nb.core.preset_registry import register_preset
from vitcam_nb.core.recipe import Recipe

__all__ = ["TAM_CITATION", "TAM_TAXONOMY", "TAM_TITLE", "tam"]

#: Where the method comes from (also added to ``CITATIONS``).
TAM_CITATION = ("Li, Wang, Ding, Wang & Li 2025, Token Activation Map to Visually Explain Multimodal LLMs, ICCV "
                "(arXiv:2506.23270); the formula as the authors' code computes it (github.com/xmed-lab/TAM "
                "@7c7df1d, tam.py: TAM, least_squares, rank_guassian_filter, multimodal_process); the paper's "
                "method section was not available to us, only its abstract")
#: The method's name in every map's checklist.
TAM_TITLE = "TAM (token activation map, Li et al. 2025)"
#: The preset's row of the audit table.
TAM_TAXONOMY = {
    "paper": "Li, Wang, Ding, Wang & Li 2025, ICCV (arXiv:2506.23270; method section not read: the code's formula)",
    "code": "https://github.com/xmed-lab/TAM",
    "site": "lm_logit: the LM head's logits of the LM's last hidden state (after its final norm) at the image "
            "tokens and the text context (a logit lens; no gradient)",
    "target": "answer token k's logit (its token id through the LM head), teacher forcing",
    "tokens": "image tokens for the map; the prompt's text after the image and the earlier answer tokens as "
              "context (repeats of the token left out of the interference)",
    "aggregation": "relu(M_k - lambda sum_s w_s M_s), w the context's normalised activations of token k, lambda "
                   "by least squares (estimated causal inference)",
    "reconstruction": "joint min-max with the context's text scores, 3x3 rank Gaussian filter on the image-token "
                      "layout's grid (per tile on a multi-tile layout, never across a seam), bilinear to the "
                      "input; no further normalisation"}


@register_preset(TAM_CITATION, taxonomy=TAM_TAXONOMY)
def tam(token: int = 0) -> Recipe:
    """The token activation map of answer token ``token`` (``class_``), as the authors' code computes it, from a
    trace with site ``lm_logit`` (``vc.trace(vlm, image, targets=vc.targets.answer(...), sites=["lm_logit"])``).

    For answer token k (token id ``c_k``): each context slot s (the prompt's text tokens after the image but its
    last, then the earlier answer tokens, each at the position that predicts it) has the map ``M_s = relu(z_s)``,
    ``z_s`` the LM head's logit of its own token at the image tokens; ``M_k`` is token k's. The interference is
    ``I = sum_s w_s M_s`` over the slots whose token is not ``c_k``, ``w_s = t_s / (sum t + 1e-8)`` with ``t_s =
    relu`` of ``c_k``'s logit at slot s; ``lambda = <M_k, I> / <I, I>`` (least squares) and the corrected map is
    ``relu(M_k - lambda I)``. It is min-maxed together with ``t`` over every context slot, placed on the
    image-token grid, and filtered by the rank Gaussian filter (3x3, reflected borders; each window's values
    sorted and averaged with Gaussian weights over their ranks, sigma the window's std / mean). ``normalize=
    "none"``: the values are the authors' evaluation map divided by 255 (before their uint8 rounding).

    Deliberate differences from the authors' code (each also in the map's checklist): one teacher-forced forward
    instead of generate's rounds; the prompt context is every text token after the image (no chat-template special
    ids); each slot's map is of its own token (their round 0 takes the greedy prediction for the first prompt
    token and, by an off-by-one, the prompt's last token for the first answer token's slot); repeats compared by
    token id, not re-tokenised strings; the least-squares scale in closed form (theirs: scipy's minimize_scalar);
    a constant positive filter window gives its value (theirs: NaN); no uint8 rounding.

    Example:
        >>> tam().weighting, tam().normalize
        ('tam', 'none')
    """
    return Recipe(site="lm_logit", layer=-1, target="logit", class_=token, weighting="tam", relu="none",
                  normalize="none", upsample="bilinear")
