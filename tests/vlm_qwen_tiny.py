"""A tiny random Qwen2-VL / Qwen2.5-VL built in code (no hub) and its inputs, for the Qwen VLM tests and the
benchmark row: a 3-block tower of width 32 on 14 px patches (2x2 merge; Qwen2.5-VL: 56 px windows, block 2 full
attention), a 2-layer LM of width 32 with M-RoPE, a 64-token vocabulary; an 84x140 px image (6x10 patches, 3x5
image tokens, so Qwen2.5-VL's windows are partial) through the real ``Qwen2VLImageProcessor``.

    >>> model, pixel_values, target = tiny_qwen("qwen2")  # doctest: +SKIP
    >>> vc.trace(model, pixel_values, targets=target, sites=["F1", "lm_resid"])  # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
import torch

IMG, VIDEO, START, END, PATCH, W = 5, 6, 7, 8, 14, 32
SIZE = (84, 140)  # px: 6x10 patches, 3x5 merged image tokens
N_IMAGE_TOKENS = (SIZE[0] // 28) * (SIZE[1] // 28)
PROMPT = [1, 3, START] + [IMG] * N_IMAGE_TOKENS + [END, 4, 9]
ANSWER = [10, 11, 12]


def make_model(kind: str = "qwen2", seed: int = 0) -> torch.nn.Module:
    """The tiny model, ``kind`` "qwen2" (Qwen2VLForConditionalGeneration) or "qwen2_5"; sdpa attention, eval."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = dict(vocab_size=64, hidden_size=W, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, bos_token_id=1, eos_token_id=2, rope_parameters=rope)
    common = dict(depth=3, num_heads=2, patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2)
    tokens = dict(image_token_id=IMG, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if kind == "qwen2":
        cfg = Qwen2VLConfig(vision_config=dict(embed_dim=W, hidden_size=W, mlp_ratio=2, **common), text_config=text,
                            **tokens)
        cls = Qwen2VLForConditionalGeneration
    elif kind == "qwen2_5":
        cfg = Qwen2_5_VLConfig(vision_config=dict(hidden_size=W, out_hidden_size=W, intermediate_size=64,
                                                  window_size=56, fullatt_block_indexes=[2], **common),
                               text_config=text, **tokens)
        cls = Qwen2_5_VLForConditionalGeneration
    else:
        from vitcam_nb.core.errors import ArgumentError

        raise ArgumentError(f"kind: 'qwen2' or 'qwen2_5', got {kind!r}")
    torch.manual_seed(seed)
    return cls(cfg).eval()


def processor():
    """Qwen2-VL's image processor, no resizing (the image is a multiple of 28 px already)."""
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(do_resize=False)


def make_image(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*SIZE, 3), dtype=np.uint8)


def make_inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(pixel_values (60, 1176), image_grid_thw [[1, 6, 10]], the uint8 image) from the real image processor."""
    img = make_image(seed)
    out = processor()(images=[img], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"], img


def tiny_qwen(kind: str = "qwen2", seed: int = 0):
    """(model, pixel_values, answer target) of one trace: ``vc.trace(model, pixel_values, targets=target)``."""
    import vitcam_nb as vc

    pv, thw, _ = make_inputs()
    target = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER, model_kwargs={"image_grid_thw": thw})
    return make_model(kind, seed), pv, target
