"""``vc.map_many``'s size check before the first pass counts a generative VLM's maps on the tower's own grid (it
guessed a 16-px patch for every Hugging Face model, so the tiny LLaVA's 4x4 maps were counted as 2x2): the bytes its
refusal states are the bytes the store then holds per map, on a tiny LLaVA (8-px patches) and a tiny Qwen2-VL (its
packed 6x10 patches), and every other model's on the patch its family's description states."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import vitcam_nb as vc

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vlm_qwen_tiny import tiny_qwen  # noqa: E402

RECIPE = vc.Recipe(layer=0, class_=0)  # Grad-CAM of the first answer token at the tower's first block


def _llava():
    from benchmarks.items.vlm_trace_cost import ANSWER, PROMPT, tiny_llava

    xs = [torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    return tiny_llava(), xs, [vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)] * 2


def _qwen():
    model, pixel_values, target = tiny_qwen("qwen2")
    return model, [pixel_values, pixel_values.clone()], [target, target]


@pytest.mark.parametrize(("make", "cells"), [(_llava, 4 * 4), (_qwen, 6 * 10)])
def test_the_refusal_states_the_bytes_of_the_towers_own_grid(tmp_path, make, cells):
    model, images, targets = make()
    path = tmp_path / "m.zarr"
    per_image = cells * 4 + 64  # one float32 map on the tower grid, and 64 B of its recipe's row
    with pytest.raises(vc.TraceError, match=rf"^max_bytes: 1 recipes \(0 fused parts\) need about {2 * per_image} B "
                                            r"of maps per batch of 2"):
        vc.map_many(model, images, [RECIPE], path, targets=targets, batch_size=2, max_bytes=10, progress=False)
    assert not path.exists()
    # what the store then holds: one map of that many cells per image
    vc.map_many(model, images, [RECIPE], path, targets=targets, batch_size=2, progress=False)
    maps = vc.open_maps(path)["maps"]
    assert maps.dtype == np.float32 and int(np.prod(maps.shape[-2:])) == cells and maps.shape[0] == 2


def test_other_models_are_counted_on_the_patch_their_description_states():
    import timm
    from transformers import ViTConfig, ViTForImageClassification

    from vitcam_nb.capture.plan import TracePlan
    from vitcam_nb.compute.map_sizes import _cells

    torch.manual_seed(0)
    hf = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, image_size=32, patch_size=8, num_labels=3)).eval()
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
    swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1, 1, 1))
    for model, hw, cells in ((hf, (32, 32), 4 * 4), (vit, (32, 32), 4 * 4), (swin, (224, 224), 56 * 56)):
        assert _cells(TracePlan.for_trace(model, "top1"), hw) == cells, type(model).__name__
