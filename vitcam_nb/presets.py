"""``vitcam_nb.presets`` (``vc.presets``): the named recipes with their citations. They are recipes, so they live
in the core layer (:mod:`vitcam_nb.core.presets`); this module keeps the public path. A preset a module registers
(:func:`register_preset`, in ``vitcam_nb/core/presets_<topic>.py``) is reached as ``vc.presets.<name>`` with no
import added here.

Example:
    >>> from vitcam_nb import presets
    >>> presets.pytorch_grad_cam_vit().site
    'F1'
"""

from __future__ import annotations

from collections.abc import Callable

from vitcam_nb.core.preset_registry import register_preset
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
    preset_names,
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
           "names", "preset_name", "preset_names", "preset_text", "pytorch_grad_cam_vit", "register_preset", "tokentm",
           "transformer_attribution", "transition_attention_maps", "vit_cx", "vlm_generic_attention",
           "vlm_tower_gradcam", "xgradcam"]


def __getattr__(name: str) -> Callable:
    # a preset registered by its own module (no import line here): vc.presets.<name> is its factory
    if name in PRESETS or (not name.startswith("__") and name in preset_names()):
        return PRESETS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(preset_names()))

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
    for name in preset_names():
        row = TAXONOMY.get(name, {})
        cells = [f"`{name}`"] + [row.get(c, "?").replace("|", "\\|") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
