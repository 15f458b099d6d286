"""Item 2: one variant via vc.cam() against pytorch-grad-cam (and torchcam) computing the same variant."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from benchmarks import peers, workloads
from benchmarks.items import clear_cam_caches
from benchmarks.timing import interleave, paired_ratio, timed

if TYPE_CHECKING:
    from benchmarks.suite import Config


def bench_single_variant(w: workloads.Workload, tr: object, peer_models: dict, cfg: Config) -> dict:
    """Item 2: one variant via vc.cam() against pytorch-grad-cam (and torchcam) computing the same variant."""
    import vitcam_nb as vc

    recipe = vc.presets.pytorch_grad_cam_vit()
    top1 = int(np.argmax(tr["logits"].values))
    size = (int(w.x.shape[-2]), int(w.x.shape[-1]))
    last = len(w.model.blocks) - 1
    pgc_model = peer_models["pgc_layers"][0]
    pgc_cam = peers.pgc_gradcam(pgc_model, [pgc_model.blocks[last].norm1])
    candidates: dict[str, Callable[[], object]] = {
        "vc_cam": lambda: vc.cam(tr, recipe),
        "vc_cam_cold_caches": lambda: (clear_cam_caches(), vc.cam(tr, recipe))[1],
        "pytorch_grad_cam": lambda: peers.pgc_map(pgc_cam, w.x, top1),
    }
    tc_ext = None
    if peer_models.get("torchcam_layers") is not None:
        tc_model = peer_models["torchcam_layers"][0]
        tc_ext = peers.torchcam_gradcam(tc_model, [f"blocks.{last}.norm1"])
        candidates["torchcam"] = lambda: peers.torchcam_maps(tc_ext, tc_model, w.x, top1, size)
    try:
        ours = vc.cam(tr, recipe).values
        agreement = {"pytorch_grad_cam_max_abs_diff": float(np.abs(ours - peers.pgc_map(pgc_cam, w.x, top1)).max())}
        if tc_ext is not None:
            theirs = candidates["torchcam"]()[0].detach().cpu().numpy()
            agreement["torchcam_max_abs_diff"] = float(np.abs(ours - theirs).max())
        for _ in range(cfg.warmup):
            for fn in candidates.values():
                timed(fn, cfg.device)
        burst = {"vc_cam": cfg.cam_burst, "vc_cam_cold_caches": cfg.cam_burst}
        s = interleave(candidates, cfg.repeats, cfg.device, burst)
    finally:
        pgc_cam.activations_and_grads.release()
        if tc_ext is not None:
            tc_ext.remove_hooks()
    out = {
        "recipe": "presets.pytorch_grad_cam_vit()",
        "recipe_id": recipe.id,
        "class": top1,
        "what": "GradCAM on blocks[-1].norm1 output (F1), CLS dropped, logit of the top-1 class, ReLU, min-max, "
                f"bilinear to {size[0]}x{size[1]}",
        **{name: s.stats(name) for name in s},
        "speedup_vs_pytorch_grad_cam": paired_ratio(s["pytorch_grad_cam"], s["vc_cam"]),
        "speedup_vs_pytorch_grad_cam_cold_caches": paired_ratio(s["pytorch_grad_cam"], s["vc_cam_cold_caches"]),
        "agreement": agreement,
        "timing_note": (f"vc_cam: median of a burst of {cfg.cam_burst} calls per round (warm per-trace view and "
                        "checklist caches); vc_cam_cold_caches: both caches cleared before every call; peers: one "
                        "call per round (forward + backward + map), extractor built once outside the timer"),
    }
    if "torchcam" in s:
        out["speedup_vs_torchcam"] = paired_ratio(s["torchcam"], s["vc_cam"])
    cfg.log(f"    cam {out['vc_cam']['median_s'] * 1e3:.2f} ms, pgc {out['pytorch_grad_cam']['median_s']:.3f} s, "
            f"speedup {out['speedup_vs_pytorch_grad_cam']:.0f}x")
    return out
