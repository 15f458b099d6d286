"""Detector and video families' trace cost (issue #37, item 5): ``vc.trace`` against its autograd floor for one
detector (YOLOS) and one video family (VideoMAE), rounds interleaved in one run; target: trace / floor <= 1.2.

Run:  ``python -m benchmarks.items.families [--rounds N] [--device cuda] [--out FILE]`` (writes
``benchmarks/FAMILIES.json``; ``--quick``: 2-layer 32 px configs, one round, no claims, written under
``benchmarks/results/``). Both models are random-init Hugging Face configs with eager attention (timing does not
depend on the weights; the trace runs F2 in eager attention, so the floor does too):

- YOLOS-small-like: hidden 384, 12 layers, 6 heads, MLP 1536, 224 x 224 px, 16 px patches, 100 detection tokens
  (297 tokens); targets: ``vc.targets.detection(query=[0..4], class_=1)``, five detection logits and the expected
  score (6 gradients).
- VideoMAE-small-like: hidden 384, 12 layers, 6 heads, MLP 1536, 8 frames of 112 x 112 px, tubelets 2 x 16 x 16
  (4 x 7 x 7 = 196 tokens; 16 frames at 224 px is 1568 tokens, too heavy for a one-minute item); targets
  ``"top5"`` of 400 classes and the expected logit (6 gradients).

The floor is one forward with hooks on the same modules the trace reads (its ``hook_F1`` .. ``hook_F6``
attributes; F2 is the attention probabilities, which the floor reads from ``output_attentions``), then one
``torch.autograd.grad`` per target scalar w.r.t. all of them with ``retain_graph=True``: what any tool that keeps
these tensors and their gradients must at least do.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import machine_info, versions
from benchmarks.timing import interleave, paired_ratio

TARGET = 1.2
ROOT = Path(__file__).resolve().parent.parent
K = 5
SMALL = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536)
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def yolos(quick: bool) -> tuple[torch.nn.Module, torch.Tensor, Any, str]:
    """A random-init YOLOS, its input, the trace's targets and the config in words.

    Example:
        >>> model, x, targets, text = yolos(quick=True)
        >>> tuple(x.shape)
        (1, 3, 32, 32)
    """
    import transformers

    import vitcam_nb as vc

    size, patch, det = (32, 8, 5) if quick else (224, 16, 100)
    cfg = transformers.YolosConfig(**(TINY if quick else SMALL), image_size=[size, size], patch_size=patch,
                                   num_detection_tokens=det, num_labels=91, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.YolosForObjectDetection(cfg).eval()
    x = torch.randn((1, 3, size, size), generator=torch.Generator().manual_seed(1))
    text = f"YOLOS random init, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {size} px, {det} detections"
    return model, x, vc.targets.detection(query=list(range(K)), class_=1), text


def videomae(quick: bool) -> tuple[torch.nn.Module, torch.Tensor, Any, str]:
    """A random-init VideoMAE, its clip, the trace's targets and the config in words.

    Example:
        >>> model, x, targets, text = videomae(quick=True)
        >>> tuple(x.shape), targets
        ((1, 4, 3, 32, 32), 'top5')
    """
    import transformers

    frames, size, patch = (4, 32, 8) if quick else (8, 112, 16)
    cfg = transformers.VideoMAEConfig(**(TINY if quick else SMALL), image_size=size, patch_size=patch,
                                      num_frames=frames, tubelet_size=2, num_labels=400, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.VideoMAEForVideoClassification(cfg).eval()
    x = torch.randn((1, frames, 3, size, size), generator=torch.Generator().manual_seed(1))
    text = (f"VideoMAE random init, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {frames} frames of "
            f"{size} px, tubelets 2x{patch}x{patch}")
    return model, x, f"top{K}", text


def _hooks(model: torch.nn.Module, attrs: dict, n_layers: int, keep: list[torch.Tensor]) -> list:
    """Forward hooks on every module a trace's ``hook_<site>`` attributes name (F2 excepted), keeping each
    tensor in ``keep``."""
    handles = []
    for site in ("F1", "F3", "F4", "F5", "F6"):
        path, where = str(attrs[f"hook_{site}"]).rsplit(":", 1)
        for layer in range(n_layers):
            module = model.get_submodule(path.format(layer=layer).rstrip("."))
            if where == "input":
                handles.append(module.register_forward_pre_hook(lambda _m, args: keep.append(args[0])))
            else:
                handles.append(module.register_forward_hook(
                    lambda _m, _a, out: keep.append(out[0] if isinstance(out, tuple) else out)))
    return handles


def floor(model: torch.nn.Module, inputs: dict, attrs: dict, n_layers: int,
          scalars: Callable[[Any], list[torch.Tensor]]) -> list:
    """One forward keeping the trace's tensors (F2 from ``output_attentions``), then one ``autograd.grad`` per
    target scalar w.r.t. all of them.

    Example:
        >>> floor(model, {"pixel_values": x}, tr.attrs, 12, lambda out: [out.logits[0, 0]])  # doctest: +SKIP
    """
    keep: list[torch.Tensor] = []
    handles = _hooks(model, attrs, n_layers, keep)
    try:
        with torch.enable_grad():
            out = model(**inputs, output_attentions=True)
            tensors = keep + list(out.attentions)
            return [torch.autograd.grad(s, tensors, retain_graph=True) for s in scalars(out)]
    finally:
        for h in handles:
            h.remove()


def _detection_scalars(out: Any) -> list[torch.Tensor]:
    z = out.logits[0]
    p = torch.softmax(z[:K], dim=-1).detach()
    return [z[q, 1] for q in range(K)] + [(p * z[:K]).sum()]


def _class_scalars(out: Any) -> list[torch.Tensor]:
    z = out.logits[0]
    top = torch.topk(z.detach(), K).indices
    return [z[c] for c in top] + [(torch.softmax(z, -1).detach() * z).sum()]


def measure(build: Callable, scalars: Callable, rounds: int, device: str, quick: bool) -> dict:
    """One family: ``vc.trace`` and its floor, interleaved; medians and the paired ratio.

    Example:
        >>> measure(yolos, _detection_scalars, 1, "cpu", True)["tokens"]  # doctest: +SKIP
        22
    """
    import vitcam_nb as vc

    model, x, targets, text = build(quick)
    model = model.to(device)
    tr = vc.trace(model, x, targets=targets, device=device)  # warm-up; its hooks name the floor's modules
    n_layers = int(model.config.num_hidden_layers)
    pixels = x.to(device)  # the model's pixel_values: (1, 3, H, W), or one clip (1, T, 3, H, W)
    candidates = {"trace": lambda: vc.trace(model, x, targets=targets, device=device),
                  "floor": lambda: floor(model, {"pixel_values": pixels}, tr.attrs, n_layers, scalars)}
    candidates["floor"]()
    samples = interleave(candidates, rounds, device)
    ratio = paired_ratio(samples["trace"], samples["floor"])
    return {"config": text, "tokens": int(tr.sizes["token"]), "targets": [str(t) for t in tr["target"].values],
            "trace": samples.stats("trace"), "floor": samples.stats("floor"), "ratio": ratio,
            "holds": bool(ratio <= TARGET)}


def run(rounds: int = 5, device: str = "cpu", quick: bool = False) -> dict:
    """Interleaved rounds of ``vc.trace`` and its floor per family; medians and paired ratios.

    Example:
        >>> run(rounds=1, quick=True)["families"]["hf_yolos"]["ratio"] > 0  # doctest: +SKIP
        True
    """
    import vitcam_nb as vc

    warnings.simplefilter("ignore", vc.DegenerateMapWarning)
    started = machine_info(device)
    out: dict = {"rounds": rounds, "device": device, "families": {
        "hf_yolos": measure(yolos, _detection_scalars, rounds, device, quick),
        "hf_videomae": measure(videomae, _class_scalars, rounds, device, quick)}}
    out.update(target=f"trace / autograd floor <= {TARGET}",
               holds=all(f["holds"] for f in out["families"].values()), machine=started,
               load_average_end=list(os.getloadavg()) if hasattr(os, "getloadavg") else None, versions=versions(),
               date=_dt.date.today().isoformat(),
               note="one run; read the ratios (each round measured side by side), not the absolute times")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: measure, print the JSON and write it to ``--out``.

    Example:
        >>> main(["--quick", "--out", "/tmp/families.json"])  # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.items.families", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="2-layer 32 px configs, one round, no claims")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/FAMILIES.json (quick: "
                   "benchmarks/results/families-quick.json)")
    args = p.parse_args(argv)
    out = args.out or (ROOT / "results" / "families-quick.json" if args.quick else ROOT / "FAMILIES.json")
    result = run(1 if args.quick else args.rounds, args.device, args.quick)
    result["command"] = "python -m benchmarks.items.families " + " ".join(sys.argv[1:] if argv is None else argv)
    result["quick"] = bool(args.quick)
    text = json.dumps(result, indent=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
