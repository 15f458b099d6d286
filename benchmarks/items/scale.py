"""Item ``scale`` (issue #35, item 5): maps of a dataset at scale, ratios measured in one run.

On timm ``vit_base_patch16_224`` (random init: no download; the cost does not depend on the weights), with the
500-recipe space of :mod:`benchmarks.ambiguity` (its last description: class logit, ReLU after, patch tokens, one of
blocks 7-11, on the token grid), on seeded random 224 px images:

* ``vc.map_many`` images/s (NumPy backend, the bitwise default, and the torch backend) against ``vc.trace()`` alone
  (same targets, top-1, every site of every block as ``vc.trace`` traces them), interleaved round by round;
* the store's bytes per image (every file under the store folder);
* pytorch-grad-cam 1.5.7 computing those maps per image: it expresses a subset (its CAMs on module outputs: the
  token sites F1, F3-F6 with ``heads="channels"``; none of the 300 F2 recipes). Its cost per map is measured on
  that subset (``GradCAM`` on ``blocks[l].norm1``, l = 7..11, one call per map, its public API) and multiplied by
  500; its best case (all five layers hooked, five maps from one pass via ``compute_cam_per_layer``) is reported
  beside it;
* a ``dask.distributed`` ``LocalCluster`` of 2 worker processes (one thread each) against one worker, on the same
  images: one call on fresh workers, then two more on the same workers (the target is on those; every batch runs
  on a worker, the calling process computes none);
* with ``--device cuda`` (or ``--device-batch N`` on CPU), ``vc.map_many`` images/s on that device against timm's
  forward-only images/s there (:mod:`benchmarks.items.scale_device`: float16, batch 64 on CUDA).

``python -m benchmarks --items scale`` (or ``python -m benchmarks.items.scale``) writes ``benchmarks/SCALE.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTION = "class logit, ReLU after, patch tokens, one of the last five blocks"
TARGETS = {"map_many_vs_trace": 0.8, "store_mb_per_image": 0.25, "vs_pytorch_grad_cam": 100.0,
           "two_workers_vs_one": 1.6}


def _recipes(trace: object) -> list:
    """The 500 recipes :mod:`benchmarks.ambiguity`'s last description leaves open on this trace."""
    import vitcam_nb as vc
    from benchmarks.ambiguity import DESCRIPTIONS, SPACES

    return list(vc.ambiguity(trace, DESCRIPTIONS[DESCRIPTION], space=SPACES[DESCRIPTION]).recipes)


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _map_many(model: object, images: list, recipes: list, root: Path, name: str, batch: int, **kw: object
              ) -> tuple[float, dict]:
    """Seconds of one map_many call over ``images`` into a new store, and the store's bytes (store removed):
    ``total``, and the ``fixed`` part (the ``zarr.json`` files: the recipes' table with their checklists, the
    settings, the token kinds), written once per store whatever its image count."""
    import vitcam_nb as vc

    path = root / f"{name}.zarr"
    start = time.perf_counter()
    vc.map_many(model, images, recipes, path, batch_size=batch, progress=False, **kw)
    wall = time.perf_counter() - start
    size = {"total": _bytes(path), "fixed": sum(f.stat().st_size for f in path.rglob("zarr.json"))}
    shutil.rmtree(path)
    return wall, size


def _pgc(model: object, x: object, rounds: int) -> dict:
    """pytorch-grad-cam on the F1 blocks 7-11: seconds per map, one public call per map and the best case."""
    from benchmarks import peers

    layers = [model.blocks[i].norm1 for i in range(7, 12)]
    cls = int(model(x).argmax())
    per_call, per_layer = [], []
    with peers.pgc_gradcam(model, layers[-1:]) as one, peers.pgc_gradcam(model, layers) as five:
        peers.pgc_map(one, x, cls)  # warm-up
        for _ in range(rounds):
            start = time.perf_counter()
            peers.pgc_map(one, x, cls)
            per_call.append(time.perf_counter() - start)
            start = time.perf_counter()
            peers.pgc_per_layer(five, x, cls)
            per_layer.append((time.perf_counter() - start) / len(layers))
    return {"s_per_map_one_call_each": statistics.median(per_call),
            "s_per_map_five_layers_one_pass": statistics.median(per_layer), "calls": rounds}


def _cluster(model: object, images: list, recipes: list, root: Path, batch: int, backend: str, spec: dict,
             warm_calls: int = 2) -> dict:
    """map_many under a LocalCluster of 1 and then of 2 worker processes (one thread each; one cluster up at a
    time: idle workers of another cluster would share the cores), same images: first one call on the cluster's
    fresh workers (they import torch, timm and the kit during the call), then ``warm_calls`` calls on the same
    workers (a cluster that has run a call: only the model is sent again), whose median is the warm figure."""
    from distributed import Client, LocalCluster

    calls: dict[str, dict[int, list[float]]] = {"fresh": {1: [], 2: []}, "warm": {1: [], 2: []}}
    for workers in (1, 2):
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as lc, \
                Client(lc):
            for i, call in enumerate(["fresh"] + ["warm"] * warm_calls):
                wall, _ = _map_many(model, images, recipes, root, f"cluster{workers}-{i}", batch, backend=backend,
                                    worker_model=spec)
                calls[call][workers].append(round(wall, 2))
    out: dict = {}
    for call, walls in calls.items():
        one_s, two_s = statistics.median(walls[1]), statistics.median(walls[2])
        out[call] = {"1_workers_s": one_s, "2_workers_s": two_s, "1_workers_calls_s": walls[1],
                     "2_workers_calls_s": walls[2], "1_workers_images_per_s": round(len(images) / one_s, 4),
                     "2_workers_images_per_s": round(len(images) / two_s, 4), "ratio": round(one_s / two_s, 3)}
    return out


def run(quick: bool = False, n_images: int = 4, rounds: int = 2, cluster_images: int = 33, threads: int = 1,
        device: str = "cpu", device_batch: int | None = None) -> dict:
    """Measure everything; returns the results dict (see the module docstring).

    Example:
        >>> run(quick=True, n_images=2, rounds=1, cluster_images=3)["targets"][0]["item"]  # doctest: +SKIP
        'map_many_vs_trace'
    """
    import timm
    import torch

    import vitcam_nb as vc
    from benchmarks.machine import machine_info, versions
    from vitcam_nb.compute.torch_maps import torch_refusal
    from vitcam_nb.preprocess import prepare_input

    torch.set_num_threads(threads)
    warnings.simplefilter("ignore", vc.DegenerateMapWarning)
    name, kw = ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8}) if quick else ("vit_base_patch16_224", {})
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kw).eval()
    size = int(model.patch_embed.img_size[0])
    rng = np.random.default_rng(0)
    images = list(rng.integers(0, 256, (max(n_images, cluster_images), size, size, 3), np.uint8))
    started = time.perf_counter()
    first = vc.trace(model, images[0], targets="top1")  # warm-up: hashes the weights once per model object
    recipes = _recipes(first)
    torch_ok = [r for r in recipes if not torch_refusal(r)]
    batch = n_images  # one pass for the images timed: the torch backend's per-recipe work is per batch
    root = Path(tempfile.mkdtemp(prefix="vitcam-scale-"))
    rows: dict[str, list[float]] = {"trace": [], "map_many_numpy": [], "map_many_torch": []}
    store_bytes = {}
    try:
        for r in range(rounds):
            order = ["trace", "map_many_numpy", "map_many_torch"]
            for cand in order[r % 3:] + order[:r % 3]:  # rotated each round
                if cand == "trace":
                    start = time.perf_counter()
                    for img in images[:n_images]:
                        vc.trace(model, img, targets="top1")
                    rows[cand].append(time.perf_counter() - start)
                else:
                    backend = cand.rsplit("_", 1)[1]
                    wall, nbytes = _map_many(model, images[:n_images], recipes if backend == "numpy" else torch_ok,
                                             root, cand, batch, backend=backend)
                    rows[cand].append(wall)
                    store_bytes[backend] = nbytes
        pgc = _pgc(copy.deepcopy(model), prepare_input(model, images[0]).tensor, 3 if not quick else 1)
        cluster = _cluster(model, images[:cluster_images], recipes, root, 1, "torch", {"timm": name, **kw})
        on_device = None
        if device != "cpu" or device_batch:
            from benchmarks.items.scale_device import device_throughput

            on_device = device_throughput(name, kw, torch_ok, device, device_batch or 64, rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    per_image = {k: statistics.median(v) / n_images for k, v in rows.items()}
    ratios = {k: statistics.median(a / b for a, b in zip(rows["trace"], rows[k])) for k in rows if k != "trace"}
    ours_per_map = per_image["map_many_torch"] / len(torch_ok)
    best_ours = min(per_image["map_many_numpy"], per_image["map_many_torch"])
    vs_pgc = pgc["s_per_map_one_call_each"] * len(recipes) / best_ours
    vs_pgc_best = pgc["s_per_map_five_layers_one_pass"] * len(recipes) / best_ours
    store_mb = {k: v["total"] / n_images / 1e6 for k, v in store_bytes.items()}
    # What each image adds (its maps and facts, compressed chunks); the fixed part is shared by all the images.
    marginal_mb = {k: (v["total"] - v["fixed"]) / n_images / 1e6 for k, v in store_bytes.items()}
    measured = {
        "map_many_vs_trace": max(ratios.values()), "store_mb_per_image": max(marginal_mb.values()),
        "vs_pytorch_grad_cam": vs_pgc, "two_workers_vs_one": cluster["warm"]["ratio"]}
    if on_device is not None:
        measured["device_vs_timm_forward"] = on_device["ratio"]
    targets = []
    for key, goal in {**TARGETS, **({"device_vs_timm_forward": on_device["target"]} if on_device else {})}.items():
        ok = measured[key] <= goal if key == "store_mb_per_image" else measured[key] >= goal
        targets.append({"item": key, "measured": round(measured[key], 4), "target": goal,
                        "rule": "<=" if key == "store_mb_per_image" else ">=", "met": bool(ok)})
    return {
        "command": "python -m benchmarks --items scale" + (" --quick" if quick else ""),
        "date": datetime.date.today().isoformat(), "quick": quick,
        "model": f"{name} (random init: no download; the cost does not depend on the weights)",
        "machine": machine_info("cpu"), "versions": versions(), "torch_threads": threads,
        "settings": {"images": n_images, "rounds": rounds, "batch_size": batch, "image_size": size,
                     "recipes": len(recipes), "recipes_torch_backend": len(torch_ok), "targets": "top1",
                     "space": f"benchmarks.ambiguity, '{DESCRIPTION}'", "trace_call": "vc.trace(model, image, "
                     "targets='top1') (every site of every block, as vc.trace traces them)"},
        "seconds_per_image": {k: round(v, 3) for k, v in per_image.items()},
        "images_per_s": {k: round(1 / v, 4) for k, v in per_image.items()},
        "rounds_s": {k: [round(v, 3) for v in vals] for k, vals in rows.items()},
        "map_many_vs_trace": {k: round(v, 3) for k, v in ratios.items()},
        "store_mb_per_image": {k: round(v, 4) for k, v in marginal_mb.items()},
        "store": {"total_mb_over_images": {k: round(v, 4) for k, v in store_mb.items()},
                  "fixed_mb": {k: round(v["fixed"] / 1e6, 4) for k, v in store_bytes.items()},
                  "maps_raw_mb_per_image": round(len(recipes) * int(np.prod(model.patch_embed.grid_size)) * 4 / 1e6, 4),
                  "note": "store_mb_per_image is what each image adds (every file but the zarr.json metadata, "
                          "over the images); the fixed part is written once per store"},
        "pytorch_grad_cam": {**{k: round(v, 4) if isinstance(v, float) else v for k, v in pgc.items()},
                             "extrapolation": f"seconds per map x {len(recipes)} maps per image; it expresses the "
                             "200 token-site recipes (its CAMs on module outputs), none of the 300 F2 ones",
                             "ratio_one_call_each": round(vs_pgc, 1), "ratio_best_case": round(vs_pgc_best, 1),
                             "ours_s_per_map_torch_backend": round(ours_per_map, 6)},
        "cluster": {**cluster, "images": cluster_images, "batch_size": 1, "backend": "torch",
                    "target_on": "warm: the median of two later calls on the same cluster (a long-lived cluster's "
                                 "workers have imported their libraries once); fresh: the first call on each "
                                 "cluster, whose workers import torch, timm and the kit meanwhile",
                    "note": "each call sends the model to the workers and shards every batch over them (the "
                            "calling process computes none; it creates the store from the first batch's maps and "
                            "records each finished batch); on a 2-core machine it shares the two cores with the "
                            "two workers"},
        "device_throughput": on_device if on_device is not None else {
            "note": "not measured in this run: python -m benchmarks.items.scale --device cuda measures it"},
        "targets": targets, "wall_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the item and write its JSON (``--out``, default ``benchmarks/SCALE.json``).

    Example:
        >>> main(["--quick", "--out", "/tmp/scale-quick.json"])  # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.items.scale", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "SCALE.json")
    p.add_argument("--quick", action="store_true", help="tiny ViT smoke run, no claims")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cluster-images", type=int, default=33)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="also measure map_many against timm's forward on this device")
    p.add_argument("--device-batch", type=int, default=None, help="batch size of that measurement (default 64)")
    args = p.parse_args(argv)
    result = run(args.quick, args.images, args.rounds, args.cluster_images, args.threads, args.device,
                 args.device_batch)
    result["argv"] = list(sys.argv[1:] if argv is None else argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: result[k] for k in ("seconds_per_image", "map_many_vs_trace", "store_mb_per_image",
                                             "targets")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
