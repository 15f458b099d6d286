"""Hugging Face ``DPTForSemanticSegmentation`` (issue #19, dense targets): a tiny random config (hidden 32, 4
layers, 32 px, 3 labels) traced with a region target.

The reference never calls vitcam_nb: it deep-copies the model, sets the eager attention with transformers' own
``set_attn_implementation``, hooks the modules of ``DPTViTLayer.forward`` (read from transformers' source) with
``retain_grad()`` and runs one fresh forward + ``backward()`` of the region sum of the class's logits (or the
expected region score). The Grad-CAM reference is written out with torch ops.

Naming convention (scripts/support_matrix.py measures the support matrix from it): ``test_site_reference``
ids are ``"hf_dpt-<site>"``.
"""

from __future__ import annotations

import copy
import functools
import math

import numpy as np
import pytest
import torch
from torch import nn
from vitcam_testing import assert_rel_close, assert_unchanged, hooked_eager_copy, snapshot, target_scalar, traced

import vitcam_nb as vc
from vitcam_nb.adapters import find_adapter

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

LAYERS = "dpt.encoder.layer"
CORE = ("F1", "F2", "F3", "F4", "F5", "F6")
EXTENDED = ("resid_pre", "attn_out", "resid_mid")
# (module path relative to DPTViTLayer, "input" / "output" / "weights" = element 1 of the self-attention's output)
DPT_LAYER = {"F1": ("layernorm_before", "output"), "F2": ("attention.attention", "weights"),
             "F3": ("attention.output.dense", "input"), "F4": ("layernorm_after", "output"),
             "F5": ("output.dense", "output"), "F6": ("", "output"), "resid_pre": ("", "input"),
             "attn_out": ("attention", "output"), "resid_mid": ("layernorm_after", "input")}
CLASS = 1


def build(seed: int = 0, **kwargs) -> nn.Module:
    """The tiny DPT with O(1) weights (Hugging Face's init gives logits near 1e-6, which would hide a wrong hook)."""
    cfg = transformers.DPTConfig(**{**dict(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, image_size=32,
        patch_size=8, num_labels=3, backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 32, 32],
        fusion_hidden_size=16, use_auxiliary_head=False), **kwargs})
    torch.manual_seed(seed)
    model = transformers.DPTForSemanticSegmentation(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("cls_token", "position_embeddings"):
                p.copy_(0.5 * noise)
            elif leaf == "weight" and p.ndim == 1:  # LayerNorm and BatchNorm scales
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim >= 2:
                p.copy_(noise / math.sqrt(p[0].numel()))
            else:
                p.copy_(0.1 * noise)
    model.eval()
    with torch.no_grad():  # transformers adds its output-recording hooks at the first forward, not at the trace's
        model(pixel_values=make_input())
    return model


def make_input(h: int = 32, w: int = 32) -> torch.Tensor:
    return torch.randn((1, 3, h, w), generator=torch.Generator().manual_seed(1000))


def make_mask(h: int = 64, w: int = 64) -> np.ndarray:
    """A region of the model's (2x input) output, off-centre so that it does not cover the whole map."""
    mask = np.zeros((h, w), bool)
    mask[h // 8: h // 2, w // 4: w - 4] = True
    return mask


def region_scores(m: nn.Module, x: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
    """Per class, the sum of the segmentation logits over the region, straight from the model's output."""
    return (m(pixel_values=x).logits[0] * torch.from_numpy(mask).float()).sum(dim=(-2, -1))


def reference(model: nn.Module, x: torch.Tensor, mask: np.ndarray, scalar):
    """({(layer, site): (act, grad)} float64, region scores) from my own hooks on an eager deep copy."""
    m, store = hooked_eager_copy(model, LAYERS, DPT_LAYER)
    with torch.enable_grad():
        scores = region_scores(m, x.detach().clone().requires_grad_(True), mask)
        scalar(scores).backward()
    out = {k: (t.detach()[0].double().numpy(), t.grad[0].double().numpy()) for k, t in store.items()}
    return out, scores.detach().double().numpy()


@functools.cache
def dpt_run():
    model, x, mask = build(), make_input(), make_mask()
    before = snapshot(model)
    tr = vc.trace(model, x, targets=vc.targets.region(mask, CLASS), sites=list(DPT_LAYER))
    assert_unchanged(before, model)
    refs = {}
    for target, c in zip(tr["target"].values, tr["target_class"].values, strict=True):
        refs[str(target)], scores = reference(model, x, mask, target_scalar(int(c)))
    return model, x, mask, tr, refs, scores


@pytest.mark.parametrize("site", [pytest.param(s, id=f"hf_dpt-{s}") for s in CORE + EXTENDED])
def test_site_reference(site):
    model, _, _, tr, refs, scores = dpt_run()
    assert tr.attrs["model_family"] == "hf_dpt" and list(tr["layer"].values) == [0, 1, 2, 3]
    assert_rel_close(tr["logits"].values, scores, "region scores")
    assert sorted(refs) == ["expected_logit", f"logit_{CLASS}"]
    for target, ref in refs.items():
        for layer in range(4):
            act, grad = ref[(layer, site)]
            assert_rel_close(traced(tr, site, layer), act, f"act {site}@{layer}")
            assert_rel_close(traced(tr, site, layer, target), grad, f"grad {site}@{layer} {target}")
    assert all(np.abs(ref[(layer, site)][1]).max() > 0 for ref in refs.values() for layer in range(4))


def test_gradcam_of_the_region_sum_equals_a_torch_reference():
    """Grad-CAM at F1 of the last block for the region-sum target, written out with torch ops."""
    model, x, mask, tr, _, _ = dpt_run()
    m = copy.deepcopy(model).eval()
    m.set_attn_implementation("eager")
    seen = {}
    m.get_submodule(LAYERS)[-1].layernorm_before.register_forward_hook(lambda _m, _i, out: seen.update(a=out))
    with torch.enable_grad():
        s = region_scores(m, x, mask)[CLASS]
        (g,) = torch.autograd.grad(s, seen["a"])
    a, g = seen["a"][0, 1:].detach().double(), g[0, 1:].double()  # patch tokens (the class token is first)
    cam = torch.relu(a @ g.mean(dim=0)).reshape(1, 1, 4, 4)

    def minmax(t):
        return (t - t.min()) / (t.max() - t.min())

    ref = minmax(nn.functional.interpolate(minmax(cam), size=(32, 32), mode="bilinear", align_corners=False))[0, 0]
    got = vc.cam(tr, vc.Recipe(site="F1", layer=-1, class_=CLASS, weighting="gradcam", weight_tokens="patch",
                               relu="after", normalize="minmax", upsample="bilinear"))
    assert got.shape == (32, 32) and float(ref.std()) > 0.05
    np.testing.assert_allclose(got.values, ref.numpy(), atol=1e-5)
    checklist = got.attrs["checklist"]
    assert '"module": "dpt.encoder.layer.3.layernorm_before"' in checklist
    assert "the region score s_c of class 1: the sum of its logits over the region" in checklist


def test_tokens_grid_and_attention_restored_at_another_input_size():
    """DPT interpolates its position embeddings: a 64x64 input gives an 8x8 grid and a 128x128 output."""
    model = build()
    x, mask = make_input(64, 64), make_mask(128, 128)
    tr = vc.trace(model, x, targets=vc.targets.region(mask, 2, reduce="mean"), sites=["F1"], layers=[-1])
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"]) == (8, 8) and tr.attrs["num_prefix_tokens"] == 1
    assert list(tr["token_kind"].values[:2]) == ["cls", "patch"]
    with torch.no_grad():
        expected = region_scores(model, x, mask).double().numpy() / mask.sum()
    assert_rel_close(tr["logits"].values, expected, "mean region scores at 64x64")
    assert model.config._attn_implementation == "sdpa"  # switched to eager only during the trace
    assert find_adapter(model).family == "hf_dpt"


def test_refusals_are_clear_and_leave_the_model_as_it_was():
    model, x = build(), make_input()
    before = snapshot(model)
    with pytest.raises(vc.TraceError, match=r"no classifier head.*segmentation model.*targets.region"):
        vc.trace(model, x, sites=["F1"])  # class targets on a (B, C, H, W) output
    with pytest.raises(vc.TraceError, match="mask: 10x10 does not fit the model's 64x64 output"):
        vc.trace(model, x, targets=vc.targets.region(np.ones((10, 10)), 0), sites=["F1"])
    with pytest.raises(vc.TraceError, match="class_: 5 is out of range; the model has 3 classes"):
        vc.trace(model, x, targets=vc.targets.region(make_mask(), 5), sites=["F1"])
    with pytest.raises(vc.TraceError, match="image: 30x30 is not a multiple of the patch size 8"):
        vc.trace(model, make_input(30, 30), targets=vc.targets.region(make_mask(60, 60), 0), sites=["F1"])
    with pytest.raises(vc.TraceError, match="image: 24x40 is not square; DPTForSemanticSegmentation's neck"):
        vc.trace(model, make_input(24, 40), targets=vc.targets.region(make_mask(48, 80), 0), sites=["F1"])
    assert_unchanged(before, model)
    assert model.config._attn_implementation == "sdpa"
    model.config.is_hybrid = True  # the flag the adapter reads; a real hybrid needs a BiT backbone
    with pytest.raises(TypeError, match=r"hybrid backbone \(config.is_hybrid=True.*plain ViT backbone only"):
        vc.trace(model, x, targets=vc.targets.region(make_mask(), 0), sites=["F1"])
    depth = transformers.DPTForDepthEstimation(model.config.__class__(**{**model.config.to_dict(), "is_hybrid": False}))
    with pytest.raises(TypeError, match="DPTForDepthEstimation"):
        find_adapter(depth)


def test_scorecam_on_dpt_matches_pytorch_grad_cam_semantic_segmentation_target():
    """vc.score + vc.cam against pytorch-grad-cam's ScoreCAM with SemanticSegmentationTarget on the same model
    (wrapped to return the ``.logits`` tensor pytorch-grad-cam expects), after its normalisation."""
    pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam import ScoreCAM
    from pytorch_grad_cam.utils.model_targets import SemanticSegmentationTarget

    model, x, mask = build(), make_input(), make_mask()
    target = vc.targets.region(mask, CLASS)
    recipe = vc.Recipe(site="F1", layer=-1, weighting="scorecam", class_=CLASS)
    tr = vc.trace(model, x, targets=target, sites=["F1"], layers=[-1])
    tr = vc.score(tr, model, recipe, x, targets=target, batch_size=8, progress=False)
    ours = vc.cam(tr, recipe).values.astype(np.float64)

    class Logits(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values):
            return self.inner(pixel_values=pixel_values).logits

    def reshape(t):
        return t[:, 1:, :].reshape(t.size(0), 4, 4, t.size(2)).permute(0, 3, 1, 2)

    wrapped = Logits(copy.deepcopy(model)).eval()
    layer = wrapped.inner.get_submodule(LAYERS)[-1].layernorm_before
    with ScoreCAM(model=wrapped, target_layers=[layer], reshape_transform=reshape) as cam:
        cam.batch_size = 8
        theirs = cam(input_tensor=x, targets=[SemanticSegmentationTarget(CLASS, mask.astype(np.float32))])[0]
    assert np.ptp(theirs) > 0.5
    assert np.abs(ours - theirs.astype(np.float64)).max() <= 1e-4
