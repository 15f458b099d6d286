"""Presets for a generative VLM's answer (issue 55, ``vc.targets.answer`` traces): Grad-CAM on the vision tower for
one answer token, and Chefer, Gur & Wolf's gradient-weighted attention over the image tokens in the language model.
Importing this module adds them to :data:`~vitcam_nb.core.presets.PRESETS`, their sources to ``CITATIONS`` and their
rows to :data:`VLM_TAXONOMY` (which :mod:`vitcam_nb.core.preset_taxonomy` takes in).

The token activation map (TAM, ICCV 2025) is preset ``tam`` of :mod:`vitcam_nb.core.presets_tam` (its formula from
the authors' code; the paper's method section could not be read).

Example:
    >>> vlm_tower_gradcam().site, vlm_generic_attention().site
    ('F6', 'lm_attn')
"""

from __future__ import annotations

from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.core.presets import CITATIONS, PRESETS, PYTORCH_GRAD_CAM
from vitcam_nb.core.recipe import Recipe

__all__ = ["VLM_CITATIONS", "VLM_TAXONOMY", "tower_layer", "vlm_generic_attention", "vlm_tower_gradcam"]

#: Where each preset comes from (also added to ``CITATIONS``).
VLM_CITATIONS: dict[str, str] = {
    "vlm_tower_gradcam": "Selvaraju et al. 2017, Grad-CAM, ICCV, on a generative VLM's vision tower for one answer "
                         "token (asked for in pytorch-grad-cam #532 and LAVIS #750); the layer LLaVA's "
                         "vision_feature_layer reads, its block output. " + PYTORCH_GRAD_CAM,
    "vlm_generic_attention": "Chefer, Gur & Wolf 2021, Generic Attention-model Explainability for Interpreting "
                             "Bi-Modal and Encoder-Decoder Transformers, ICCV: the self-attention rule R <- R + "
                             "mean_h (grad A * A)^+ R, read at the row predicting the answer token over the image-"
                             "token columns; first-order in the layers (paths through other tokens left out)",
}
CITATIONS.update(VLM_CITATIONS)


def tower_layer(vision_feature_layer: int, num_layers: int) -> int:
    """The tower block whose output LLaVA's projector reads: ``hidden_states[vision_feature_layer]`` is the
    embeddings for 0 and block ``i - 1``'s output for ``i >= 1``; a negative value counts from the end, so -2 (the
    default) is block -2 (the second to last).

    Example:
        >>> tower_layer(-2, 24), tower_layer(23, 24)
        (22, 22)
    """
    n = int(num_layers)
    index = int(vision_feature_layer) % (n + 1)
    if index == 0:
        raise ArgumentError("vision_feature_layer: 0 reads the patch embeddings, which no tower block outputs; a "
                            "tower-block preset needs a layer >= 1 (or < 0)")
    return index - 1


def vlm_tower_gradcam(layer: int = -2, token: int = 0, site: str = "F6") -> Recipe:
    """Grad-CAM on the vision tower for answer token ``token`` (``class_``; the last traced class is the sequence
    log-prob): ``alpha_k = mean_t G[t, k]`` over the patch tokens, ``relu(sum_k alpha_k A[t, k])``, min-max,
    bilinear to the input.

    Which layer and site: the block LLaVA's projector reads, ``vision_feature_layer`` (-2 by default: the second to
    last block; :func:`tower_layer` converts a config value to a block), at its output F6, which is that hidden state
    exactly. pytorch-grad-cam's ViT recipe steps back to ``blocks[-1].norm1`` (F1) because a class-token classifier
    never reads the last block's patch outputs; LLaVA reads every patch output of its chosen block, so the block
    output is the tower's last feature map the LM sees (``site="F1"`` gives that block's norm1 instead). The block
    above it (LLaVA's last) is never read: a map there has zero gradient and the kit says so.

    Example:
        >>> vlm_tower_gradcam().layer, vlm_tower_gradcam(token=2).class_
        (-2, 2)
    """
    return Recipe(site=site, layer=layer, target="logit", class_=token, weight_tokens="patch", weighting="gradcam",
                  upsample="bilinear", relu="after", normalize="minmax")


def vlm_generic_attention(layer: int | tuple | str = "all", token: int = 0) -> Recipe:
    """Chefer, Gur & Wolf 2021 (ICCV) on the decoder-only LM, over the image tokens, for answer token ``token``.

    The paper's self-attention rule starts from ``R = I`` over all tokens and updates it per layer l (first to
    last): ``R <- R + Abar_l R`` with ``Abar_l = mean_h (dy/dA_l,h * A_l,h)^+`` (entry-wise product, positive part,
    mean over heads); the relevance of the image tokens for the answer token is ``R`` at the row that predicts it
    (its position - 1) and the image-token columns. The trace stores the attention of the answer rows over the
    image-token columns only (``lm_attn``), so this preset computes the FIRST-ORDER part of that rule:
    ``sum_l Abar_l[row, image]``. Expanded, ``R = prod_l (I + Abar_l)``; the identity adds nothing off the row's
    own position, so for ONE layer (``layer=-1``) the preset equals the rule exactly, and over several layers it
    leaves out the products ``Abar_m ... Abar_l`` (m > l): relevance reaching the answer row through other tokens
    (text or image) of earlier layers. As recipe fields: ``weighting="gradcam_elementwise"`` (``(G * A)^+`` per
    head), ``heads="mean_then_relu"`` (mean over heads; the ReLU after it changes nothing), ``layer_fusion="sum"``,
    ``relu="none"`` and ``normalize="none"`` (each layer's term enters unnormalised, as in the sum; the map keeps
    the relevance's own scale: a display normalises it). ``token`` is the answer token (``class_``); the sequence
    log-prob (the last class) averages A and G over all answer rows before the product, which is not the rule.

    Example:
        >>> vlm_generic_attention().layer_fusion, vlm_generic_attention(layer=-1).layer
        ('sum', -1)
    """
    return Recipe(site="lm_attn", layer=layer, target="logit", class_=token, weighting="gradcam_elementwise",
                  heads="mean_then_relu", layer_fusion="sum" if layer == "all" or isinstance(layer, tuple) else "none",
                  relu="none", normalize="none", upsample="bilinear")


PRESETS.update({"vlm_tower_gradcam": vlm_tower_gradcam, "vlm_generic_attention": vlm_generic_attention})

_LAYOUT = "the image-token layout's cells (LLaVA: the tower's patch raster), bilinear to the input"
#: The presets' rows of the taxonomy table (the audit's five categories, the paper and its official code).
VLM_TAXONOMY: dict[str, dict[str, str]] = {
    "vlm_tower_gradcam": {
        "paper": "Selvaraju et al. 2017, ICCV; asked for on VLMs in pytorch-grad-cam #532, LAVIS #750",
        "code": "https://github.com/jacobgil/pytorch-grad-cam",
        "site": "F6, the output of the tower block LLaVA's vision_feature_layer reads (-2: the second to last)",
        "target": "the logit of answer token 0 at the position predicting it (teacher forcing)",
        "tokens": "class token dropped; channel weights pooled over the patch tokens",
        "aggregation": "gradcam: alpha_k = mean_t G[t,k], map = sum_k alpha_k A[t,k]",
        "reconstruction": "row-major tower patch grid, ReLU, min-max, bilinear resize to the input"},
    "vlm_generic_attention": {
        "paper": "Chefer, Gur & Wolf 2021b, ICCV (self-attention rule, first-order in the layers)",
        "code": "https://github.com/hila-chefer/Transformer-MM-Explainability",
        "site": "lm_attn: the LM's attention probabilities and their gradient, every decoder layer",
        "target": "the logit of answer token 0 at the position predicting it (teacher forcing)",
        "tokens": "the query row predicting the answer token; the image-token key columns",
        "aggregation": "sum_l mean_h relu(G_l * A_l) (the first-order terms of R = prod_l (I + Abar_l))",
        "reconstruction": _LAYOUT + "; no ReLU or normalisation (the relevance's scale)"},
}
