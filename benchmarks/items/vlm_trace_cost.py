"""Item: ``vc.trace`` of a generative VLM's answer against one forward + one batched backward (issue 55, target
<= 1.2), on a tiny random LLaVA built in code (CLIP tower 3 layers width 32 on 32 px, Llama 2 layers width 32) and a
tiny random Qwen2-VL (``tests/vlm_qwen_tiny.py``: tower 3 blocks width 32, 2x2 merge, 84x140 px; Qwen2 2 layers
width 32), side by side in one run.

The baseline is what a hand-written Grad-CAM of every answer token costs at least: the model as given, one forward
pass teacher-forcing the answer, and one ``torch.autograd.grad`` batched over the same outputs the trace
differentiates (each answer token's logit, the sequence log-prob, each answer position's logsumexp over the
vocabulary and the expected score), with respect to the input and every tower layer's output. A third row does the
same on a tiny random PaliGemma (SigLIP 3 layers width 32 on 32 px, Gemma 2 layers width 32; image tokens first),
and a fourth on a "small" LLaVA (CLIP tower 6 layers width 256 on 224 px with 16 px patches: 196 image tokens; Llama
4 layers width 256), so the ratio's dependence on model size is measured: the trace's fixed per-call costs (hooks,
graph walk, assembly of the Dataset) weigh on a 10-ms model and vanish on a larger one.
Every candidate of every row is timed in one interleaved loop (the order rotated each round), so each ratio's two
sides ran under the same load; ``ratio`` is the median over rounds of trace / baseline of that round
(``ratio_of_medians`` beside it), and the machine's load average before and after is recorded. The Qwen2-VL row
runs once its family is registered (:func:`vitcam_nb.adapters.hf_vlm.register_vlm_family`) and its tiny builder
exists; until then it says "not registered yet". In :mod:`benchmarks.suite` as item ``vlm_trace_cost`` (writes
``benchmarks/VLM_TRACE_COST.json``); alone: ``python -m benchmarks.items.vlm_trace_cost [--repeats N] [--threads N]
[--quick] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import machine_info, versions
from benchmarks.timing import interleave, paired_ratio, stats

ROOT = Path(__file__).resolve().parent.parent

IMAGE_ID, GRID = 63, 4
PROMPT = [1, 5, 6] + [IMAGE_ID] * GRID * GRID + [7, 8]
ANSWER = [9, 10, 11]
PALI_IMAGE_ID = 5
PALI_PROMPT = [PALI_IMAGE_ID] * GRID * GRID + [2, 7, 8]


def tiny_llava(seed: int = 0, *, width: int = 32, tower_layers: int = 3, lm_layers: int = 2, image_size: int = 32,
               patch_size: int = 8) -> torch.nn.Module:
    """The tiny random LLaVA of ``tests/unit/model/test_vlm_llava.py`` (by default), or a larger one of the same
    shape (the "small" row: width 256, a 6-layer tower on 224 px with 16 px patches, a 4-layer Llama).

    Example:
        >>> type(tiny_llava()).__name__
        'LlavaForConditionalGeneration'
    """
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    v = CLIPVisionConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=tower_layers,
                         num_attention_heads=4, image_size=image_size, patch_size=patch_size, projection_dim=width)
    t = LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=lm_layers,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                    max_position_embeddings=128 if image_size <= 64 else 512)
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
    inner = model.model
    if hasattr(inner, "visual"):  # Qwen2-VL: the tower's blocks over the packed patches
        return inner.visual.blocks
    tower = inner.vision_tower
    return (tower.vision_model if hasattr(tower, "vision_model") else tower).encoder.layers


def baseline(model: torch.nn.Module, x: torch.Tensor, prompt: list[int] = PROMPT,
             model_kwargs: Mapping[str, Any] | None = None, answer: list[int] = ANSWER) -> None:
    """One forward teacher-forcing the answer, one batched backward of the traced outputs."""
    kept: list[torch.Tensor] = []
    handles = [layer.register_forward_hook(lambda _m, _i, o: kept.append(o[0] if isinstance(o, tuple) else o))
               for layer in _tower_layers(model)]
    seq = torch.tensor([prompt + answer])
    xg = x.clone().requires_grad_(True)
    extra = dict(model_kwargs or {})
    # The token types the family's processor gives, as the trace passes them (PaliGemma's prefix bidirectional and
    # answer causal; Qwen2-VL's mm_token_type_ids for M-RoPE)
    from vitcam_nb.adapters.hf_vlm import vlm_family_of

    fam = vlm_family_of(model)
    key = getattr(fam, "token_types_key", "token_type_ids")
    if fam.token_types is not None and key not in extra:
        extra[key] = fam.token_types(model, seq[0], len(prompt))[None]
    try:
        logits = model(input_ids=seq, pixel_values=xg, attention_mask=torch.ones_like(seq), use_cache=False,
                       **extra).logits[0]
    finally:
        for h in handles:
            h.remove()
    rows, ids = torch.arange(len(prompt), len(seq[0])) - 1, torch.tensor(answer)
    z = logits[rows].gather(1, ids[:, None])[:, 0]
    lse = torch.logsumexp(logits[rows], -1)
    z = torch.cat([z, (z - lse).sum()[None], lse])
    outputs = torch.cat([z, (torch.softmax(z.detach(), 0) * z).sum()[None]])
    eye = torch.eye(len(outputs))
    torch.autograd.grad(outputs, [xg, *kept], eye, is_grads_batched=True, allow_unused=True)


#: A row: (model, input, answer target, prompt ids, answer ids, workload) or the reason it does not run.
Row = tuple[torch.nn.Module, torch.Tensor, Any, list[int], list[int], str]


def _llava() -> Row:
    import vitcam_nb as vc

    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return (tiny_llava(), x, vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER), PROMPT, ANSWER,
            "tiny LLaVA (CLIP 3x32 on 32 px, Llama 2x32), 16 image tokens, 3 answer tokens")


SMALL_GRID = 14
SMALL_PROMPT = [1, 5, 6] + [IMAGE_ID] * SMALL_GRID * SMALL_GRID + [7, 8]


def _llava_small() -> Row:
    import vitcam_nb as vc

    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    model = tiny_llava(width=256, tower_layers=6, lm_layers=4, image_size=224, patch_size=16)
    return (model, x, vc.targets.answer(input_ids=SMALL_PROMPT, answer_ids=ANSWER), SMALL_PROMPT, ANSWER,
            "small LLaVA (CLIP 6x256 on 224 px, 16 px patches, Llama 4x256), 196 image tokens, 3 answer tokens")


def _paligemma() -> Row:
    import vitcam_nb as vc

    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return (tiny_paligemma(), x, vc.targets.answer(input_ids=PALI_PROMPT, answer_ids=ANSWER), PALI_PROMPT, ANSWER,
            "tiny PaliGemma (SigLIP 3x32 on 32 px, Gemma 2x32), 16 image tokens first, 3 answer tokens")


def _qwen2_vl() -> Row | str:
    """The tiny Qwen2-VL of ``tests/vlm_qwen_tiny.py``, or why its row does not run yet."""
    import vitcam_nb.adapters  # noqa: F401  (registers the families of their own modules)
    from vitcam_nb.adapters.hf_vlm import VLM_FAMILIES

    if not any("Qwen2VLForConditionalGeneration" in fam.classes for fam in VLM_FAMILIES.values()):
        return "not registered yet: no VLM family row reads Qwen2VLForConditionalGeneration in this checkout"
    tests = str(ROOT.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    try:
        from vlm_qwen_tiny import tiny_qwen
    except ImportError:
        return "not registered yet: the family is registered but tests/vlm_qwen_tiny.py (its tiny builder) is missing"
    model, pixel_values, target = tiny_qwen("qwen2")
    return (model, pixel_values, target, [int(i) for i in target.input_ids], [int(i) for i in target.answer_ids],
            "tiny Qwen2-VL (tower 3x32, 14 px patches, 2x2 merge, 84x140 px: 60 patches, 15 image tokens; Qwen2 "
            "2x32), 3 answer tokens")


ROWS: dict[str, Callable[[], Row | str]] = {"llava": _llava, "qwen2_vl": _qwen2_vl, "paligemma": _paligemma,
                                            "llava_small": _llava_small}


def bench_vlm_trace_cost(repeats: int = 15, rows: list[str] | None = None) -> dict:
    """Median seconds of ``vc.trace`` (every site: tower F1..F6, projector, lm_resid, lm_attn) and of the
    baseline per tiny model, all interleaved in one loop, and their ratio (median of the per-round ratios).

    Example:
        >>> bench_vlm_trace_cost(repeats=1)["llava"]["ratio"] > 0  # doctest: +SKIP
        True
    """
    import vitcam_nb as vc

    built = {name: ROWS[name]() for name in (rows or list(ROWS))}
    candidates: dict[str, Callable[[], object]] = {}
    for name, row in built.items():
        if isinstance(row, str):
            continue
        model, x, target, prompt, answer, _ = row
        kwargs = getattr(target, "model_kwargs", None)
        candidates[f"{name}/trace"] = lambda m=model, x=x, t=target: vc.trace(m, x, targets=t)
        candidates[f"{name}/baseline"] = lambda m=model, x=x, p=prompt, k=kwargs, a=answer: baseline(m, x, p, k, a)
    samples = interleave(candidates, repeats) if candidates else {}
    out: dict[str, dict] = {}
    for name, row in built.items():
        if isinstance(row, str):
            out[name] = {"status": row, "target": 1.2}
            continue
        trace, base = samples[f"{name}/trace"], samples[f"{name}/baseline"]
        t, b = stats(trace, samples.cpu[f"{name}/trace"]), stats(base, samples.cpu[f"{name}/baseline"])
        out[name] = {"trace": t, "baseline": b, "ratio": paired_ratio(trace, base),
                     "ratio_of_medians": t["median_s"] / b["median_s"],
                     "cpu_ratio": t["cpu_median_s"] / b["cpu_median_s"], "target": 1.2, "workload": row[5]}
    return out


def _load() -> list[float] | None:
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None


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
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before timing (default: "
                   "torch's own); recorded either way")
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=None, help="only these rows")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/VLM_TRACE_COST.json (quick: "
                   "benchmarks/results/vlm_trace_cost-quick.json)")
    args = p.parse_args(argv)
    out = args.out or (ROOT / "results" / "vlm_trace_cost-quick.json" if args.quick else
                       ROOT / "VLM_TRACE_COST.json")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_start = _load()
    rows = bench_vlm_trace_cost(1 if args.quick else args.repeats, args.rows)
    result = {"item": "vlm_trace_cost", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info("cpu"), "versions": versions(), "quick": bool(args.quick),
              "torch_threads": torch.get_num_threads(), "load_average_start": load_start,
              "load_average_end": _load(), "rows": rows,
              "command": "python -m benchmarks.items.vlm_trace_cost " + " ".join(sys.argv[1:] if argv is None
                                                                                  else argv)}
    text = json.dumps(result, indent=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
