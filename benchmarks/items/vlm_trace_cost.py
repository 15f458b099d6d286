"""Item: ``vc.trace`` of a generative VLM's answer against one forward + one batched backward (issue 55, target
<= 1.2), on a tiny random LLaVA built in code (CLIP tower 3 layers width 32 on 32 px, Llama 2 layers width 32).

The baseline is what a hand-written Grad-CAM of every answer token costs at least: the model as given, one forward
pass teacher-forcing the answer, and one ``torch.autograd.grad`` batched over the same outputs the trace
differentiates (each answer token's logit, the sequence log-prob and the expected score), with respect to the
input and every tower layer's output. Run it alone with ``python -m benchmarks.items.vlm_trace_cost``; it is not
in :mod:`benchmarks.suite` yet.
"""

from __future__ import annotations

import json

import torch

from benchmarks.timing import interleave, stats

IMAGE_ID, GRID = 63, 4
PROMPT = [1, 5, 6] + [IMAGE_ID] * GRID * GRID + [7, 8]
ANSWER = [9, 10, 11]


def tiny_llava(seed: int = 0) -> torch.nn.Module:
    """The tiny random LLaVA of ``tests/unit/model/test_vlm_llava.py``.

    Example:
        >>> type(tiny_llava()).__name__
        'LlavaForConditionalGeneration'
    """
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    v = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         image_size=32, patch_size=8, projection_dim=32)
    t = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=v, text_config=t, image_token_id=IMAGE_ID,
                                                     vision_feature_layer=-2)).eval()


def baseline(model: torch.nn.Module, x: torch.Tensor) -> None:
    """One forward teacher-forcing the answer, one batched backward of the traced outputs."""
    kept: list[torch.Tensor] = []
    handles = [layer.register_forward_hook(lambda _m, _i, o: kept.append(o[0] if isinstance(o, tuple) else o))
               for layer in model.model.vision_tower.encoder.layers]
    seq = torch.tensor([PROMPT + ANSWER])
    xg = x.clone().requires_grad_(True)
    try:
        logits = model(input_ids=seq, pixel_values=xg, use_cache=False).logits[0]
    finally:
        for h in handles:
            h.remove()
    rows, ids = torch.arange(len(PROMPT), len(seq[0])) - 1, torch.tensor(ANSWER)
    z = logits[rows].gather(1, ids[:, None])[:, 0]
    z = torch.cat([z, torch.log_softmax(logits[rows], -1).gather(1, ids[:, None]).sum()[None]])
    outputs = torch.cat([z, (torch.softmax(z.detach(), 0) * z).sum()[None]])
    eye = torch.eye(len(outputs))
    torch.autograd.grad(outputs, [xg, *kept], eye, is_grads_batched=True, allow_unused=True)


def bench_vlm_trace_cost(repeats: int = 15) -> dict:
    """Median seconds of ``vc.trace`` (every site: tower F1..F6, projector, lm_resid, lm_attn) and of the
    baseline, interleaved, and their ratio.

    Example:
        >>> bench_vlm_trace_cost(repeats=1)["ratio"] > 0  # doctest: +SKIP
        True
    """
    import vitcam_nb as vc

    model, x = tiny_llava(), torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)
    samples = interleave({"trace": lambda: vc.trace(model, x, targets=target),
                          "baseline": lambda: baseline(model, x)}, repeats)
    out = {k: stats(v, samples.cpu.get(k)) for k, v in samples.items()}
    return {**out, "ratio": out["trace"]["median_s"] / out["baseline"]["median_s"], "target": 1.2,
            "workload": "tiny LLaVA (CLIP 3x32 on 32 px, Llama 2x32), 16 image tokens, 3 answer tokens"}


if __name__ == "__main__":
    print(json.dumps(bench_vlm_trace_cost(), indent=1))
