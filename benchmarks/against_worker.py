"""One measurement of one vitcam_nb tree for ``benchmarks/against.py``: trace, one variant and gallery.

Run as a script file, never as ``-m benchmarks.against_worker``, with ``PYTHONPATH=<tree root>`` (the parent
also caps numpy's BLAS pool through ``OPENBLAS_NUM_THREADS`` and friends, which must be set before numpy loads)::

    PYTHONPATH=/tmp/old python benchmarks/against_worker.py --root /tmp/old --model vit_tiny_patch16_224

It prints one JSON line: the median seconds per item, the torch threads, the versions and the
``vitcam_nb.__file__`` it imported. It imports nothing from the ``benchmarks`` package of either tree and
uses only the public API that vitcam_nb 0.1 and later share, so the same file measures both sides.
"""

from __future__ import annotations

import os
import sys

# Python puts this script's folder (benchmarks/ of the current tree) first on sys.path; drop it so that no
# module next to this file can shadow a name either tree imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    del sys.path[0]

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

GALLERY_VARY = {"layer": "all", "site": ["F1", "F3", "F4", "F5", "F6"]}
TARGETS = "top5"


def time_calls(fn: Callable[[], object], n: int, collect_each: bool = True) -> dict:
    """Wall-clock and process-CPU seconds of ``n`` calls of ``fn``: median, min, the samples.

    With ``collect_each`` a garbage collection runs before every call (outside the timer); otherwise once
    before the first, because a full collection costs more than a fast call such as one ``vc.cam``.

    Example:
        >>> s = time_calls(lambda: sum(range(100)), 3)
        >>> s["n"], s["median_s"] >= 0
        (3, True)
    """
    wall, cpu = [], []
    for i in range(n):
        if collect_each or i == 0:
            gc.collect()
        c0 = time.process_time()
        t0 = time.perf_counter()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        del out
    return {"median_s": statistics.median(wall), "min_s": min(wall), "cpu_median_s": statistics.median(cpu),
            "n": n, "samples_s": [round(v, 6) for v in wall]}


def stray_modules(root: Path) -> list[str]:
    """Names of loaded ``vitcam_nb`` modules whose file is not under ``root``.

    The current tree's editable install stays on ``sys.meta_path`` behind PYTHONPATH: a submodule missing
    from the measured tree would silently come from the other tree, which this makes visible.

    Example:
        >>> stray_modules(Path("/")) == []
        True
    """
    out = []
    for name, module in list(sys.modules.items()):
        if name != "vitcam_nb" and not name.startswith("vitcam_nb."):
            continue
        file = getattr(module, "__file__", None)
        if file and not Path(file).resolve().is_relative_to(root):
            out.append(name)
    return sorted(out)


def measure(model_name: str, threads: int, trace_calls: int, cam_burst: int, gallery_calls: int) -> dict:
    """Build the seeded random-init timm model and its input, warm up, and time the three items.

    Example:
        >>> r = measure("vit_tiny_patch16_224", 1, 1, 1, 1)  # doctest: +SKIP
        >>> sorted(r["items"])  # doctest: +SKIP
        ['gallery', 'one_variant', 'trace']
    """
    import timm
    import torch

    import vitcam_nb as vc

    if threads > 0:  # 0: torch's own choice, as `python -m benchmarks` without --threads
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = timm.create_model(model_name, pretrained=False).eval()
    h, w = (int(v) for v in model.patch_embed.img_size)
    x = torch.randn((1, 3, h, w), generator=torch.Generator().manual_seed(1))
    recipe = vc.presets.pytorch_grad_cam_vit()
    with warnings.catch_warnings():
        # Random-init models give flat maps at some sites; the warning is expected and its printing is not
        # what is measured.
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        # The first trace of a model hashes its weights (cached per model object after that): warm-up only.
        tr = vc.trace(model, x, targets=TARGETS)
        trace = time_calls(lambda: vc.trace(model, x, targets=TARGETS), trace_calls)
        vc.cam(tr, recipe)
        one_variant = time_calls(lambda: vc.cam(tr, recipe), cam_burst, collect_each=False)
        vc.gallery(tr, vc.Recipe(), vary=GALLERY_VARY)
        gallery = time_calls(lambda: vc.gallery(tr, vc.Recipe(), vary=GALLERY_VARY), gallery_calls)
    return {
        "items": {"trace": trace, "one_variant": one_variant, "gallery": gallery},
        "torch_threads": torch.get_num_threads(),
        "gallery_recipe_is_preset": vc.Recipe() == recipe,
        "versions": {"vitcam_nb": getattr(vc, "__version__", None), "torch": torch.__version__,
                     "timm": timm.__version__},
    }


def main(argv: list[str] | None = None) -> int:
    """Measure the tree at ``--root`` and print one JSON line; exit 3 if vitcam_nb came from elsewhere.

    Example:
        >>> main(["--root", "/nonexistent", "--model", "vit_tiny_patch16_224"])  # doctest: +SKIP
        3
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="tree whose vitcam_nb must be imported")
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--trace-calls", type=int, default=5)
    p.add_argument("--cam-burst", type=int, default=20)
    p.add_argument("--gallery-calls", type=int, default=5)
    args = p.parse_args(argv)
    root = args.root.resolve()
    import vitcam_nb

    file = str(Path(vitcam_nb.__file__).resolve())
    # Recorded so that the report shows PYTHONPATH won over an editable install, not that there was none.
    editable = any("__editable__" in (getattr(f, "__module__", None) or "") for f in sys.meta_path)
    report: dict = {"root": str(root), "vitcam_nb_file": file, "editable_finder_on_meta_path": editable}
    if not Path(file).is_relative_to(root):
        report["error"] = f"vitcam_nb was imported from {file}, not from under {root}"
        print(json.dumps(report), flush=True)
        return 3
    report.update(measure(args.model, args.threads, args.trace_calls, args.cam_burst, args.gallery_calls))
    strays = stray_modules(root)
    report["modules_outside_root"] = strays
    if strays:
        report["error"] = f"vitcam_nb submodules imported from outside {root}: {', '.join(strays)}"
        print(json.dumps(report), flush=True)
        return 3
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
