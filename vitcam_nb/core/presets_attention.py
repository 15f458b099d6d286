"""The published attention-gradient methods as presets: Grad-SAM, AttCAT, AG-CAM, LeGrad (the official read-out
and the kit's class-token one) and Grad-ECLIP (its official code's reading and the paper's). Each is a recipe
whose weighting is a whole method (``method=True``), computed by the "published" trace kind from the sites it
reads; importing this module adds them to :data:`~vitcam_nb.core.presets.PRESETS` and their sources to
``CITATIONS``.

Example:
    >>> from vitcam_nb.core.presets import get
    >>> get("agcam").weighting
    'agcam'
"""

from __future__ import annotations

from vitcam_nb.core.preset_registry import register_preset
from vitcam_nb.core.presets import CITATIONS
from vitcam_nb.core.recipe import Recipe

__all__ = ["ATTENTION_CITATIONS", "agcam", "attcat", "grad_eclip", "grad_eclip_paper", "grad_sam", "legrad",
           "legrad_cls"]

#: Where each method comes from (also added to ``CITATIONS``).
ATTENTION_CITATIONS: dict[str, str] = {
    "grad_sam": "Barkan et al. 2021, Grad-SAM: Explaining Transformers via Gradient Self-Attention Maps, CIKM "
                "(no official code; token relevance = mean over keys of A * relu(dy/dA) as the AttCAT/Contrast-CAT "
                "comparisons compute it, here read at the CLS row over patch keys)",
    "attcat": "Qiang et al. 2022, AttCAT: Explaining Transformers via Attentive Class Activation Tokens, NeurIPS",
    "agcam": "Leem & Seo 2024, Attention Guided CAM: Visual Explanations of Vision Transformer Guided by "
             "Self-Attention, AAAI (official AGCAM.py)",
    "legrad": "Bousselham et al. 2024, LeGrad: An Explainability Method for Vision Transformers via Feature "
              "Formation Sensitivity (official legrad/wrapper.py, pip legrad-torch 1.1: per block the final norm of "
              "the mean over all tokens through the projection or head; the last two blocks, layer_index=-2)",
    "legrad_cls": "the kit's variant of Bousselham et al. 2024, LeGrad: each block read out by the model's own "
                  "pooling (the class token) instead of the official mean over all tokens; every block",
    "grad_eclip": "Zhao et al. 2024, Gradient-based Visual Explanation for Transformer-based CLIP, ICML (official "
                  "generate_emap.py: last block recomputed single-head; cosine of q and k after out_proj)",
    "grad_eclip_paper": "Zhao et al. 2024, Gradient-based Visual Explanation for Transformer-based CLIP, ICML (the "
                        "paper's formula on the model's own multi-head attention: one q-k cosine per head)",
}
CITATIONS.update(ATTENTION_CITATIONS)


def grad_sam(layer: int | tuple | str = "all", attn_rows: str = "cls") -> Recipe:
    """Grad-SAM (Barkan et al. 2021): mean over layers and heads of ``A * relu(dy/dA)``, read at the CLS query
    row over the patch keys (``attn_rows="mean"`` averages all query rows instead). No ReLU after the mean and no
    normalisation beyond min-max of the final map.

    Example:
        >>> grad_sam().weighting, grad_sam().layer_fusion
        ('gradsam', 'mean')
    """
    return Recipe(site="F2", layer=layer, weighting="gradsam", attn_rows=attn_rows, layer_fusion="mean",
                  relu="none", normalize="minmax")


def attcat(layer: int | tuple | str = "all", attn_rows: str = "mean") -> Recipe:
    """AttCAT (Qiang et al. 2022): per block, the hidden state entering it times its gradient summed over channels,
    weighted by the block's attention averaged over heads, summed over blocks; signed (no ReLU), min-max at the end.
    The attention weight follows the AttCAT code as the Contrast-CAT comparison runs it (``att.mean(heads)
    .mean(query rows)``); ``attn_rows="cls"`` gives the CLS-row reading of the paper's description. Needs sites
    ``resid_pre`` and ``F2``.

    Example:
        >>> attcat().weighting
        'attcat'
    """
    return Recipe(site="F2", layer=layer, weighting="attcat", attn_rows=attn_rows, layer_fusion="sum",
                  relu="none", normalize="minmax")


def agcam(layer: int | tuple | str = "all") -> Recipe:
    """AG-CAM (Leem & Seo 2024, official ``AGCAM.py``): ``sigmoid`` of the pre-softmax attention scores of the CLS
    row times ``relu`` of the gradient of the softmax attention, summed over heads and layers, patch keys; the
    official demo then upsamples bilinearly and min-max normalises. Needs sites ``F2`` and ``attn_scores``.

    Example:
        >>> agcam().weighting
        'agcam'
    """
    return Recipe(site="F2", layer=layer, weighting="agcam", layer_fusion="sum", relu="none", normalize="minmax")


def legrad(layer: int | tuple | str = (-2, -1)) -> Recipe:
    """LeGrad (Bousselham et al. 2024) as its official code computes it (``legrad/wrapper.py``, pip
    ``legrad-torch`` 1.1; torchcam 0.5's ``LeGrad`` agrees): for each block l, the score ``s_l`` is the final
    norm applied to the MEAN of block l's output over all tokens (class token included), through the projection
    (open_clip, cosine with the text embedding) or the classifier head (timm); the gradient of ``s_l`` w.r.t. the
    block's attention, ReLU, mean over heads and query rows, summed over blocks, min-max. The default blocks are
    the official ``layer_index=-2``: the last two. Needs a trace with ``targets=vc.targets.layerwise(...)`` (its
    default ``readout="mean"``; timm classifiers, open_clip towers with ``vectors=`` text embeddings) and site
    F2. :func:`legrad_cls` is the kit's class-token read-out (this preset's meaning before).

    Example:
        >>> legrad().weighting, legrad().layer
        ('legrad_mean', (-2, -1))
    """
    return Recipe(site="F2", layer=layer, weighting="legrad_mean", layer_fusion="sum", relu="none",
                  normalize="minmax")


def legrad_cls(layer: int | tuple | str = "all") -> Recipe:
    """The kit's variant of LeGrad, NOT the official read-out: each block l's score is its output through the
    final norm and the model's own pooling and head (the class token on class-token models, so the last block's
    score is the model's logit), where the official code reads the mean over all tokens (:func:`legrad`); every
    block by default. Otherwise as :func:`legrad`. Needs a trace with
    ``targets=vc.targets.layerwise(..., readout="model")``. Its recipe id is the one ``vc.presets.legrad()``
    had before LeGrad's read-out was fixed, so stored recipes of that id keep computing this.

    Example:
        >>> legrad_cls().weighting, legrad_cls().layer
        ('legrad', 'all')
    """
    return Recipe(site="F2", layer=layer, weighting="legrad", layer_fusion="sum", relu="none", normalize="minmax")


def grad_eclip(layer: int | tuple | str = -1) -> Recipe:
    """Grad-ECLIP as its official ``generate_emap.py`` computes it for CLIP: channel weights ``dcos/dF3`` at the class
    token, times the patches' value vectors, times the min-max of ``cos(q_out_cls, k_out_patch)`` where ``q_out``,
    ``k_out`` are q and k passed through the block's ``out_proj`` (as the code does), ReLU, summed over channels.
    The code deviates from the paper: it recomputes the last block's attention as ONE head over all channels, so
    the gradient flows through that single-head forward. Trace inside
    ``vitcam_nb.adapters.single_head_attention(model)`` with sites F3, v, q_out, k_out to follow it (q_out/k_out:
    open_clip towers, timm ViTs with plain attention such as the CLIP ones, Hugging Face CLIP); the trace records
    the single-head blocks, the checklist says so, and a trace made outside that context is refused (its map would
    not be the official one). :func:`grad_eclip_paper` is the paper's multi-head formula.

    Example:
        >>> grad_eclip().site
        'F3'
    """
    return Recipe(site="F3", layer=layer, weighting="grad_eclip", layer_fusion="sum" if layer == "all" or
                  isinstance(layer, tuple) else "none", relu="none", normalize="minmax")


def grad_eclip_paper(layer: int | tuple | str = -1) -> Recipe:
    """Grad-ECLIP as the paper states it, on the model's own multi-head attention: per head ``h``, the min-max of
    ``cos(q^h_cls, k^h_patch)`` weights that head's channels of ``dcos/dF3[cls] * v[patch]``; ReLU of the sum over
    channels. Needs sites F3, q, k, v.

    Example:
        >>> grad_eclip_paper().weighting
        'grad_eclip_paper'
    """
    return Recipe(site="F3", layer=layer, weighting="grad_eclip_paper", layer_fusion="sum" if layer == "all" or
                  isinstance(layer, tuple) else "none", relu="none", normalize="minmax")


# Registered through the public call (ids unchanged, in this order); their citations were stated above.
for _name, _make in {"grad_sam": grad_sam, "attcat": attcat, "agcam": agcam, "legrad": legrad, "legrad_cls": legrad_cls,
                "grad_eclip": grad_eclip, "grad_eclip_paper": grad_eclip_paper}.items():
    register_preset(CITATIONS[_name], name=_name)(_make)
