"""Named recipes with a citation: the variants other libraries and papers use, made explicit.

Each function returns a :class:`~vitcam_nb.Recipe`; :data:`CITATIONS` maps preset names to their source
and :func:`citation` finds the preset a recipe came from, so the checklist can name it.

Example:
    >>> from vitcam_nb import presets
    >>> presets.pytorch_grad_cam_vit().site
    'F1'
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.recipe import Recipe

PYTORCH_GRAD_CAM = ("Gildenblat et al., pytorch-grad-cam 1.5.7 (github.com/jacobgil/pytorch-grad-cam), ViT tutorial: "
                    "target layer blocks[-1].norm1, reshape_transform dropping the class token, ReLU, min-max "
                    "normalisation, bilinear resize")
CITATIONS: dict[str, str] = {
    "pytorch_grad_cam_vit": PYTORCH_GRAD_CAM,
    "gradcam": "Selvaraju et al. 2017, Grad-CAM, ICCV; " + PYTORCH_GRAD_CAM,
    "hirescam": "Draelos & Carin 2020, HiResCAM, arXiv:2011.08891; " + PYTORCH_GRAD_CAM,
    "gradcam_elementwise": "pytorch-grad-cam GradCAMElementWise; " + PYTORCH_GRAD_CAM,
    "gradcampp": "Chattopadhay et al. 2018, Grad-CAM++, WACV; " + PYTORCH_GRAD_CAM,
    "xgradcam": "Fu et al. 2020, Axiom-based Grad-CAM, BMVC; " + PYTORCH_GRAD_CAM,
    "layercam": "Jiang et al. 2021, LayerCAM, IEEE TIP; " + PYTORCH_GRAD_CAM,
    "eigencam": "Muhammad & Yeasin 2020, Eigen-CAM, IJCNN; " + PYTORCH_GRAD_CAM,
    "eigengradcam": "pytorch-grad-cam EigenGradCAM; " + PYTORCH_GRAD_CAM,
    "chefer_attention_gradcam": "Chefer, Gur & Wolf 2021, Transformer Interpretability Beyond Attention "
                                "Visualization, CVPR: the Grad-CAM baseline on the last block's attention "
                                "(CLS row, heads weighted by their mean gradient, averaged, then ReLU)",
    "attention_rollout": "Abnar & Zuidema 2020, Quantifying Attention Flow in Transformers, ACL",
    "gradient_rollout": "Chefer, Gur & Wolf 2021b, Generic Attention-model Explainability for Interpreting "
                        "Bi-Modal and Encoder-Decoder Transformers, ICCV",
    "legrad_style": "after Bousselham et al. 2024, LeGrad: relu of the gradient w.r.t. the attention maps, "
                    "averaged over heads and query rows, summed over layers (rows averaged before the ReLU here)",
}


def pytorch_grad_cam_vit(layer: int = -1, site: str = "F1") -> Recipe:
    """pytorch-grad-cam's ViT tutorial recipe: GradCAM on ``blocks[layer].norm1`` output, class token dropped.

    Example:
        >>> pytorch_grad_cam_vit().weighting
        'gradcam'
    """
    return _grad_cam_method("gradcam", layer, site)


def _grad_cam_method(weighting: str, layer: int, site: str) -> Recipe:
    return Recipe(site=site, layer=layer, target="logit", class_="top1", weight_tokens="patch",
                  weighting=weighting, upsample="bilinear", relu="after", normalize="minmax")


def gradcam(layer: int = -1, site: str = "F1") -> Recipe:
    """pytorch-grad-cam ``GradCAM`` on a ViT site (default its tutorial's ``blocks[-1].norm1``).

    Example:
        >>> gradcam(layer=5).layer
        5
    """
    return _grad_cam_method("gradcam", layer, site)


def hirescam(layer: int = -1, site: str = "F1") -> Recipe:
    """pytorch-grad-cam ``HiResCAM``: elementwise gradient times activation, summed over channels.

    Example:
        >>> hirescam().weighting
        'hirescam'
    """
    return _grad_cam_method("hirescam", layer, site)


def gradcam_elementwise(layer: int = -1, site: str = "F1") -> Recipe:
    """pytorch-grad-cam ``GradCAMElementWise``: ReLU of gradient times activation, summed over channels.

    Example:
        >>> gradcam_elementwise().weighting
        'gradcam_elementwise'
    """
    return _grad_cam_method("gradcam_elementwise", layer, site)


def gradcampp(layer: int = -1, site: str = "F1") -> Recipe:
    """pytorch-grad-cam ``GradCAMPlusPlus``.

    Example:
        >>> gradcampp().weighting
        'gradcampp'
    """
    return _grad_cam_method("gradcampp", layer, site)


def xgradcam(layer: int = -1, site: str = "F1") -> Recipe:
    """pytorch-grad-cam ``XGradCAM``.

    Example:
        >>> xgradcam().weighting
        'xgradcam'
    """
    return _grad_cam_method("xgradcam", layer, site)


def layercam(layer: int = -1, site: str = "F1") -> Recipe:
    """pytorch-grad-cam ``LayerCAM``.

    Example:
        >>> layercam().weighting
        'layercam'
    """
    return _grad_cam_method("layercam", layer, site)


def eigencam(layer: int = -1, site: str = "F1") -> Recipe:
    """pytorch-grad-cam ``EigenCAM`` (gradient-free). vitcam_nb fixes the singular vector's sign so the
    largest-magnitude token is positive; pytorch-grad-cam leaves it to LAPACK.

    Example:
        >>> eigencam().weighting
        'eigencam'
    """
    return _grad_cam_method("eigencam", layer, site)


def eigengradcam(layer: int = -1, site: str = "F1") -> Recipe:
    """pytorch-grad-cam ``EigenGradCAM`` (first principal component of gradient times activation).

    Example:
        >>> eigengradcam().weighting
        'eigengradcam'
    """
    return _grad_cam_method("eigengradcam", layer, site)


def chefer_attention_gradcam(layer: int = -1) -> Recipe:
    """Chefer et al. 2021's attention Grad-CAM baseline: F2 of the last block, CLS query row, each head
    weighted by its mean gradient over patch keys, heads averaged, then ReLU.

    Example:
        >>> chefer_attention_gradcam().site
        'F2'
    """
    return Recipe(site="F2", layer=layer, weighting="gradcam", heads="mean_then_relu", attn_rows="cls",
                  weight_tokens="patch")


def attention_rollout() -> Recipe:
    """Abnar & Zuidema 2020 attention rollout over all traced blocks (no gradient), CLS row.

    Example:
        >>> attention_rollout().layer_fusion
        'rollout'
    """
    return Recipe(site="F2", layer="all", layer_fusion="rollout")


def gradient_rollout(target: str = "logit") -> Recipe:
    """Chefer et al. 2021b gradient-weighted attention rollout over all traced blocks, CLS row.

    Example:
        >>> gradient_rollout().layer_fusion
        'grad_rollout'
    """
    return Recipe(site="F2", layer="all", layer_fusion="grad_rollout", target=target)


def legrad_style() -> Recipe:
    """A LeGrad-style map: ReLU of the attention gradient per head, averaged over heads and query rows,
    summed over all traced blocks.

    Example:
        >>> legrad_style().weighting
        'gradient'
    """
    return Recipe(site="F2", layer="all", weighting="gradient", heads="relu_then_mean", attn_rows="mean",
                  layer_fusion="sum")


PRESETS: dict[str, Callable[..., Recipe]] = {
    "pytorch_grad_cam_vit": pytorch_grad_cam_vit, "gradcam": gradcam, "hirescam": hirescam,
    "gradcam_elementwise": gradcam_elementwise, "gradcampp": gradcampp, "xgradcam": xgradcam,
    "layercam": layercam, "eigencam": eigencam, "eigengradcam": eigengradcam,
    "chefer_attention_gradcam": chefer_attention_gradcam, "attention_rollout": attention_rollout,
    "gradient_rollout": gradient_rollout, "legrad_style": legrad_style,
}


def names() -> list[str]:
    """Names of all presets.

    Example:
        >>> "attention_rollout" in names()
        True
    """
    return list(PRESETS)


def get(name: str, **kwargs: object) -> Recipe:
    """The preset ``name`` built with ``kwargs`` (e.g. ``layer``).

    Example:
        >>> get("gradcam", layer=3).layer
        3
    """
    if name not in PRESETS:
        raise RecipeError(f"name: unknown preset {name!r}; presets are {names()}")
    return PRESETS[name](**kwargs)


def citation(recipe: Recipe) -> str:
    """The citation of the preset that ``recipe`` equals at its default arguments, or "".

    Example:
        >>> citation(attention_rollout()).startswith("Abnar")
        True
    """
    for name, preset in _default_recipes(tuple(PRESETS.items())):
        if preset == recipe:
            return CITATIONS[name]
    return ""


@functools.lru_cache(maxsize=4)
def _default_recipes(presets: tuple) -> tuple[tuple[str, Recipe], ...]:
    # Keyed by the table's entries, so a preset added at run time is seen; a report asks this for every map.
    return tuple((name, make()) for name, make in presets)


# -- published attention-gradient methods (issue #20, part A) ------------------------------------------------
# Computed by the "published" trace kind (vitcam_nb/compute/published.py) from the sites each method reads.
CITATIONS.update({
    "grad_sam": "Barkan et al. 2021, Grad-SAM: Explaining Transformers via Gradient Self-Attention Maps, CIKM "
                "(no official code; token relevance = mean over keys of A * relu(dy/dA) as the AttCAT/Contrast-CAT "
                "comparisons compute it, here read at the CLS row over patch keys)",
    "attcat": "Qiang et al. 2022, AttCAT: Explaining Transformers via Attentive Class Activation Tokens, NeurIPS",
    "agcam": "Leem & Seo 2024, Attention Guided CAM: Visual Explanations of Vision Transformer Guided by "
             "Self-Attention, AAAI (official AGCAM.py)",
    "legrad": "Bousselham et al. 2024, LeGrad: An Explainability Method for Vision Transformers via Feature "
              "Formation Sensitivity (official wrapper; one read-out score per layer)",
    "grad_eclip": "Zhao et al. 2024, Gradient-based Visual Explanation for Transformer-based CLIP, ICML (official "
                  "generate_emap.py: last block recomputed single-head; cosine of q and k after out_proj)",
    "grad_eclip_paper": "Zhao et al. 2024, Gradient-based Visual Explanation for Transformer-based CLIP, ICML (the "
                        "paper's formula on the model's own multi-head attention: one q-k cosine per head)",
})

#: The five taxonomy categories of each published method (the audit's checklist filled in).
TAXONOMY: dict[str, dict[str, str]] = {}


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


def legrad(layer: int | tuple | str = "all") -> Recipe:
    """Exact LeGrad (Bousselham et al. 2024): for each block l, the gradient of that block's own read-out score
    ``s_l`` (its output through the final norm, pooling and head) w.r.t. its attention, ReLU, mean over heads and
    query rows, summed over blocks, min-max. Needs a trace with ``targets=vc.targets.layerwise(...)`` (timm
    classifiers; open_clip towers with ``vectors=`` text embeddings) and site F2
    (all blocks' scores come from the same batched backward). The official wrapper starts at a chosen layer:
    pass the same blocks as ``layer``.

    Example:
        >>> legrad().weighting
        'legrad'
    """
    return Recipe(site="F2", layer=layer, weighting="legrad", layer_fusion="sum", relu="none", normalize="minmax")


def grad_eclip(layer: int | tuple | str = -1) -> Recipe:
    """Grad-ECLIP as its official ``generate_emap.py`` computes it for CLIP: channel weights ``dcos/dF3`` at the class
    token, times the patches' value vectors, times the min-max of ``cos(q_out_cls, k_out_patch)`` where ``q_out``,
    ``k_out`` are q and k passed through the block's ``out_proj`` (as the code does), ReLU, summed over channels.
    The code deviates from the paper: it recomputes the last block's attention as ONE head over all channels, so
    the gradient flows through that single-head forward. Trace inside
    ``vitcam_nb.adapters.single_head_attention(model)`` with sites F3, v, q_out, k_out to follow it (q_out/k_out:
    open_clip towers); :func:`grad_eclip_paper` is the paper's multi-head formula.

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


PRESETS.update({"grad_sam": grad_sam, "attcat": attcat, "agcam": agcam, "legrad": legrad, "grad_eclip": grad_eclip,
                "grad_eclip_paper": grad_eclip_paper})
TAXONOMY.update({
    "grad_sam": {"paper": CITATIONS["grad_sam"], "code": "none",
                 "site": "F2 softmax attention and its gradient, every block",
                 "target": "class logit (any vc target)",
                 "tokens": "CLS query row, patch keys",
                 "aggregation": "A * relu(dA), mean over heads, mean over layers",
                 "reconstruction": "raster grid, bilinear upsampling, min-max"},
    "attcat": {"paper": CITATIONS["attcat"], "code": "https://github.com/qiangyao1988/AttCAT",
               "site": "hidden state entering each block (resid_pre) and its gradient; F2 attention",
               "target": "class logit",
               "tokens": "all tokens weighted; attention averaged over query rows; patch tokens mapped",
               "aggregation": "sum_k h*dh per token times mean-head attention, summed over layers, signed",
               "reconstruction": "raster grid, bilinear upsampling, min-max"},
    "agcam": {"paper": CITATIONS["agcam"], "code": "https://github.com/LeemSaebom/Attention-Guided-CAM-Visual-"
                                                    "Explanations-of-Vision-Transformer-Guided-by-Self-Attention",
              "site": "pre-softmax scores (attn_scores) and the softmax attention's gradient, every block",
              "target": "class logit",
              "tokens": "CLS query row, patch keys",
              "aggregation": "sigmoid(S) * relu(dA), summed over heads and layers",
              "reconstruction": "raster grid, bilinear upsampling, min-max"},
    "legrad": {"paper": CITATIONS["legrad"], "code": "https://github.com/WalBouss/LeGrad",
               "site": "F2 softmax attention gradient of each block",
               "target": "per block: its output through the final norm, pooling and head (vc.targets.layerwise)",
               "tokens": "mean over all query rows, patch keys",
               "aggregation": "relu(ds_l/dA_l), mean over heads and rows, summed over layers",
               "reconstruction": "raster grid, bilinear upsampling, min-max"},
    "grad_eclip": {"paper": CITATIONS["grad_eclip"], "code": "https://github.com/Cyang-Zhao/Grad-Eclip",
                   "site": "last block: F3 gradient at CLS, values v, q and k through out_proj (q_out, k_out), "
                           "single-head recompute",
                   "target": "cosine of image and text embeddings (vc.targets.similarity / prompts)",
                   "tokens": "CLS gradient and query; patch values and keys",
                   "aggregation": "relu(sum_c g_c v_pc minmax cos(q_out_cls, k_out_p)), cosine over all channels",
                   "reconstruction": "raster grid, bilinear upsampling, min-max"},
    "grad_eclip_paper": {"paper": CITATIONS["grad_eclip_paper"], "code": "https://github.com/Cyang-Zhao/Grad-Eclip",
                         "site": "last block: F3 gradient at CLS, values v, queries q and keys k (multi-head)",
                         "target": "cosine of image and text embeddings",
                         "tokens": "CLS gradient and query; patch values and keys",
                         "aggregation": "relu(sum_h sum_(c in h) g_c v_pc minmax cos(q^h_cls, k^h_p))",
                         "reconstruction": "raster grid, bilinear upsampling, min-max"},
})
