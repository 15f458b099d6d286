"""A tiny LLaVA answer trace with decoded answer tokens, for the Explorer's answer-token picker tests (the kernel
widget in tests/unit/face, the exported page in tests/ui): the model of tests/unit/model/test_vlm_llava.py (a CLIP
tower of 3 layers, width 32, on 32 px with 8 px patches; a 2-layer Llama of width 32 over 64 tokens), and a
tokenizer whose decoded tokens include markup, so every page that lists them is checked to show them as text."""

from __future__ import annotations

import torch

import vitcam_nb as vc

IMAGE_ID, GRID = 63, 4  # the placeholder id (inside the 64-token vocabulary); 32 px / patch 8
PROMPT = [1, 5, 6] + [IMAGE_ID] * GRID * GRID + [7, 8]
ANSWER = [9, 10, 11]
HOSTILE = "<img src=x onerror=alert(1)></script>"
WORDS = {9: "red", 10: HOSTILE, 11: "&amp; circle"}
LM_LAYERS = 2


class Tokenizer:
    """What vc.targets.answer reads from a tokenizer: decode([id]) -> text."""

    def decode(self, ids):
        return " ".join(WORDS.get(int(i), f"w{int(i)}") for i in ids)


def make_llava(lm_layers: int = LM_LAYERS) -> torch.nn.Module:
    """The tiny random LLaVA (seed 0; sdpa attention, switched to eager by the trace); ``lm_layers``: the Llama's
    depth (4: deeper than the 3-block tower, as LLaVA-1.5's 32 LM layers over 24 tower blocks)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    v = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         image_size=32, patch_size=8, projection_dim=32)
    t = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=lm_layers, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
    cfg = LlavaConfig(vision_config=v, text_config=t, image_token_id=IMAGE_ID, vision_feature_layer=-2)
    return LlavaForConditionalGeneration(cfg).eval()


def answer_trace(sites=("F1", "F6", "projector", "lm_resid", "lm_attn"), lm_layers: int = LM_LAYERS):
    """The answer ANSWER to PROMPT, traced on a fixed random image at ``sites``."""
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER, tokenizer=Tokenizer())
    return vc.trace(make_llava(lm_layers), x, targets=target, sites=list(sites))
