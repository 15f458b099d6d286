"""Per-family image-token layouts of generative VLMs: from a transformers 5 config and what the processor gave
(``input_ids``, ``image_sizes``, ``image_grid_thw``, rows/cols) to an :class:`~vitcam_nb.adapters.vlm_layout.
ImageTokenLayout`, plus each family's :class:`~vitcam_nb.adapters.vlm_layout.VlmAnatomy`. Each layout is tested
against the family's own feature-packing code by marking tokens (``tests/unit/model/test_vlm_layouts_*.py``)."""

from __future__ import annotations

from vitcam_nb.adapters.vlm_layouts.anyres import (
    LLAVA_NEXT_ANATOMY,
    LLAVA_ONEVISION_ANATOMY,
    llava_next_layout,
    llava_onevision_layout,
)
from vitcam_nb.adapters.vlm_layouts.gemma import (
    GEMMA3_ANATOMY,
    PALIGEMMA_ANATOMY,
    gemma3_layout,
    gemma3_patch_token,
    paligemma_layout,
)
from vitcam_nb.adapters.vlm_layouts.idefics import (
    IDEFICS3_ANATOMY,
    SMOLVLM_ANATOMY,
    idefics3_layout,
    shuffle_patches,
    smolvlm_layout,
)
from vitcam_nb.adapters.vlm_layouts.qwen import (
    QWEN2_5_VL_ANATOMY,
    QWEN2_VL_ANATOMY,
    qwen2_5_vl_layout,
    qwen2_vl_layout,
    qwen_tower_cells,
)

__all__ = [
    "GEMMA3_ANATOMY",
    "IDEFICS3_ANATOMY",
    "LLAVA_NEXT_ANATOMY",
    "LLAVA_ONEVISION_ANATOMY",
    "PALIGEMMA_ANATOMY",
    "QWEN2_5_VL_ANATOMY",
    "QWEN2_VL_ANATOMY",
    "SMOLVLM_ANATOMY",
    "gemma3_layout",
    "gemma3_patch_token",
    "idefics3_layout",
    "llava_next_layout",
    "llava_onevision_layout",
    "paligemma_layout",
    "qwen2_5_vl_layout",
    "qwen2_vl_layout",
    "qwen_tower_cells",
    "shuffle_patches",
    "smolvlm_layout",
]
