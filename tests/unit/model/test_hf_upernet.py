"""Hugging Face UperNet with a Swin backbone (``hf_upernet_swin``) under a region target: every site of every
layer and the Grad-CAM map of the last layer checked against plain torch hooks and autograd on the dense
``logits``; a UperNet with another backbone refused; the model left as it was.

The input is 56 px (a 14 x 14 grid, 7 x 7 in stage 1) with 4 x 4 windows: the backbone runs its layers with
``always_partition=True``, so stage 1 pads its 7 x 7 grid to 8 x 8 and keeps the shift of 2 (no clamping)."""

from __future__ import annotations

import copy
import functools
import json

import numpy as np
import pytest
import torch
from vitcam_testing import assert_unchanged, snapshot

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")

IMG, PATCH, WINDOW, CLASS = 56, 4, 4, 1
#: site -> (module relative to the Swin layer, "input"/"output"/"output[i]") of the reference hooks.
MODULES = {"F1": ("layernorm_before", "output"), "F2": ("attention", "output[1]"), "F3": ("attention.o_proj", "input"),
           "F4": ("layernorm_after", "output"), "F5": ("mlp", "output"), "F6": ("", "output[0]")}
WINDOWED = ("F2", "F3")


def make_upernet(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    swin = transformers.SwinConfig(image_size=IMG, patch_size=PATCH, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                                   window_size=WINDOW, out_features=["stage1", "stage2"])
    cfg = transformers.UperNetConfig(backbone_config=swin, hidden_size=16, num_labels=3, pool_scales=[1, 2],
                                     use_auxiliary_head=False)
    model = transformers.UperNetForSemanticSegmentation(cfg)
    with torch.no_grad():  # sharper attention than the near-uniform random init, so windows matter
        for n, p in model.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(20.0)
            if "relative_position_bias_table" in n:
                p.copy_(torch.randn_like(p))
    return model.eval()


def make_image(seed: int = 1) -> torch.Tensor:
    return torch.randn(1, 3, IMG, IMG, generator=torch.Generator().manual_seed(seed))


def make_mask() -> np.ndarray:
    mask = np.zeros((IMG, IMG), bool)
    mask[6:30, 20:52] = True
    return mask


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [blk for stage in model.backbone.swin.encoder.layers for blk in stage.blocks]


def _grid(layer: int) -> tuple[int, int]:
    g = IMG // PATCH
    return (g, g) if layer < 2 else (-(-g // 2), -(-g // 2))


def _unwindow(windowed: torch.Tensor, layer: int, shift: int) -> torch.Tensor:
    """(windows, N, C) of one image -> (H * W, C) raster tokens: windows back onto the padded grid, the cyclic
    shift rolled back, the padding cropped (the layer pads before it shifts)."""
    h, w = _grid(layer)
    hp, wp = -(-h // WINDOW) * WINDOW, -(-w // WINDOW) * WINDOW
    c = windowed.shape[-1]
    x = windowed.reshape(hp // WINDOW, wp // WINDOW, WINDOW, WINDOW, c).permute(0, 2, 1, 3, 4).reshape(hp, wp, c)
    if shift:
        x = torch.roll(x, shifts=(shift, shift), dims=(0, 1))
    return x[:h, :w].reshape(h * w, c)


def reference(model: torch.nn.Module, x: torch.Tensor, mask: np.ndarray) -> dict:
    """Every site of every layer with hooks and retain_grad on an eager copy; one backward of the region sum of
    class ``CLASS`` over the dense logits."""
    model = copy.deepcopy(model)
    model.set_attn_implementation("eager")
    keep: dict = {}

    def grab(key, tensor):
        tensor.retain_grad()
        keep[key] = tensor

    for i, blk in enumerate(_layers(model)):
        for site, (path, io) in MODULES.items():
            module = blk.get_submodule(path) if path else blk
            if io == "input":
                module.register_forward_pre_hook(lambda m, a, k=(i, site): grab(k, a[0]))
            else:
                index = int(io[-2]) if io.endswith("]") else None
                module.register_forward_hook(lambda m, a, o, k=(i, site), j=index: grab(k, o if j is None else o[j]))
    logits = model(x.clone()).logits
    assert logits.shape == (1, 3, IMG, IMG)
    (logits[0, CLASS] * torch.from_numpy(mask).float()).sum().backward()
    ref = {}
    for (layer, site), t in keep.items():
        shift = WINDOW // 2 if layer % 2 else 0
        act, grad = t.detach(), t.grad.detach()
        if site == "F3":
            ref[(layer, site)] = (_unwindow(act, layer, shift), _unwindow(grad, layer, shift))
        elif site == "F2":  # (windows, heads, N, N): rows by raster query token, found through the same path
            n_win, heads, n, _ = act.shape
            slots = torch.arange(n_win * n, dtype=torch.float64).reshape(n_win, n, 1)
            slot_of = _unwindow(slots, layer, shift)[:, 0].long()
            rows = [a.transpose(0, 1).reshape(heads, n_win * n, n)[:, slot_of] for a in (act, grad)]
            ref[(layer, site)] = tuple(rows)
        else:
            ref[(layer, site)] = (act[0], grad[0])
    return ref


@functools.lru_cache(maxsize=1)
def traced() -> tuple:
    model, x, mask = make_upernet(), make_image(), make_mask()
    tr = vc.trace(model, x, targets=vc.targets.region(mask, CLASS), sites=list(MODULES))
    return model, x, mask, tr, reference(model, x, mask)


def _close(got: np.ndarray, want: torch.Tensor) -> None:
    want = want.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("site", list(MODULES))
@pytest.mark.parametrize("family", ["hf_upernet_swin"])
def test_site_reference(family, site):
    _, _, _, tr, ref = traced()
    target = f"logit_{CLASS}"
    for layer in range(4):
        ds = vc.stages.stage_dataset(tr, 0 if layer < 2 else 1)
        act, grad = ref[(layer, site)]
        if site == "F2":
            _close(ds["attn_window"].sel(layer=layer).values, act)
            _close(ds["attn_window_grad"].sel(layer=layer, target=target).values, grad)
        else:
            _close(ds["act"].sel(layer=layer, site=site).values, act)
            _close(ds["grad"].sel(layer=layer, site=site, target=target).values, grad)


def test_gradcam_of_the_region_score_at_the_last_layer():
    """Grad-CAM at F1 of the last layer: ReLU of the channel sum of the activation weighted by the token mean of
    the region-sum gradient, on the last stage's 7 x 7 grid, from hooks and autograd written here."""
    model, x, mask, tr, _ = traced()
    ref_model = copy.deepcopy(model)
    ref_model.set_attn_implementation("eager")
    seen = {}
    _layers(ref_model)[-1].layernorm_before.register_forward_hook(lambda m, a, o: seen.setdefault("F1", o))
    score = (ref_model(x).logits[0, CLASS] * torch.from_numpy(mask).float()).sum()
    grad = torch.autograd.grad(score, seen["F1"])[0][0]
    act = seen["F1"].detach()[0]
    want = torch.relu(act @ grad.mean(0)).reshape(7, 7).numpy()
    got = vc.cam(tr, vc.Recipe(site="F1", layer=-1, class_=CLASS, upsample="none", normalize="none"))
    assert got.shape == (7, 7) and want.max() > 0
    np.testing.assert_allclose(got.values, want, rtol=1e-5, atol=1e-5 * want.max())
    with torch.no_grad():  # the stored scores are the region sums of every class
        region = (ref_model(x).logits[0] * torch.from_numpy(mask)).sum(dim=(-2, -1))
    np.testing.assert_allclose(tr["logits"].values, region.numpy(), rtol=1e-5)


def test_tree_attrs_and_checklist():
    _, _, _, tr, _ = traced()
    assert tr.attrs["model_family"] == "hf_upernet_swin" and tr.attrs["target_kind"] == "region"
    assert (tr["stage_0"].attrs["grid_h"], tr["stage_1"].attrs["grid_w"]) == (14, 7)
    hook = "backbone.swin.encoder.layers.{stage}.blocks.{block}.layernorm_before:output"
    assert tr["stage_1"].attrs["hook_F1"] == hook
    assert "UperNet" in tr.attrs["dense_head"] and "sdpa" in tr.attrs["attention_backend"]
    checklist = json.loads(vc.cam(tr, vc.Recipe(site="F1", layer="1.-1", class_=CLASS)).attrs["checklist"])
    assert checklist["feature representation"]["module"] == "backbone.swin.encoder.layers.1.blocks.1.layernorm_before"


def test_model_returned_unchanged_also_in_train_mode_with_frozen_backbone():
    model = make_upernet()
    model.decode_head.train()  # BatchNorm running statistics must not move
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    windows = [(b.window_size, b.shift_size) for b in _layers(model)]
    impls = (model.config._attn_implementation_internal, model.backbone.config._attn_implementation_internal)
    before = snapshot(model)
    vc.trace(model, make_image(), targets=vc.targets.region(make_mask(), 0), sites=["F1", "F2"], layers=[-1])
    assert_unchanged(before, model)
    assert [(b.window_size, b.shift_size) for b in _layers(model)] == windows
    assert (model.config._attn_implementation_internal, model.backbone.config._attn_implementation_internal) == impls


def test_class_targets_are_refused_with_the_dense_ones():
    model = make_upernet()
    before = snapshot(model)
    with pytest.raises(vc.TraceError, match=r"class targets need logits.*segmentation model.*targets\.region\(mask"):
        vc.trace(model, make_image(), targets="top1", sites=["F1"])
    assert_unchanged(before, model)


def test_another_backbone_is_refused_with_what_is_supported():
    torch.manual_seed(0)
    convnext = transformers.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                                           out_features=["stage1", "stage2"])
    model = transformers.UperNetForSemanticSegmentation(transformers.UperNetConfig(
        backbone_config=convnext, hidden_size=8, num_labels=2, pool_scales=[1], use_auxiliary_head=False)).eval()
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"model: UperNetForSemanticSegmentation with a ConvNextBackbone backbone is "
                                        r"not supported; the hf_upernet_swin adapter reads UperNet with a Swin "
                                        r"backbone \(SwinBackbone"):
        vc.trace(model, torch.randn(1, 3, 32, 32), targets=vc.targets.region(np.ones((32, 32)), 0))
    assert_unchanged(before, model)


@pytest.mark.parametrize("sites", [["F1"], ["F2", "F3"], list(MODULES)])
def test_the_memory_estimate_reads_the_backbone_config_and_padded_windows(sites):
    model, x, mask = make_upernet(), make_image(), make_mask()
    est = vc.estimate(model, x, vc.targets.region(mask, CLASS), sites=sites)
    tr = vc.trace(model, x, targets=vc.targets.region(mask, CLASS), sites=sites)
    assert abs(est["dataset_bytes"] / tr.nbytes - 1) < 0.01
    # the padded window of the last stage (grid smaller than the window): every key of the full window is stored
    if "F2" in sites:
        assert est["parts"]["attn_window"] == tr.children[list(tr.children)[-1]]["attn_window"].nbytes + \
            tr.children[list(tr.children)[0]]["attn_window"].nbytes
