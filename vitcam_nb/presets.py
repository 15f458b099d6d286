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
    attention_rollout,
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
    pytorch_grad_cam_vit,
    xgradcam,
)

__all__ = ["CITATIONS", "PRESETS", "attention_rollout", "chefer_attention_gradcam", "citation", "eigencam",
           "eigengradcam", "get", "gradcam", "gradcam_elementwise", "gradcampp", "gradient_rollout", "hirescam",
           "layercam", "legrad_style", "names", "pytorch_grad_cam_vit", "xgradcam"]

# The published attention-gradient methods (issue #20, part A) and their taxonomy.
from vitcam_nb.core.presets import TAXONOMY, agcam, attcat, grad_eclip, grad_eclip_paper, grad_sam, legrad  # noqa: E402

__all__ += ["TAXONOMY", "agcam", "attcat", "grad_eclip", "grad_eclip_paper", "grad_sam", "legrad"]
