"""Parity of the scored weightings with pytorch-grad-cam 1.5.7 (issue #19): ScoreCAM, and AblationCAM with its
ViT ablation layer, on a tiny ViT and a tiny DeiT-distilled (random init, no downloads).

vitcam_nb scores the channels once (``vc.score``) and recomputes the map from the trace; pytorch-grad-cam runs its
own hooks and forward passes. After pytorch-grad-cam's normalisation (ReLU, min-max, cv2 bilinear resize) the
maps must agree to max |diff| <= 1e-4 (tests/unit/compute/test_presets_gradcam.py shows the resize premise).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitcam_nb as vc

pytest.importorskip("pytorch_grad_cam")
from pytorch_grad_cam import AblationCAM, ScoreCAM  # noqa: E402
from pytorch_grad_cam.ablation_layer import AblationLayerVit  # noqa: E402
from pytorch_grad_cam.utils.model_targets import ClassifierOutputSoftmaxTarget, ClassifierOutputTarget  # noqa: E402

TOL = 1e-4


def _reshape(prefix: int, gh: int, gw: int):
    def reshape_transform(t):
        return t[:, prefix:, :].reshape(t.size(0), gh, gw, t.size(2)).permute(0, 3, 1, 2)
    return reshape_transform


def _pgc(cls, model, module, x, tr, cls_index, target=None, **kwargs):
    reshape = _reshape(int(tr.attrs["num_prefix_tokens"]), int(tr.attrs["grid_h"]), int(tr.attrs["grid_w"]))
    cam = cls(model=model, target_layers=[module], reshape_transform=reshape, **kwargs)
    if cls is ScoreCAM:
        cam.batch_size = 5
    with cam:
        out = cam(input_tensor=x, targets=[target or ClassifierOutputTarget(cls_index)])
    return out[0].astype(np.float64)


def _vc_map(tr, recipe):
    m = vc.cam(tr, recipe)
    assert m.attrs["degenerate"] == ""
    return m.values.astype(np.float64)


@pytest.mark.parametrize("kind", ["vit", "deit_distilled"])
@pytest.mark.parametrize("site, layer, module", [("F1", -1, lambda b: b.norm1), ("F4", 1, lambda b: b.norm2),
                                                 ("F5", 0, lambda b: b.mlp)])
def test_scorecam_matches_pytorch_grad_cam(model_factory, model_input, kind, site, layer, module):
    model, x = model_factory(kind), model_input(kind)
    tr = vc.trace(model, x, targets="top2", sites=["F1", "F4", "F5"])
    recipe = vc.Recipe(site=site, layer=layer, weighting="scorecam")
    tr = vc.score(tr, model, recipe, x, batch_size=7, progress=False)
    for rank in ("top1", "top2"):  # both traced targets come from the same forward passes
        cls_index = int(tr["target_class"].values[int(rank[3:]) - 1])
        ours = _vc_map(tr, recipe.replace(class_=rank))
        theirs = _pgc(ScoreCAM, model, module(model.blocks[layer]), x, tr, cls_index)
        assert np.ptp(theirs) > 0.5
        assert np.abs(ours - theirs).max() <= TOL, f"{kind} {site}@{layer} {rank}"


@pytest.mark.parametrize("target", ["prob", "logprob"])
def test_prob_and_logprob_targets_match_pytorch_grad_cam(model_factory, model_input, target):
    """Score-CAM and Ablation-CAM of softmax targets: pytorch-grad-cam's ClassifierOutputSoftmaxTarget for prob,
    and a log-softmax target written here for logprob, evaluated on every perturbed input."""
    model, x = model_factory("vit"), model_input("vit")
    norm = _positive_norm1(model, 1)
    tr = vc.trace(model, x, targets="top1", sites=["F1", "F4"])
    cls_index = int(tr["target_class"].values[0])
    theirs_target = (ClassifierOutputSoftmaxTarget(cls_index) if target == "prob" else
                     (lambda o: torch.log_softmax(o, dim=-1)[..., cls_index]))
    score_recipe = vc.Recipe(site="F4", layer=1, weighting="scorecam", target=target)
    ablation_recipe = vc.Recipe(site="F1", layer=1, weighting="ablationcam", target=target)
    tr = vc.score(tr, model, [score_recipe, ablation_recipe], x, batch_size=8, progress=False)
    cases = [(score_recipe, ScoreCAM, model.blocks[1].norm2, {})]
    if target == "prob":  # logprob < 0 flips (s - s_k) / s: on these all-positive activations both maps are 0
        cases.append((ablation_recipe, AblationCAM, norm, {"ablation_layer": AblationLayerVit(), "batch_size": 8}))
    else:  # the stored ablation score and logsumexp give log_softmax of a forward pass with channel k zeroed
        k = 5
        handle = norm.register_forward_hook(lambda _m, _i, out: out * (torch.arange(out.shape[-1]) != k))
        try:
            with torch.no_grad():
                want = float(torch.log_softmax(model(x), dim=-1)[0, cls_index])
        finally:
            handle.remove()
        got = tr["ablation"].sel(layer=1, site="F1").values[0, k] - tr["ablation_logsumexp"].sel(layer=1, site="F1")[k]
        assert abs(float(got) - want) <= 1e-4
    for recipe, cls, module, kwargs in cases:
        ours = _vc_map(tr, recipe)
        theirs = _pgc(cls, model, module, x, tr, cls_index, target=theirs_target, **kwargs)
        assert np.ptp(theirs) > 0.5
        assert np.abs(ours - theirs).max() <= TOL, f"{recipe.weighting} {target}"
    logit_map = _vc_map(tr, score_recipe.replace(target="logit"))
    assert np.abs(logit_map - _vc_map(tr, score_recipe)).max() > 1e-3  # the target changes the map


def _positive_norm1(model, layer):
    """Make blocks[layer].norm1's output >= 0 with one all-zero channel, so that the activation minimum is
    exactly 0 and pytorch-grad-cam's ViT ablation layer zeroes the ablated channel (with another minimum it puts
    min - 1e7 there, a value that also drifts with the position in its batch)."""
    norm = model.blocks[layer].norm1
    with torch.no_grad():
        norm.weight.mul_(0.15)
        norm.bias.fill_(1.0)
        norm.weight[0] = 0.0
        norm.bias[0] = 0.0
    return norm


@pytest.mark.parametrize("kind", ["vit", "deit_distilled"])
@pytest.mark.parametrize("layer", [0, 1])
def test_ablationcam_matches_pytorch_grad_cam_vit_layer(model_factory, model_input, kind, layer):
    model, x = model_factory(kind), model_input(kind)
    norm = _positive_norm1(model, layer)
    tr = vc.trace(model, x, targets="top1", sites=["F1"])
    assert float(tr["act"].sel(site="F1").isel(layer=layer).min()) == 0.0
    recipe = vc.Recipe(site="F1", layer=layer, weighting="ablationcam")
    tr = vc.score(tr, model, recipe, x, batch_size=6, progress=False)
    ours = _vc_map(tr, recipe)
    theirs = _pgc(AblationCAM, model, norm, x, tr, int(tr["target_class"].values[0]),
                  ablation_layer=AblationLayerVit(), batch_size=6)
    assert np.ptp(theirs) > 0.5
    assert np.abs(ours - theirs).max() <= TOL, f"{kind} layer {layer}: {np.abs(ours - theirs).max():.2e}"


def test_scorecam_on_a_region_target_matches_semantic_segmentation_target():
    from pytorch_grad_cam.utils.model_targets import SemanticSegmentationTarget

    from vitcam_nb.data.segmenter import LinearSegmenter

    torch.manual_seed(0)
    model = LinearSegmenter(3, img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, mlp_ratio=2.0).eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    mask = np.zeros((32, 32), np.float32)
    mask[6:22, 10:30] = 1
    target = vc.targets.region(mask, 2)
    tr = vc.trace(model, x, targets=target, sites=["F1", "F4"])
    with torch.no_grad():  # the trace's score is pytorch-grad-cam's segmentation target on the same output
        assert abs(float(tr["logits"].values[2]) - float(SemanticSegmentationTarget(2, mask)(model(x)[0]))) < 1e-4
    for site, layer, module in (("F1", 2, model.blocks[2].norm1), ("F4", 0, model.blocks[0].norm2)):
        recipe = vc.Recipe(site=site, layer=layer, weighting="scorecam", class_=2)
        tr = vc.score(tr, model, recipe, x, targets=target, batch_size=8, progress=False)
        ours = _vc_map(tr, recipe)
        reshape = _reshape(1, 4, 4)
        with ScoreCAM(model=model, target_layers=[module], reshape_transform=reshape) as cam:
            cam.batch_size = 8
            theirs = cam(input_tensor=x, targets=[SemanticSegmentationTarget(2, mask)])[0].astype(np.float64)
        assert np.ptp(theirs) > 0.5
        assert np.abs(ours - theirs).max() <= TOL, f"{site}@{layer}: {np.abs(ours - theirs).max():.2e}"
