"""Item: ``vc.trace`` of a generative VLM's answer against one forward + one batched backward (issue 55, target
<= 1.2), on a tiny random LLaVA built in code (CLIP tower 3 layers width 32 on 32 px, Llama 2 layers width 32).

The baseline is what a hand-written Grad-CAM of every answer token costs at least: the model as given, one forward
pass teacher-forcing the answer, and one ``torch.autograd.grad`` batched over the same outputs the trace
differentiates (each answer token's logit, the sequence log-prob, each answer position's logsumexp over the
vocabulary and the expected score), with respect to the input and every tower layer's output. A second row does
the same on a tiny random PaliGemma (SigLIP 3 layers width 32 on 32 px, Gemma 2 layers width 32; image tokens
first). In :mod:`benchmarks.suite` as item ``vlm_trace_cost`` (writes ``benchmarks/VLM_TRACE_COST.json``); alone:
``python -m benchmarks.items.vlm_trace_cost [--repeats N] [--quick] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

import torch

from benchmarks.machine import machine_info, versions
from benchmarks.timing import interleave, stats

ROOT = Path(__file__).resolve().parent.parent

IMAGE_ID, GRID = 63, 4
PROMPT = [1, 5, 6] + [IMAGE_ID] * GRID * GRID + [7, 8]
ANSWER = [9, 10, 11]
PALI_IMAGE_ID = 5
PALI_PROMPT = [PALI_IMAGE_ID] * GRID * GRID + [2, 7, 8]


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


def tiny_paligemma(seed: int = 0) -> torch.nn.Module:
    """The tiny random PaliGemma of ``tests/unit/model/test_vlm_gemma_families.py``.

    Example:
        >>> type(tiny_paligemma()).__name__
        'PaliGemmaForConditionalGeneration'
    """
    from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(seed)
    v = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                           image_size=32, patch_size=8)
    t = GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16)
    return PaliGemmaForConditionalGeneration(PaliGemmaConfig(vision_config=v, text_config=t,
                                                             image_token_index=PALI_IMAGE_ID,
                                                             projection_dim=32)).eval()


def _tower_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    tower = model.model.vision_tower
    return (tower.vision_model if hasattr(tower, "vision_model") else tower).encoder.layers


def baseline(model: torch.nn.Module, x: torch.Tensor, prompt: list[int] = PROMPT) -> None:
    """One forward teacher-forcing the answer, one batched backward of the traced outputs."""
    kept: list[torch.Tensor] = []
    handles = [layer.register_forward_hook(lambda _m, _i, o: kept.append(o[0] if isinstance(o, tuple) else o))
               for layer in _tower_layers(model)]
    seq = torch.tensor([prompt + ANSWER])
    xg = x.clone().requires_grad_(True)
    # PaliGemma: the token types its processor gives (prefix bidirectional, answer causal), as the trace does
    types = {"token_type_ids": torch.tensor([[0] * len(prompt) + [1] * len(ANSWER)])} \
        if type(model).__name__.startswith("PaliGemma") else {}
    try:
        logits = model(input_ids=seq, pixel_values=xg, use_cache=False, **types).logits[0]
    finally:
        for h in handles:
            h.remove()
    rows, ids = torch.arange(len(prompt), len(seq[0])) - 1, torch.tensor(ANSWER)
    z = logits[rows].gather(1, ids[:, None])[:, 0]
    lse = torch.logsumexp(logits[rows], -1)
    z = torch.cat([z, (z - lse).sum()[None], lse])
    outputs = torch.cat([z, (torch.softmax(z.detach(), 0) * z).sum()[None]])
    eye = torch.eye(len(outputs))
    torch.autograd.grad(outputs, [xg, *kept], eye, is_grads_batched=True, allow_unused=True)


def _row(model: torch.nn.Module, prompt: list[int], repeats: int, workload: str) -> dict:
    import vitcam_nb as vc

    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vc.targets.answer(input_ids=prompt, answer_ids=ANSWER)
    samples = interleave({"trace": lambda: vc.trace(model, x, targets=target),
                          "baseline": lambda: baseline(model, x, prompt)}, repeats)
    out = {k: stats(v, samples.cpu.get(k)) for k, v in samples.items()}
    return {**out, "ratio": out["trace"]["median_s"] / out["baseline"]["median_s"], "target": 1.2,
            "workload": workload}


def bench_vlm_trace_cost(repeats: int = 15) -> dict:
    """Median seconds of ``vc.trace`` (every site: tower F1..F6, projector, lm_resid, lm_attn) and of the
    baseline, interleaved, and their ratio, per tiny model.

    Example:
        >>> bench_vlm_trace_cost(repeats=1)["llava"]["ratio"] > 0  # doctest: +SKIP
        True
    """
    return {"llava": _row(tiny_llava(), PROMPT, repeats, "tiny LLaVA (CLIP 3x32 on 32 px, Llama 2x32), 16 image "
                          "tokens, 3 answer tokens"),
            "paligemma": _row(tiny_paligemma(), PALI_PROMPT, repeats, "tiny PaliGemma (SigLIP 3x32 on 32 px, "
                              "Gemma 2x32), 16 image tokens first, 3 answer tokens")}


def main(argv: list[str] | None = None) -> int:
    """Command line: measure, print the JSON and write it to ``--out`` (the suite's item ``vlm_trace_cost``).

    Example:
        >>> main(["--quick", "--out", "/tmp/vlm_trace_cost.json"])  # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.items.vlm_trace_cost",
                                description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="one repeat, no claims")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/VLM_TRACE_COST.json (quick: "
                   "benchmarks/results/vlm_trace_cost-quick.json)")
    args = p.parse_args(argv)
    out = args.out or (ROOT / "results" / "vlm_trace_cost-quick.json" if args.quick else
                       ROOT / "VLM_TRACE_COST.json")
    result = {"item": "vlm_trace_cost", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info("cpu"), "versions": versions(), "quick": bool(args.quick),
              "rows": bench_vlm_trace_cost(1 if args.quick else args.repeats),
              "command": "python -m benchmarks.items.vlm_trace_cost " + " ".join(sys.argv[1:] if argv is None
                                                                                  else argv)}
    text = json.dumps(result, indent=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
