"""``python -m benchmarks [--quick] [--out DIR] [--device cpu|cuda|auto] ...``: see benchmarks/README.md."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchmarks import suite, workloads


def parse_args(argv: list[str] | None = None) -> suite.Config:
    """Turn the command line into a :class:`benchmarks.suite.Config`.

    Example:
        >>> parse_args(["--quick"]).models
        ('tiny_vit', 'shapes-vit')
        >>> parse_args(["--items", "gallery"]).items
        ('gallery',)
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="CI smoke run: tiny ViT (+ the bundled model if present), few repeats, < 60 s, no claims")
    p.add_argument("--out", type=Path, default=suite.DEFAULT_OUT, help="where latest.json / latest.md go "
                   "(default benchmarks/results, git-ignored)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (cuda if available)")
    p.add_argument("--models", nargs="+", default=None,
                   help=f"workloads (default {' '.join(workloads.FULL_MODELS)}; quick: "
                        f"{' '.join(workloads.QUICK_MODELS)})")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds per item (default 5, quick 3)")
    p.add_argument("--gallery-loop-repeats", type=int, default=None,
                   help="rounds of pytorch-grad-cam's one-call-per-variant gallery loop (default 2, quick 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's choice; quick: 1). On a shared CPU, 1 thread "
                        "avoids OpenMP stalls that make multi-threaded timings erratic")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    p.add_argument("--widget", action=argparse.BooleanOptionalAction, default=None,
                   help="run item 5, widget latency in a real browser (default: on, off with --quick)")
    p.add_argument("--items", nargs="+", default=None, choices=suite.ITEMS, metavar="ITEM",
                   help=f"run only these items ({' '.join(suite.ITEMS)}); a full-mode run merges them into the "
                        "committed RESULTS.json (each merged item records its own date and command)")
    p.add_argument("--no-results-copy", action="store_true",
                   help="full mode: do not overwrite the committed benchmarks/RESULTS.json / RESULTS.md")
    args = p.parse_args(argv)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            p.error(f"--device {device}: CUDA is not available on this machine")
    command = "python -m benchmarks" + ("" if not argv else " " + shlex.join(argv))
    quick = args.quick
    return suite.Config(
        quick=quick,
        out=args.out,
        device=device,
        models=tuple(args.models) if args.models else (workloads.QUICK_MODELS if quick else workloads.FULL_MODELS),
        repeats=args.repeats or (3 if quick else 5),
        warmup=1,
        cam_burst=5 if quick else 20,
        gallery_burst=3 if quick else 5,
        gallery_loop_repeats=args.gallery_loop_repeats or (1 if quick else 2),
        memory=not args.no_memory,
        widget=args.widget if args.widget is not None else not quick,
        threads=args.threads if args.threads is not None else (1 if quick else 0),
        command=command,
        results_copy=not args.no_results_copy,
        items=tuple(args.items) if args.items else None,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the suite and print where the results went."""
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    suite.run(cfg)
    print(cfg.out / "latest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
