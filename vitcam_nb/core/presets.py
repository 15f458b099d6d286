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
