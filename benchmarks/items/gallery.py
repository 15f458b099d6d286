"""Item 3: the 12 x 5 gallery via vc.gallery() against pytorch-grad-cam and torchcam on the same variants."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from benchmarks import peers, workloads
from benchmarks.items import clear_cam_caches
from benchmarks.timing import interleave, paired_ratio, timed

if TYPE_CHECKING:
    from benchmarks.suite import Config

GALLERY_SITES = ("F1", "F3", "F4", "F5", "F6")


def peer_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, list[tuple[int, str, torch.nn.Module, str]], str]:
    """A private copy of ``model`` for a peer and its (layer, site, module, name) list in execution order."""
    peer = copy.deepcopy(model)
    try:
        for blk in peer.blocks:
            peers.peer_module(blk, "F3")
        how = peers.peer_module(peer.blocks[0], "F3")[1]
    except ValueError:
        peer = peers.wrap_proj_input(model)
        how = "attn.proj wrapped as Sequential(Identity, proj); the Identity's output (= F3) is hooked"
    names = {id(m): n for n, m in peer.named_modules()}
    layers = []
    for li, blk in enumerate(peer.blocks):
        for site in GALLERY_SITES:
            module = blk.attn.proj[0] if site == "F3" and isinstance(blk.attn.proj, torch.nn.Sequential) \
                else peers.peer_module(blk, site)[0]
            layers.append((li, site, module, names[id(module)]))
    return peer, layers, how


def bench_gallery(w: workloads.Workload, tr: object, peer_models: dict, cfg: Config) -> dict:
    """Item 3: the 12 x 5 gallery via vc.gallery() against pytorch-grad-cam looping over the same variants,
    pytorch-grad-cam in one pass, and torchcam with every layer hooked at once (one backward)."""
    import vitcam_nb as vc

    recipe = vc.presets.pytorch_grad_cam_vit()
    vary = {"layer": "all", "site": list(GALLERY_SITES)}
    top1 = int(np.argmax(tr["logits"].values))
    size = (int(w.x.shape[-2]), int(w.x.shape[-1]))
    n_layers = len(w.model.blocks)
    pgc_model, layers, f3_how = peer_models["pgc_layers"]

    def pgc_loop() -> np.ndarray:
        maps = []
        for _li, _site, module, _name in layers:
            with peers.pgc_gradcam(pgc_model, [module]) as cam:
                maps.append(peers.pgc_map(cam, w.x, top1))
        return np.stack(maps)

    pgc_all = peers.pgc_gradcam(pgc_model, [m for _, _, m, _ in layers])
    candidates: dict[str, Callable[[], object]] = {
        "vc_gallery": lambda: vc.gallery(tr, recipe, vary=vary),
        "vc_gallery_cold_caches": lambda: (clear_cam_caches(), vc.gallery(tr, recipe, vary=vary))[1],
        "pytorch_grad_cam_loop": pgc_loop,
        "pytorch_grad_cam_one_pass": lambda: peers.pgc_per_layer(pgc_all, w.x, top1),
    }
    tc_ext = None
    if peer_models.get("torchcam_layers") is not None:
        tc_model, tc_layers, _ = peer_models["torchcam_layers"]
        tc_ext = peers.torchcam_gradcam(tc_model, [name for _, _, _, name in tc_layers])
        candidates["torchcam_one_pass"] = lambda: peers.torchcam_maps(tc_ext, tc_model, w.x, top1, size)
    try:
        ours = vc.gallery(tr, recipe, vary=vary).transpose("layer", "site", ...).values.reshape(-1, *size)
        agreement = {}
        for name in candidates:
            if name.startswith("vc_gallery"):
                continue
            theirs = candidates[name]()
            theirs = theirs.detach().cpu().numpy() if isinstance(theirs, torch.Tensor) else theirs
            diff = np.abs(ours - theirs).reshape(len(layers), -1).max(axis=1)
            agreement[name] = {"max_abs_diff": float(diff.max()), "maps_differing_by_more_than_1e-3":
                               int((diff > 1e-3).sum())}
        for _ in range(cfg.warmup):  # the loop's warm-up was the agreement run above
            for name, fn in candidates.items():
                if name != "pytorch_grad_cam_loop":
                    timed(fn, cfg.device)
        loop = {"pytorch_grad_cam_loop": candidates.pop("pytorch_grad_cam_loop")}
        burst = {"vc_gallery": cfg.gallery_burst, "vc_gallery_cold_caches": cfg.gallery_burst}
        s = interleave({**candidates, **loop}, cfg.gallery_loop_repeats, cfg.device, burst)
        extra = interleave(candidates, max(0, cfg.repeats - cfg.gallery_loop_repeats), cfg.device, burst)
    finally:
        pgc_all.activations_and_grads.release()
        if tc_ext is not None:
            tc_ext.remove_hooks()
    s.extend(extra)
    n_loop = len(s["pytorch_grad_cam_loop"])
    out = {
        "variants": len(layers),
        "layers": n_layers,
        "sites": list(GALLERY_SITES),
        "recipe": "presets.pytorch_grad_cam_vit() with vary={'layer': 'all', 'site': ['F1','F3','F4','F5','F6']}",
        **{name: s.stats(name) for name in s},
        "speedup_vs_pytorch_grad_cam_loop": paired_ratio(s["pytorch_grad_cam_loop"], s["vc_gallery"][:n_loop]),
        "speedup_vs_pytorch_grad_cam_one_pass": paired_ratio(s["pytorch_grad_cam_one_pass"], s["vc_gallery"]),
        "speedup_vs_pytorch_grad_cam_one_pass_cold_caches": paired_ratio(s["pytorch_grad_cam_one_pass"],
                                                                         s["vc_gallery_cold_caches"]),
        "agreement": agreement,
        "f3_hook": f"peers hook module outputs only; F3 (input of attn.proj) is read as {f3_how}",
        "timing_note": (f"vc_gallery: median of a burst of {cfg.gallery_burst} calls per round (warm per-trace view, "
                        "with the activation norms the first map on each (layer, site) keeps, and checklist caches); "
                        "vc_gallery_cold_caches: the same with both caches cleared before every call; "
                        "pytorch_grad_cam_loop: its public API once per variant (a GradCAM per layer, forward + "
                        "backward each), measured in fewer rounds because one round is 60 model passes; "
                        "pytorch_grad_cam_one_pass: all layers hooked, one forward + backward, per-layer maps via "
                        "compute_cam_per_layer (its __call__ would average the layers); torchcam_one_pass: all "
                        "layers hooked, one forward, one autograd.grad over all of them with retain_graph=True, "
                        "then bilinear upsampling + min-max (torchcam returns grid-sized maps)"),
    }
    if "torchcam_one_pass" in s:
        out["speedup_vs_torchcam_one_pass"] = paired_ratio(s["torchcam_one_pass"], s["vc_gallery"])
        out["speedup_vs_torchcam_one_pass_cold_caches"] = paired_ratio(s["torchcam_one_pass"],
                                                                        s["vc_gallery_cold_caches"])
    cfg.log(f"    gallery {out['vc_gallery']['median_s'] * 1e3:.1f} ms, pgc loop "
            f"{out['pytorch_grad_cam_loop']['median_s']:.2f} s, "
            f"one pass {out['pytorch_grad_cam_one_pass']['median_s']:.2f} s")
    return out
