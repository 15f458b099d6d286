"""Measured memory of one trace against :func:`vitcam_nb.estimate`: the Dataset's size and the peak resident
memory of the pass, for three large cases (ViT-B/16 at 224 and 384 px, DINOv2-S at 518 px, top5) and
five held-out ones (other target counts, float16 storage, one layer and site, other widths), two more float16
ones (ViT-S/16 top3, ViT-Ti/16 at 384 px top10: the array pass float16 storage takes), and a hierarchical
Swin-T at 224 px, random-init timm models (no download), each in three fresh processes one after the other (the
median peak; :data:`RUNS`), and the model's forward pass alone beside it. Writes
``benchmarks/MEMORY.json`` and, with ``--readme``, the table of ``docs/performance.md`` between
``<!-- memory:start -->`` and ``<!-- memory:end -->``.

Usage::

    python -m benchmarks.memsizes                 # measure every case (several GB each), write MEMORY.json
    python -m benchmarks.memsizes --case vitb224  # one case, printed as JSON
    python -m benchmarks.memsizes --case vitb224 --forward  # its model's forward pass alone (the floor), JSON
    python -m benchmarks.memsizes --case swint224 --write  # one case (fresh processes), its row put in MEMORY.json
    python -m benchmarks.memsizes --readme        # README table from MEMORY.json
    python -m benchmarks.memsizes --blip 224      # random-init BLIP-base ITM at 224 px (not in MEMORY.json), JSON
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "MEMORY.json"
# case: timm name, model kwargs, input size, label, targets, other trace arguments
CASES = {
    "vitb224": ("vit_base_patch16_224", {}, 224, "ViT-B/16", "top5", {}),
    "vitb384": ("vit_base_patch16_384", {}, 384, "ViT-B/16", "top5", {}),
    "dinov2s518": ("vit_small_patch14_dinov2", {"num_classes": 1000}, 518, "DINOv2-S/14", "top5", {}),
    "vitb224_top1": ("vit_base_patch16_224", {}, 224, "ViT-B/16", "top1", {}),
    "vitb224_f16": ("vit_base_patch16_224", {}, 224, "ViT-B/16", "top5", {"dtype": "float16"}),
    "vitb224_last_f1": ("vit_base_patch16_224", {}, 224, "ViT-B/16", "top5", {"layers": [-1], "sites": ["F1"]}),
    "vits224_top3_f1f2": ("vit_small_patch16_224", {}, 224, "ViT-S/16", "top3", {"sites": ["F1", "F2"]}),
    "vits224_top3_f16": ("vit_small_patch16_224", {}, 224, "ViT-S/16", "top3", {"dtype": "float16"}),
    "vitt384_top10": ("vit_tiny_patch16_384", {}, 384, "ViT-Ti/16", "top10", {}),
    "vitt384_top10_f16": ("vit_tiny_patch16_384", {}, 384, "ViT-Ti/16", "top10", {"dtype": "float16"}),
    # hierarchical: four stage grids, windowed attention stored per window with its key coordinate
    "swint224": ("swin_tiny_patch4_window7_224", {}, 224, "Swin-T", "top5", {}),
    "swint224_top2_f3f6": ("swin_tiny_patch4_window7_224", {}, 224, "Swin-T", "top2", {"sites": ["F3", "F6"]}),
}
START, END = "<!-- memory:start -->", "<!-- memory:end -->"


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _warm_up() -> None:
    """One torch thread, and a tiny trace first: lazy imports and first calls are not a case's memory."""
    import numpy as np
    import timm
    import torch

    import vitcam_nb as vc

    torch.set_num_threads(1)
    tiny = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1)
    vc.trace(tiny, np.zeros((32, 32, 3), np.uint8), targets="top1")


@contextlib.contextmanager
def _peak_rise() -> Iterator[list[int]]:
    """The rise of resident memory's high-water mark over the block, in bytes (the list's one item, on exit): the
    mark reset on entry, the rise measured from the resident memory then."""
    gc.collect()
    before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rise: list[int] = []
    yield rise
    rise.append((_kib("VmHWM") - before) * 1024)


def measure(case: str) -> dict:
    """One case in this process: the estimate, then the trace with its peak resident memory rise."""
    import numpy as np
    import timm

    import vitcam_nb as vc

    name, kwargs, size, label, targets, options = CASES[case]
    _warm_up()
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    image = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    est = vc.estimate(model, image, targets, **options)
    return {"case": case, "model": label, "timm_name": name, "input": size, "targets": targets,
            "options": ", ".join(f"{k}={v!r}" for k, v in options.items()), **_traced_peak(model, image, targets,
                                                                                          est, **options)}


def measure_forward(case: str) -> dict:
    """The floor under one case's trace, in this process: the resident-memory rise of the model's forward pass alone
    (no graph, nothing captured), after the same warm-up as :func:`measure`."""
    import timm
    import torch

    name, kwargs, size, *_ = CASES[case]
    _warm_up()
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    x = torch.randn(1, 3, size, size)
    with _peak_rise() as peak, torch.no_grad():
        model(x)
    return {"case": case, "forward_peak_bytes": peak[0]}


def _traced_peak(model: object, image: object, targets: object, est: dict, **options: object) -> dict:
    """Trace once, measuring the resident-memory rise from here; the Dataset and the estimate beside it."""
    import time

    import vitcam_nb as vc

    with _peak_rise() as rise:
        start = time.perf_counter()
        tr = vc.trace(model, image, targets, max_bytes=float("inf"), **options)
        seconds = time.perf_counter() - start
    peak = rise[0]
    return {"seconds": round(seconds, 1), "dataset_bytes": int(tr.nbytes), "peak_rise_bytes": int(peak),
            "estimate_dataset_bytes": est["dataset_bytes"], "estimate_peak_bytes": est["peak_bytes"],
            "peak_over_dataset": round(peak / tr.nbytes, 2), "pass": pass_mode(est), "torch_threads": 1}


def pass_mode(est: dict) -> str:
    """How the pass held its memory, as :func:`vitcam_nb.estimate` reports the mode the trace takes (in the words
    of a trace's ``memory_mode`` attribute)."""
    from vitcam_nb.capture.plan import memory_mode

    return memory_mode(bool(est.get("recompute")), int(est.get("target_groups", 1)))


def measure_blip(size: int) -> dict:
    """A random-init BLIP-base ITM (transformers' default config, vision input ``size``) and a 12-token text,
    all sites, in this process."""
    import numpy as np
    import torch
    import transformers

    import vitcam_nb as vc

    _warm_up()
    torch.manual_seed(0)
    model = transformers.BlipForImageTextRetrieval(transformers.BlipConfig(vision_config={"image_size": size})).eval()
    ids = torch.tensor([[101, *range(2000, 2010), 102]])
    target = vc.targets.itm(ids, torch.ones_like(ids))
    image = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    est = vc.estimate(model, image, target)
    return {"case": f"blip{size}", "model": "BLIP-base ITM", "input": size, "targets": "itm (12 tokens)",
            **_traced_peak(model, image, target, est)}


def table(rows: list[dict]) -> str:
    """The README table of measured sizes."""
    lines = ["| model | input | targets | other arguments | Dataset (measured / estimated) | peak RSS rise (measured / "
             "estimated) | peak / Dataset | the forward pass alone / Dataset | pass |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        floor = f"{r['forward_over_dataset']:.2f}" if "forward_over_dataset" in r else "-"
        lines.append(f"| {r['model']} | {r['input']} px | {r['targets']} | {r.get('options') or '-'} | "
                     f"{r['dataset_bytes'] / 1e9:.2f} / "
                     f"{r['estimate_dataset_bytes'] / 1e9:.2f} GB | {r['peak_rise_bytes'] / 1e9:.2f} / "
                     f"{r['estimate_peak_bytes'] / 1e9:.2f} GB | {r['peak_over_dataset']:.2f} | {floor} | "
                     f"{r.get('pass', '-')} |")
    return "\n".join(lines)


#: Fresh processes per case: a process's peak varies by a few percent from run to run (up to a tenth on the
#: smallest rows), so each row is the run with the median peak, and every run's peak is kept beside it.
RUNS = 3


def _fresh(case: str) -> dict:
    """One case's trace in :data:`RUNS` fresh processes (the row of the median peak, with every run's peak) and,
    in as many more, its model's forward pass alone (the median): the floor beside it."""
    def run(*extra: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "benchmarks.memsizes", "--case", case, *extra], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows = sorted((run() for _ in range(RUNS)), key=lambda r: r["peak_rise_bytes"])
    floors = sorted(run("--forward")["forward_peak_bytes"] for _ in range(RUNS))
    row, floor = rows[RUNS // 2], floors[RUNS // 2]
    return {**row, "peak_rise_runs": [r["peak_rise_bytes"] for r in rows], "forward_peak_bytes": floor,
            "forward_over_dataset": round(floor / row["dataset_bytes"], 2)}


def main(argv: list[str] | None = None) -> int:
    """Command line entry (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.memsizes")
    p.add_argument("--case", choices=sorted(CASES))
    p.add_argument("--readme", action="store_true")
    p.add_argument("--write", action="store_true", help="with --case: measure in a fresh process, replace its row")
    p.add_argument("--blip", type=int, metavar="SIZE")
    p.add_argument("--forward", action="store_true", help="with --case: the model's forward pass alone, as JSON")
    args = p.parse_args(argv)
    if args.blip:
        print(json.dumps(measure_blip(args.blip)))
        return 0
    if args.case and args.write:
        row = _fresh(args.case)
        rows = [r for r in json.loads(OUT.read_text()) if r["case"] != args.case] if OUT.exists() else []
        by_case = {r["case"]: r for r in [*rows, row]}
        OUT.write_text(json.dumps([by_case[c] for c in CASES if c in by_case], indent=1) + "\n")
        print(json.dumps(row))
        return 0
    if args.case:
        print(json.dumps(measure_forward(args.case) if args.forward else measure(args.case)))
        return 0
    if args.readme:
        readme = ROOT / "docs" / "performance.md"  # the README links to this page
        text = readme.read_text()
        body = table(json.loads(OUT.read_text()))
        modes = ROOT / "benchmarks" / "MEMORY_MODES.json"
        if modes.is_file():
            from benchmarks.memory_modes import readme_lines

            body += "\n\n" + readme_lines(json.loads(modes.read_text()))
        if START not in text:
            print(body)
            return 1
        head, rest = text.split(START, 1)
        readme.write_text(f"{head}{START}\n{body}\n{END}{rest.split(END, 1)[1]}")
        return 0
    rows = []
    for case in CASES:  # one fresh process each, one after the other: each needs several GB
        rows.append(_fresh(case))
        print(json.dumps(rows[-1]), flush=True)
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
