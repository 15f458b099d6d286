"""``vitcam_nb.presets`` (``vc.presets``): the named recipes with their citations. They are recipes, so they live
in the core layer (:mod:`vitcam_nb.core.presets`); this module keeps the public path.

Example:
    >>> from vitcam_nb import presets
    >>> presets.pytorch_grad_cam_vit().site
    'F1'
"""

from __future__ import annotations

from vitcam_nb.core.preset_taxonomy import TAXONOMY
from vitcam_nb.core.presets import (
    CITATIONS,
    PRESETS,
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
from vitcam_nb.core.presets_attention import (
    agcam,
    attcat,
    grad_eclip,
    grad_eclip_paper,
    grad_sam,
    legrad,
    legrad_cls,
)
from vitcam_nb.core.presets_rules import attnlrp, cp_lrp, libragrad, transformer_attribution
from vitcam_nb.core.presets_tokentm import tokentm
from vitcam_nb.core.presets_vlm import vlm_generic_attention, vlm_tower_gradcam

__all__ = ["CITATIONS", "COLUMNS", "PRESETS", "TAXONOMY", "agcam", "albef_itm_gradcam", "attcat", "attention_rollout",
           "attnlrp", "cp_lrp", "libragrad",
           "beyond_intuition_head", "beyond_intuition_token", "chefer_attention_gradcam", "citation", "eigencam",
           "eigengradcam", "get", "grad_eclip", "grad_eclip_paper", "grad_sam", "gradcam", "gradcam_elementwise",
           "gradcampp", "gradient_rollout", "hirescam", "layercam", "legrad", "legrad_cls", "legrad_style",
           "markdown_table",
           "names", "preset_name", "preset_text", "pytorch_grad_cam_vit", "tokentm", "transformer_attribution",
           "transition_attention_maps",
           "vit_cx", "vlm_generic_attention", "vlm_tower_gradcam", "xgradcam"]

#: The columns of the preset table: the paper, its official code, then the audit's five categories.
COLUMNS = ("paper", "code", "site", "target", "tokens", "aggregation", "reconstruction")


def markdown_table() -> str:
    """The preset table of ``docs/presets.md``: one row per preset in :data:`TAXONOMY` (scripts/presets_table.py
    writes it; a test keeps the page equal to it).

    Example:
        >>> markdown_table().splitlines()[0]
        '| preset | paper | official code | site | target | token rule | aggregation | spatial reconstruction |'
    """
    head = ["preset", "paper", "official code", "site", "target", "token rule", "aggregation",
            "spatial reconstruction"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in names():
        row = TAXONOMY.get(name, {})
        cells = [f"`{name}`"] + [row.get(c, "?").replace("|", "\\|") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
