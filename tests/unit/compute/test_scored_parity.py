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
from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget  # noqa: E402

TOL = 1e-4


def _reshape(prefix: int, gh: int, gw: int):
    def reshape_transform(t):
        return t[:, prefix:, :].reshape(t.size(0), gh, gw, t.size(2)).permute(0, 3, 1, 2)
    return reshape_transform


def _pgc(cls, model, module, x, tr, cls_index, **kwargs):
    reshape = _reshape(int(tr.attrs["num_prefix_tokens"]), int(tr.attrs["grid_h"]), int(tr.attrs["grid_w"]))
    cam = cls(model=model, target_layers=[module], reshape_transform=reshape, **kwargs)
    if cls is ScoreCAM:
        cam.batch_size = 5
    with cam:
        out = cam(input_tensor=x, targets=[ClassifierOutputTarget(cls_index)])
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
