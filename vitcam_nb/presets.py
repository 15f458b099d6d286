"""``vitcam_nb.presets`` (``vc.presets``): the named recipes with their citations. They are recipes, so they live
in the core layer (:mod:`vitcam_nb.core.presets`); this module keeps the public path.

Example:
    >>> from vitcam_nb import presets
    >>> presets.pytorch_grad_cam_vit().site
    'F1'
"""

from vitcam_nb.core.presets import (
    CITATIONS,
    PRESETS,
    TAXONOMY,
    albef_itm_gradcam,
    attention_rollout,
    beyond_intuition_head,
    beyond_intuition_token,
    chefer_attention_gradcam,
    citation,
    eigencam,
    eigengradcam,
    get,
    gradcam,
    gradcam_elementwise,
    gradcampp,
    gradient_rollout,
    hirescam,
    layercam,
    legrad_style,
    names,
    preset_name,
    preset_text,
    pytorch_grad_cam_vit,
    transition_attention_maps,
    vit_cx,
    xgradcam,
)

__all__ = ["CITATIONS", "PRESETS", "TAXONOMY", "albef_itm_gradcam", "attention_rollout", "beyond_intuition_head",
           "beyond_intuition_token", "chefer_attention_gradcam", "citation", "eigencam", "eigengradcam", "get",
           "gradcam", "gradcam_elementwise", "gradcampp", "gradient_rollout", "hirescam", "layercam", "legrad_style",
           "names", "preset_name", "preset_text", "pytorch_grad_cam_vit", "transition_attention_maps", "vit_cx",
           "xgradcam"]
