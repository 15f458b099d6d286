"""Named recipes with a citation: the variants other libraries and papers use, made explicit.

Each function returns a :class:`~vitcam_nb.Recipe`; :data:`CITATIONS` maps preset names to their source
and :func:`citation` finds the preset a recipe came from, so the checklist can name it. A preset registers
itself where it is defined (:func:`~vitcam_nb.core.preset_registry.register_preset`, a decorator); the modules
``vitcam_nb/core/presets_*.py`` are found by a walk of the package the first time the presets are listed or
looked up, so adding a preset is one new module (its public path ``vc.presets.<name>`` included).

Example:
    >>> from vitcam_nb import presets
    >>> presets.pytorch_grad_cam_vit().site
    'F1'
"""

from __future__ import annotations

import functools
import importlib

from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.preset_registry import (  # noqa: F401  (re-exported)
    CITATIONS,
    PRESET_ROWS,
    PRESETS,
    discover_presets,
    register_preset,
    unregister_preset,
)
from vitcam_nb.core.recipe import Recipe

PYTORCH_GRAD_CAM = ("Gildenblat et al., pytorch-grad-cam 1.5.7 (github.com/jacobgil/pytorch-grad-cam), ViT tutorial: "
                    "target layer blocks[-1].norm1, reshape_transform dropping the class token, ReLU, min-max "
                    "normalisation, bilinear resize")
CITATIONS.update({
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
    "transition_attention_maps": "Yuan et al. 2021, Explaining Information Flow Inside Vision Transformers Using "
                                 "Markov Chain, NeurIPS XAI4Debugging workshop; official code "
                                 "github.com/XianrenYty/Transition_Attention_Maps (start_layer=4, steps=20)",
    "beyond_intuition_head": "Chen et al. 2023, Beyond Intuition: Rethinking Token Attributions inside Transformers, "
                             "TMLR, head-wise (BT-H); official code github.com/jiaminchen-1031/transformerinterp "
                             "(beyond_intuition_headwise, start_layer=4, steps=20)",
    "beyond_intuition_token": "Chen et al. 2023, Beyond Intuition: Rethinking Token Attributions inside Transformers, "
                              "TMLR, token-wise (BT-T); official code github.com/jiaminchen-1031/transformerinterp "
                              "(beyond_intuition_tokenwise, start_layer=6, steps=20)",
    "vit_cx": "Xie et al. 2023, ViT-CX: Causal Explanation of Vision Transformers, IJCAI; official code "
              "github.com/vaynexie/CausalX-ViT (target layer blocks[-1].norm1, distance_threshold=0.1, noise 0.1)",
    "albef_itm_gradcam": "Li et al. 2021, Align before Fuse (ALBEF), NeurIPS; official visualisation "
                         "github.com/salesforce/ALBEF (visualization.ipynb): ITM score, cross-attention of text "
                         "layer 8, mean over heads of A * relu(G), the [CLS] text row",
})
#: The presets 0.1 shipped: their checklists keep the citation alone (the 0.1 contract fixes that text).
V0_1_PRESETS = ("pytorch_grad_cam_vit", "gradcam", "hirescam", "gradcam_elementwise", "gradcampp", "xgradcam",
                "layercam", "eigencam", "eigengradcam", "chefer_attention_gradcam", "attention_rollout",
                "gradient_rollout", "legrad_style")


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


def _from_end(start_layer: int | str, name: str) -> tuple[int, ...] | str:
    """Blocks ``start_layer..-1`` (negative: counted from the end), or "all" for ``start_layer`` 0 or "all"."""
    if start_layer in (0, "all"):
        return "all"
    if not isinstance(start_layer, int) or isinstance(start_layer, bool) or start_layer > 0:
        raise RecipeError(f"start_layer: {name} counts blocks from the end (e.g. -8: the last 8 blocks; 0 or "
                          f"'all': every traced block), got {start_layer!r}")
    return tuple(range(start_layer, 0))


def transition_attention_maps(start_layer: int | str = -8) -> Recipe:
    """Transition Attention Maps (Yuan et al. 2021), as the official code computes them: the CLS row of the
    head-mean attention of the last block times ``(mean_h A_l + I)`` of the earlier blocks down to
    ``start_layer``, times the CLS row of ``mean_h relu(IG)``, IG the integrated gradient (20 steps, zero
    baseline) of the last attention. The default -8 is the official ``start_layer=4`` of a 12-block ViT-B. Needs
    ``vc.score(tr, model, recipe, image)`` first.

    Example:
        >>> transition_attention_maps(start_layer=-2).layer, transition_attention_maps().layer_fusion
        ((-2, -1), 'transition')
    """
    return Recipe(site="F2", layer=_from_end(start_layer, "transition_attention_maps"), layer_fusion="transition")


def beyond_intuition_head(start_layer: int | str = -9) -> Recipe:
    """Beyond Intuition head-wise (BT-H, Chen et al. 2023), as the official ``beyond_intuition_headwise``:
    ``R <- R + (sum_h I_h A_h) R`` over the blocks from ``start_layer``, ``I_h`` the normalised mean of
    ``|A_h^T G_h|``, then ``mean_h relu(IG) * R`` at the CLS row. The official loop starts at block
    ``start_layer - 1`` = 3 for its ``start_layer=4``: -9 on a 12-block ViT-B. Needs ``vc.score`` first.

    Example:
        >>> beyond_intuition_head().layer[0], beyond_intuition_head().layer_fusion
        (-9, 'bt_head')
    """
    return Recipe(site="F2", layer=_from_end(start_layer, "beyond_intuition_head"), layer_fusion="bt_head")


def beyond_intuition_token(start_layer: int | str = -7) -> Recipe:
    """Beyond Intuition token-wise (BT-T, Chen et al. 2023), after the official ``beyond_intuition_tokenwise``:
    ``R <- R + mean_h(A_l) diag(|v W_o| / |z|) R`` over the blocks from ``start_layer`` (official
    ``start_layer=6``, loop from block 5: -7 on a 12-block ViT-B), then ``mean_h relu(IG) * |R|`` at the CLS row.
    The official model file that defines ``vproj`` and ``get_input`` was not available to us: vitcam_nb reads
    them as the values of all heads times the output projection's weight (no bias) and the block input.

    Example:
        >>> beyond_intuition_token(start_layer=0).layer
        'all'
    """
    return Recipe(site="F2", layer=_from_end(start_layer, "beyond_intuition_token"), layer_fusion="bt_token")


def vit_cx(layer: int = -1) -> Recipe:
    """ViT-CX (Xie et al. 2023), as the official code: F1 maps of block ``layer`` clustered into masks, masked
    inputs with noise scored by the softmax probability (``vc.score(tr, model, vc.presets.vit_cx(), image)``).
    No ReLU (the official map is used as it comes), min-max normalised for display.

    Example:
        >>> vit_cx().weighting, vit_cx().target
        ('vitcx', 'prob')
    """
    return Recipe(site="F1", layer=layer, weighting="vitcx", target="prob", relu="none")


def albef_itm_gradcam(layer: int = 8, text_tokens: str | int = "cls") -> Recipe:
    """The ALBEF/BLIP image-text matching Grad-CAM (Li et al. 2021): cross-attention of text layer ``layer``
    (ALBEF's visualisation uses block 8 of its 12 text layers; LAVIS's BLIP demo uses 6), ``mean_h A * relu(G)``
    of the ITM "match" logit (class 1), at the text row ``text_tokens``: "cls", the first ([CLS]/[ENC]) row,
    is ALBEF's whole-image map; a position or a word gives its per-word maps (vitcam_nb's "all" averages A and
    G over rows before the product, which is not ALBEF's per-word average).

    Example:
        >>> albef_itm_gradcam().layer, albef_itm_gradcam().text_tokens
        (8, 'cls')
    """
    return Recipe(site="xattn", layer=layer, target="logit", class_=1, weighting="layercam", heads="mean_then_relu",
                  text_tokens=text_tokens)


# Registered through the public call (ids unchanged, in this order); their citations were stated above.
for _name, _make in {
    "pytorch_grad_cam_vit": pytorch_grad_cam_vit, "gradcam": gradcam, "hirescam": hirescam,
    "gradcam_elementwise": gradcam_elementwise, "gradcampp": gradcampp, "xgradcam": xgradcam,
    "layercam": layercam, "eigencam": eigencam, "eigengradcam": eigengradcam,
    "chefer_attention_gradcam": chefer_attention_gradcam, "attention_rollout": attention_rollout,
    "gradient_rollout": gradient_rollout, "legrad_style": legrad_style,
    "transition_attention_maps": transition_attention_maps, "beyond_intuition_head": beyond_intuition_head,
    "beyond_intuition_token": beyond_intuition_token, "vit_cx": vit_cx, "albef_itm_gradcam": albef_itm_gradcam,
}.items():
    register_preset(CITATIONS[_name], name=_name)(_make)


def preset_names() -> list[str]:
    """Every preset's name, in the order of the preset table (the registered ones found first).

    Example:
        >>> preset_names()[0]
        'pytorch_grad_cam_vit'
    """
    return names()


def names() -> list[str]:
    """Names of all presets.

    Example:
        >>> "attention_rollout" in names()
        True
    """
    # The published presets register from several modules, in the order the (lazy) package happened to import
    # them; the taxonomy's order is fixed, so menus, tables and reports list them alike in every process. Imported
    # by name: the taxonomy imports this module (and every preset module, so all are registered after it).
    discover_presets()
    taxonomy = importlib.import_module("vitcam_nb.core.preset_taxonomy").TAXONOMY
    order = {name: i for i, name in enumerate(taxonomy)}
    return sorted(PRESETS, key=lambda name: order.get(name, len(order)))


def get(name: str, **kwargs: object) -> Recipe:
    """The preset ``name`` built with ``kwargs`` (e.g. ``layer``).

    Example:
        >>> get("gradcam", layer=3).layer
        3
    """
    discover_presets()
    if name not in PRESETS:
        raise RecipeError(f"name: unknown preset {name!r}; presets are {names()}")
    return PRESETS[name](**kwargs)


def citation(recipe: Recipe | str) -> str:
    """The citation of a preset given by name, or of the preset that ``recipe`` equals at its default arguments
    ("" when it equals none).

    Example:
        >>> citation(attention_rollout()).startswith("Abnar")
        True
        >>> citation("attention_rollout") == citation(attention_rollout())
        True
    """
    discover_presets()
    if isinstance(recipe, str):
        if recipe not in CITATIONS:
            raise RecipeError(f"recipe: unknown preset name {recipe!r}; presets are {names()}")
        return CITATIONS[recipe]
    name = preset_name(recipe)
    return CITATIONS[name] if name else ""


def preset_name(recipe: Recipe) -> str:
    """The name of the preset that ``recipe`` equals at its default arguments (a preset added after 0.1: at any
    blocks), or "".

    Example:
        >>> preset_name(transition_attention_maps())
        'transition_attention_maps'
    """
    if not isinstance(recipe, Recipe):
        raise RecipeError(f"recipe: expected a vitcam_nb.Recipe, got {type(recipe).__name__}")
    discover_presets()
    defaults = _default_recipes(tuple(PRESETS.items()))
    for name, preset in defaults:
        if preset == recipe:
            return name
    # The presets added after 0.1 name their method whatever blocks they run on (start_layer, layer).
    for name, preset in defaults:
        if name in V0_1_PRESETS or preset.site != recipe.site:
            continue
        try:
            if preset.replace(layer=recipe.layer) == recipe:
                return name
        except RecipeError:  # the blocks do not fit this preset's form (a tuple for a one-block preset)
            continue
    return ""


def preset_text(recipe: Recipe) -> str:
    """What the checklist says of the preset ``recipe`` equals: "this is <name> (<citation>)", or "". The
    presets of 0.1 keep their citation alone, which the 0.1 contract fixes.

    Example:
        >>> preset_text(vit_cx())[:19]
        'this is vit_cx (Xie'
    """
    name = preset_name(recipe)
    if not name:
        return ""
    if name in V0_1_PRESETS:
        return CITATIONS[name]
    blocks = "" if PRESETS[name]().layer == recipe.layer else f", on blocks {recipe.layer!r}"
    return f"this is {name} ({CITATIONS[name]}){blocks}"


@functools.lru_cache(maxsize=4)
def _default_recipes(presets: tuple) -> tuple[tuple[str, Recipe], ...]:
    # Keyed by the table's entries, so a preset added at run time is seen; a report asks this for every map.
    return tuple((name, make()) for name, make in presets)
