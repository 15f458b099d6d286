"""The pass writes every captured variable into its final array as it produces it (issue #35, item 1): the arrays
are bitwise those of a plain reference (forward hooks + one batched ``torch.autograd.grad``, written here), the
Dataset holds the pass's own arrays (no copy), autograd returns the gradients of the lowest tensors only (the rest
go straight into the arrays)."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
import vitcam_nb.capture.passes as passes
from vitcam_nb.capture.assemble import assemble
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.prealloc import batched_hooks_work, lowest_tensors
from vitcam_nb.preprocess import prepare_input

K = 3
SITES = ["F1", "F2", "F3", "F4", "F5", "F6"]


def timm_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=10).eval()


def x_for(size: int = 32) -> torch.Tensor:
    return torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))


def reference(model: torch.nn.Module, x: torch.Tensor, points: dict, store: type, logits=lambda out: out) -> dict:
    """Plain forward hooks on the site modules and one batched ``torch.autograd.grad`` over the top-K logits and
    the expected logit, converted with NumPy: {(layer, site): (act, grad)}."""
    kept, handles = {}, []
    for key, (module, io) in points.items():
        if io == "input":
            handles.append(module.register_forward_pre_hook(lambda _m, a, key=key: kept.__setitem__(key, a[0])))
        else:
            handles.append(module.register_forward_hook(
                lambda _m, _a, out, key=key: kept.__setitem__(key, out[0] if isinstance(out, tuple) else out)))
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in params:
            p.requires_grad_(False)
        z = logits(model(x.clone().requires_grad_(True)))
        top = torch.topk(z[0].detach(), K).indices
        expected = (torch.softmax(z.detach(), dim=1) * z).sum(dim=1)
        outputs = torch.cat([z[0, top], expected])
        keys = list(kept)
        grads = torch.autograd.grad(outputs, [kept[k] for k in keys], grad_outputs=torch.eye(K + 1),
                                    is_grads_batched=True)
    finally:
        for h in handles:
            h.remove()
        for p in params:
            p.requires_grad_(True)
    return {k: (kept[k].detach()[0].numpy().astype(store), g[:, 0].numpy().astype(store))
            for k, g in zip(keys, grads)}


def timm_points(model: torch.nn.Module) -> dict:
    out = {}
    for i, b in enumerate(model.blocks):
        b.attn.fused_attn = False  # F2 exists as a tensor only in timm's explicit attention
        out.update({(i, "F1"): (b.norm1, "output"), (i, "F2"): (b.attn.attn_drop, "output"),
                    (i, "F3"): (b.attn.proj, "input"), (i, "F4"): (b.norm2, "output"), (i, "F5"): (b.mlp, "output"),
                    (i, "F6"): (b, "output")})
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_timm_trace_is_bitwise_the_plain_hooks_and_autograd_reference(dtype):
    model, x = timm_vit(), x_for()
    tr = vc.trace(model, x, targets=f"top{K}", sites=SITES, dtype=dtype)
    ref = reference(model, x, timm_points(model), np.dtype(dtype).type)
    token_sites = [s for s in SITES if s != "F2"]
    for (layer, site), (act, grad) in ref.items():
        if site == "F2":
            got_act, got_grad = tr["attn"].values[layer], tr["attn_grad"].values[:, layer]
        else:
            si = token_sites.index(site)
            got_act, got_grad = tr["act"].values[layer, si], tr["grad"].values[:, layer, si]
        assert got_act.dtype == got_grad.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got_act, act, err_msg=f"act {site}@{layer}")
        np.testing.assert_array_equal(got_grad, grad, err_msg=f"grad {site}@{layer}")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_hugging_face_trace_is_bitwise_the_plain_hooks_and_autograd_reference(dtype):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, num_labels=6)
    cfg._attn_implementation = "eager"  # the attention the trace runs (it switches any other to eager)
    model = transformers.ViTForImageClassification(cfg).eval()
    x = x_for()
    sites = ["F1", "F4", "F6"]
    tr = vc.trace(model, x, targets=f"top{K}", sites=sites, dtype=dtype)
    points = {}
    for i, layer in enumerate(model.vit.layers if hasattr(model.vit, "layers") else model.vit.encoder.layer):
        points.update({(i, "F1"): (layer.layernorm_before, "output"), (i, "F4"): (layer.layernorm_after, "output"),
                       (i, "F6"): (layer, "output")})
    ref = reference(model, x, points, np.dtype(dtype).type, logits=lambda out: out.logits)
    for (layer, site), (act, grad) in ref.items():
        si = sites.index(site)
        np.testing.assert_array_equal(tr["act"].values[layer, si], act, err_msg=f"act {site}@{layer}")
        np.testing.assert_array_equal(tr["grad"].values[:, layer, si], grad, err_msg=f"grad {site}@{layer}")


def test_the_dataset_holds_the_arrays_the_pass_wrote():
    model = timm_vit()
    plan = TracePlan.for_trace(model, "top2", sites=["F1", "F2", "F6"])
    prepared = prepare_input(model, np.zeros((32, 32, 3), np.uint8))
    image = passes.run_pass(plan, prepared.tensor, arrays=True).image(0)
    filled = dict(image.filled)
    ds = assemble(plan, prepared, image, passes.run_pass(plan, prepared.tensor))
    for name, key in (("act", ((0, 1), ("F1", "F6"), "act")), ("grad", ((0, 1), ("F1", "F6"), "grad")),
                      ("attn", ((0, 1), ("F2",), "act")), ("attn_grad", ((0, 1), ("F2",), "grad"))):
        assert filled[key].shape == ds[name].shape
    ds = assemble(plan, prepared, image, passes.run_pass(plan, prepared.tensor, arrays=True))
    assert np.shares_memory(ds["grad"].values, filled[((0, 1), ("F1", "F6"), "grad")])
    assert np.shares_memory(ds["attn_grad"].values, filled[((0, 1), ("F2",), "grad")])
    assert image.acts == {} and image.grads == {}  # nothing left to copy


def test_autograd_returns_only_the_lowest_tensors_gradients(monkeypatch):
    # Every other gradient goes into its array from a hook as it is produced; the old pass had autograd hold all
    # 2 layers x 6 sites until the end of the backward pass.
    assert batched_hooks_work()  # probed once per process, before the count
    seen = []
    grad = torch.autograd.grad

    def counting(outputs, inputs, *args, **kwargs):
        seen.append(len(inputs))
        return grad(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting)
    # a pass this small has autograd return every gradient (passes.HOOKS_FROM); one at the size where hooks pay:
    monkeypatch.setattr(passes, "HOOKS_FROM", 0)
    tr = vc.trace(timm_vit(), x_for(), targets="top2", sites=SITES, dtype="float16")  # the array pass
    assert seen == [1]  # block 0's F1 lies below every other site
    assert np.abs(tr["grad"].values).max() > 0
    monkeypatch.setattr(passes, "HOOKS_FROM", 1 << 40)
    small = vc.trace(timm_vit(), x_for(), targets="top2", sites=SITES, dtype="float16")
    assert seen[1:] == [12]  # every site of the 2 layers returned at once, the same values
    for name in ("act", "grad", "attn", "attn_grad"):
        np.testing.assert_array_equal(small[name].values, tr[name].values, err_msg=name)


def test_without_readable_batched_hooks_the_arrays_are_the_same(monkeypatch):
    model, x = timm_vit(), x_for()
    want = vc.trace(model, x, targets="top2", sites=SITES, dtype="float16")
    monkeypatch.setattr(passes, "batched_hooks_work", lambda: False)
    got = vc.trace(model, x, targets="top2", sites=SITES, dtype="float16")
    for name in ("act", "grad", "attn", "attn_grad"):
        np.testing.assert_array_equal(got[name].values, want[name].values, err_msg=name)


def test_a_swin_trace_writes_the_same_arrays_as_the_tensor_pass():
    from vitcam_nb.capture.staged import assemble_tree

    torch.manual_seed(0)
    m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1), num_heads=(2, 4),
                          embed_dim=16, img_size=56, window_size=7, num_classes=5).eval()
    plan = TracePlan.for_trace(m, "top2", sites=["F1", "F2", "F3", "F6"], dtype="float16")
    prepared = prepare_input(m, np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    new = assemble_tree(plan, prepared, passes.run_pass(plan, prepared.tensor, arrays=True).image(0),
                        passes.run_pass(plan, prepared.tensor, arrays=True))
    run = passes.run_pass(plan, prepared.tensor)
    old = assemble_tree(plan, prepared, run.image(0), run)
    for node in ("stage_0", "stage_1"):
        for name in ("act", "grad", "attn_window", "attn_window_grad"):
            np.testing.assert_array_equal(new[node][name].values, old[node][name].values, err_msg=f"{node} {name}")


def test_lowest_tensors_keeps_siblings_and_leaves():
    x = torch.ones(4, requires_grad=True)
    h = x * 2
    q, k = h.split(2)  # two outputs of one node: neither lies below the other
    s = q * k
    assert lowest_tensors([s, q, k]) == [1, 2]
    assert lowest_tensors([s, h, q]) == [1]
    assert lowest_tensors([s, x]) == [1]  # a leaf is always kept
