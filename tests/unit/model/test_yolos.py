"""Hugging Face YOLOS (issue #37): a plain ViT with detection tokens appended, traced with a detection target.

The reference never calls vitcam_nb: it deep-copies the model, sets the eager attention with transformers' own
``set_attn_implementation``, hooks the modules named below (read from transformers' ``YolosLayer.forward``) with
``retain_grad()`` and runs one fresh forward + ``backward()`` per target scalar. The model's sequence is (class,
patches, detections); the trace stores (class, detections, patches), so the reference is reordered here to compare.

Naming convention (scripts/support_matrix.py): ``test_site_reference`` ids are ``"<family>-<site>"``.
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

N_DET, N_LABELS, GRID = 5, 3, (4, 4)
LAYERS = "vit.encoder.layer"
SITES = {"F1": ("layernorm_before", "output"), "F2": ("attention.attention", "weights"),
         "F3": ("attention.output.dense", "input"), "F4": ("layernorm_after", "output"),
         "F5": ("output.dense", "output"), "F6": ("", "output"), "resid_pre": ("", "input"),
         "attn_out": ("attention", "output"), "resid_mid": ("layernorm_after", "input"),
         "q": ("attention.attention.query", "output"), "k": ("attention.attention.key", "output"),
         "v": ("attention.attention.value", "output")}
QUERIES, CLASS = [1, 3], 2


def redraw(model: nn.Module, seed: int = 0) -> nn.Module:
    """O(1) weights and tokens, so that a wrong hook or a wrong token order cannot hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("cls_token", "detection_tokens", "position_embeddings", "mid_position_embeddings"):
                p.copy_(0.5 * noise)
            elif leaf == "weight" and p.ndim == 1:
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim >= 2:
                p.copy_(noise / math.sqrt(p[0].numel()))
            else:
                p.copy_(0.1 * noise)
    return model.eval()


def build_yolos(seed: int = 0, **kwargs) -> nn.Module:
    cfg = transformers.YolosConfig(**{**dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=64, image_size=[32, 32], patch_size=8,
                                             num_detection_tokens=N_DET, num_labels=N_LABELS), **kwargs})
    torch.manual_seed(seed)
    return redraw(transformers.YolosForObjectDetection(cfg), seed)


def yolos_input(seed: int = 0, hw: tuple[int, int] = (32, 32)) -> torch.Tensor:
    return torch.randn((1, 3, *hw), generator=torch.Generator().manual_seed(1000 + seed))


def to_trace_order(a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """(class, patches, detections) -> (class, detections, patches) along each axis in ``axes``."""
    for ax in axes:
        n = a.shape[ax]
        order = [0, *range(n - N_DET, n), *range(1, n - N_DET)]
        a = np.take(a, order, axis=ax)
    return a


def reference(model: nn.Module, x: torch.Tensor, scalar):
    """({(layer, site): (act, grad)} in the trace's token order, float64; the detection logits (Q, C+1))."""
    m, store = hooked_eager_copy(model, LAYERS, SITES)
    with torch.enable_grad():
        logits = m(pixel_values=x.detach().clone().requires_grad_(True)).logits[0]
        scalar(logits).backward()
    out = {}
    for (layer, site), t in store.items():
        axes = (-2, -1) if site == "F2" else (-2,)
        out[(layer, site)] = tuple(to_trace_order(v[0].double().numpy(), axes) for v in (t.detach(), t.grad))
    return out, logits.detach().double().numpy()


def scalar_for(target_class: int):
    return target_scalar(target_class, lambda logits: logits[QUERIES, CLASS])


@functools.cache
def yolos_run():
    model, x = build_yolos(), yolos_input()
    before = snapshot(model)
    tr = vc.trace(model, x, targets=vc.targets.detection(query=QUERIES, class_=CLASS), sites=list(SITES))
    assert_unchanged(before, model)
    refs, logits = {}, None
    for target, c in zip(tr["target"].values, tr["target_class"].values, strict=True):
        refs[str(target)], logits = reference(model, x, scalar_for(int(c)))
    return model, x, tr, refs, logits


@pytest.mark.parametrize("site", [pytest.param(s, id=f"hf_yolos-{s}") for s in SITES])
def test_site_reference(site):
    model, _, tr, refs, logits = yolos_run()
    assert tr.attrs["model_family"] == "hf_yolos" and list(tr["layer"].values) == [0, 1]
    assert_rel_close(tr["logits"].values, logits[QUERIES, CLASS], "detection logits")
    for target, ref in refs.items():
        for layer in (0, 1):
            act, grad = ref[(layer, site)]
            assert_rel_close(traced(tr, site, layer), act, f"act {site}@{layer}")
            assert_rel_close(traced(tr, site, layer, target), grad, f"grad {site}@{layer} {target}")
    assert any(np.abs(ref[(0, site)][1]).max() > 0 for ref in refs.values())


def test_detection_tokens_are_named_and_stored_after_the_class_token():
    """Perturbing detection token j of the model changes exactly trace token 1 + j (kind "det") at the first
    layer's input; the patch grid follows in raster order."""
    model, x, tr, _, _ = yolos_run()
    assert list(tr["token_kind"].values) == ["cls"] + ["det"] * N_DET + ["patch"] * 16
    assert tr.attrs["num_prefix_tokens"] == 1 + N_DET and tr.attrs["num_detection_tokens"] == N_DET
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"]) == GRID
    rows, cols = tr["patch_row"].values[1 + N_DET:], tr["patch_col"].values[1 + N_DET:]
    assert list(zip(rows, cols)) == [(r, c) for r in range(4) for c in range(4)]
    target = vc.targets.detection(query=0, class_=0)
    base = vc.trace(model, x, targets=target, sites=["resid_pre"], layers=[0])["act"].values[0, 0]
    for j in (0, 2, 4):
        m = copy.deepcopy(model)
        with torch.no_grad():
            m.vit.embeddings.detection_tokens[0, j] += 1.0
        act = vc.trace(m, x, targets=target, sites=["resid_pre"], layers=[0])["act"].values[0, 0]
        changed = np.flatnonzero(np.abs(act - base).sum(-1) > 0)
        assert changed.tolist() == [1 + j]


def test_checklist_names_the_module_and_the_detection_tokens_and_attention_is_restored():
    model, _, tr, _, _ = yolos_run()
    assert model.config._attn_implementation == "sdpa"
    checklist = vc.cam(tr, vc.Recipe(site="F1", layer=-1, class_=0)).attrs["checklist"]
    assert f'"module": "{LAYERS}.1.layernorm_before"' in checklist
    assert '"prefix tokens present": "6 (cls, det, det, det, det, det)"' in checklist
    assert "sdpa implementation switched to eager for the trace" in checklist


def test_another_input_size_interpolates_and_another_layout_is_refused_with_the_version():
    model, x = build_yolos(), yolos_input(hw=(24, 40))
    tr = vc.trace(model, x, targets=vc.targets.detection(query=4, class_=1), sites=["F1"], layers=[-1])
    with torch.no_grad():
        want = model(pixel_values=x).logits[0, 4, 1].double().numpy()
    assert_rel_close(tr["logits"].values, want[None], "logit at 24x40")
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"]) == (3, 5)
    assert find_adapter(model).family == "hf_yolos"
    old = build_yolos()
    for layer in old.vit.encoder.layer:  # the layout another transformers version would have
        layer.attention.attention.q_proj = layer.attention.attention.query
        del layer.attention.attention.query
    with pytest.raises(TypeError, match=r"not the YOLOS layout of transformers 5.*transformers>=5,<6"):
        vc.trace(old, yolos_input(), targets=vc.targets.detection(query=0, class_=0), sites=["F1"])
