"""The presets of the backward rules (:mod:`vitcam_nb.core.rules`): CP-LRP, AttnLRP and LibraGrad read out as
input x modified gradient at the hidden state entering the first block, summed over channels. Each needs a trace
made with its rule (``vc.trace(model, image, rule=..., sites=[..., "resid_pre"])``); importing this module adds
them to :data:`~vitcam_nb.core.presets.PRESETS` and their sources to ``CITATIONS``.

Example:
    >>> from vitcam_nb.core.presets import get
    >>> get("attnlrp").site, get("attnlrp").weighting
    ('resid_pre', 'attnlrp')
"""

from __future__ import annotations

from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.preset_registry import register_preset
from vitcam_nb.core.presets import CITATIONS
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.rules import LRP_PATENT_NOTE, RULES

__all__ = ["FULLGRAD_CITATION", "RULE_PRESET_CITATIONS", "RULE_TAXONOMY", "attnlrp", "cp_lrp", "libragrad",
           "transformer_attribution"]

#: Where each preset comes from (also added to ``CITATIONS``): its rule's citation and the read-out.
RULE_PRESET_CITATIONS: dict[str, str] = {
    "cp_lrp": RULES["cp_lrp"].citation + "; input x modified gradient at the first block's input",
    "attnlrp": RULES["attnlrp"].citation + "; input x modified gradient at the first block's input",
    "libragrad": RULES["libragrad"].citation + "; read out as input x modified gradient at the first block's input "
                 "(the paper's Libra FullGrad+ read-out, with every block's input and bias terms: "
                 "libragrad(biases=True))",
    "transformer_attribution": RULES["chefer_lrp"].citation + "; Transformer Attribution: per block the mean over "
                               "heads of relu(dA * R_A), rolled out from the identity, CLS row (start_layer 0)",
}
CITATIONS.update(RULE_PRESET_CITATIONS)
#: The source of ``libragrad(biases=True)``'s read-out (weighting ``libragrad_fullgrad``, not a preset of its own).
FULLGRAD_CITATION = (RULES["libragrad"].citation + "; Libra FullGrad+ (section 2.1 of the paper): input x gradient at "
                     "every block's input plus every bias x its gradient, summed per token")

_SITE = "resid_pre of block 0 (patch embedding + position embedding + prefix tokens) and its modified gradient"
_TOKENS = "patch tokens (prefix tokens' relevance is not on the grid)"
_RECON = "raster grid, bilinear upsampling, no ReLU, no normalisation (raw relevance)"
#: The presets in the audit's five categories (``docs/presets.md`` is generated from the taxonomy).
RULE_TAXONOMY: dict[str, dict[str, str]] = {
    "cp_lrp": {"paper": RULES["cp_lrp"].citation.split(";")[0] + ". " + LRP_PATENT_NOTE,
               "code": "https://github.com/AmeenAli/XAI_Transformers ; "
                       "https://github.com/rachtibat/LRP-eXplains-Transformers",
               "site": _SITE, "target": "class logit, backward rule cp_lrp (trace argument rule='cp_lrp')",
               "tokens": _TOKENS, "aggregation": "sum_k h[p,k] R[p,k] (input x modified gradient)",
               "reconstruction": _RECON},
    "attnlrp": {"paper": RULES["attnlrp"].citation.split(";")[0] + ". " + LRP_PATENT_NOTE,
                "code": "https://github.com/rachtibat/LRP-eXplains-Transformers",
                "site": _SITE, "target": "class logit, backward rule attnlrp (trace argument rule='attnlrp')",
                "tokens": _TOKENS, "aggregation": "sum_k h[p,k] R[p,k] (input x modified gradient)",
                "reconstruction": _RECON},
    "libragrad": {"paper": RULES["libragrad"].citation.split(";")[0],
                  "code": "https://github.com/NightMachinery/pytorch-image-models-libragrad-v1",
                  "site": _SITE, "target": "class logit, backward rule libragrad (trace argument rule='libragrad')",
                  "tokens": _TOKENS, "aggregation": "sum_k h[p,k] R[p,k] (input x modified gradient); "
                                                    "biases=True: the paper's Libra FullGrad+, every block's input "
                                                    "term plus its bias terms b.db per token",
                  "reconstruction": _RECON},
    "transformer_attribution": {
        "paper": RULES["chefer_lrp"].citation.split(";")[0] + ". " + LRP_PATENT_NOTE,
        "code": "https://github.com/hila-chefer/Transformer-Explainability (baselines/ViT/ViT_LRP.py, "
                "ViT_explanation_generator.py)",
        "site": "F2 of every block: its LRP relevance R_A (the stored attn_grad of a chefer_lrp trace) and its plain "
                "gradient dA (attn_plain_grad, same pass)",
        "target": "class logit; relevance started from the one-hot of the class (backward rule chefer_lrp, trace "
                  "argument rule='chefer_lrp')",
        "tokens": "the CLS row of the rollout, patch columns",
        "aggregation": "Abar_l = mean_h relu(dA_l * R_A_l); R = I, R <- R + Abar_l R for each block from the first",
        "reconstruction": "raster grid, bilinear upsampling, min-max (as the official visualisation)"},
}


def _relevance(rule: str, layer: int | tuple | str) -> Recipe:
    return Recipe(site="resid_pre", layer=layer, weighting=rule, layer_fusion="sum" if layer == "all" or
                  isinstance(layer, tuple) else "none", relu="none", normalize="none")


def cp_lrp(layer: int | tuple | str = 0) -> Recipe:
    """CP-LRP (Ali et al. 2022): input x the CP-LRP gradient at the hidden state entering block ``layer`` (default
    0: the patch embedding output with position embedding), summed over channels, per patch; signed, raw. Needs
    ``vc.trace(model, image, rule="cp_lrp", sites=[..., "resid_pre"])``. LRP's authors state in lxt's README that
    LRP is patented and free for personal and scientific use.

    Example:
        >>> cp_lrp().weighting, cp_lrp().layer
        ('cp_lrp', 0)
    """
    return _relevance("cp_lrp", layer)


def attnlrp(layer: int | tuple | str = 0) -> Recipe:
    """AttnLRP (Achtibat et al. 2024, lxt): input x the AttnLRP gradient at the hidden state entering block
    ``layer`` (default 0), summed over channels, per patch; signed, raw. Needs ``vc.trace(model, image,
    rule="attnlrp", sites=[..., "resid_pre"])``. LRP's authors state in lxt's README that LRP is patented and free
    for personal and scientific use.

    Example:
        >>> attnlrp().relu, attnlrp().normalize
        ('none', 'none')
    """
    return _relevance("attnlrp", layer)


def libragrad(layer: int | tuple | str | None = None, biases: bool = False) -> Recipe:
    """LibraGrad (Mehri et al. 2025): input x the LibraGrad gradient at the hidden state entering block ``layer``
    (default 0), summed over channels, per patch; signed, raw. Needs ``vc.trace(model, image, rule="libragrad",
    sites=[..., "resid_pre"])``.

    ``biases=True`` is the paper's own read-out, Libra FullGrad+ (weighting ``libragrad_fullgrad``): per patch, the
    sum over the blocks ``layer`` (default every block) of input x gradient at each block's input plus every bias of
    the block times its gradient, each bias term read from the trace as ``y.dy - x.dx`` across its affine sublayer
    (:mod:`vitcam_nb.compute.relevance`). It needs ``sites=["resid_pre", "resid_mid", "F6", "v", "F3",
    "attn_out", "F5"]`` (timm ViTs with plain attention).

    Example:
        >>> libragrad().site, libragrad().layer
        ('resid_pre', 0)
        >>> libragrad(biases=True).weighting, libragrad(biases=True).layer
        ('libragrad_fullgrad', 'all')
    """
    if not isinstance(biases, bool):
        raise RecipeError(f"biases: expected True or False, got {biases!r}")
    if not biases:
        return _relevance("libragrad", 0 if layer is None else layer)
    recipe = _relevance("libragrad", "all" if layer is None else layer)
    return recipe.replace(weighting="libragrad_fullgrad")


def transformer_attribution(layer: int | tuple | str = "all") -> Recipe:
    """Transformer Attribution (Chefer, Gur & Wolf 2021): per block the mean over heads of relu(dA * R_A), R_A the
    LRP relevance of the attention map and dA its plain gradient, rolled out from the identity over the blocks
    from ``layer``'s first (default every block: the official ``start_layer=0``) to the last; the CLS row over the
    patches, min-max. Needs ``vc.trace(model, image, rule="chefer_lrp", sites=[..., "F2"])`` (one pass stores
    both). LRP's authors state in lxt's README that LRP is patented and free for personal and scientific use.

    Example:
        >>> transformer_attribution().weighting, transformer_attribution().site
        ('transformer_attribution', 'F2')
    """
    return Recipe(site="F2", layer=layer, weighting="transformer_attribution", layer_fusion="sum" if layer == "all"
                  or isinstance(layer, tuple) else "none", relu="none", normalize="minmax")


# Registered through the public call (ids unchanged, in this order); their citations were stated above.
for _name, _make in {"cp_lrp": cp_lrp, "attnlrp": attnlrp, "libragrad": libragrad,
                "transformer_attribution": transformer_attribution}.items():
    register_preset(CITATIONS[_name], name=_name)(_make)
