"""Hugging Face Swin / Swin V2 (``hf_swin``, ``hf_swinv2``): hierarchical traces checked against the model's own
forward with hand-written autograd: a deep copy on eager attention, hooks on the named modules, ``retain_grad``,
one backward per target, windowed tensors put back with transformers' own ``window_reverse`` and roll.

The input is 56 px (a 14 x 14 grid, 7 x 7 in stage 1) with 4 x 4 windows, so every layer pads, and the
Hugging Face order (pad, then shift) differs from timm's (shift, then pad)."""

from __future__ import annotations

import copy
import functools
import json

import numpy as np
import pytest
import torch
import xarray as xr
from vitcam_testing import assert_unchanged, snapshot

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")

IMG, PATCH, WINDOW = 56, 4, 4
SITES = ("F1", "F2", "F3", "F4", "F5", "F6", "resid_pre", "attn_out", "resid_mid")
#: site -> (module relative to the layer, "input"/"output"/"output[i]") of the reference hooks.
MODULES = {
    False: {"F1": ("layernorm_before", "output"), "F2": ("attention", "output[1]"),
            "F3": ("attention.o_proj", "input"), "F4": ("layernorm_after", "output"), "F5": ("mlp", "output"),
            "F6": ("", "output[0]"), "resid_pre": ("", "input"), "attn_out": ("attention", "output[0]"),
            "resid_mid": ("layernorm_after", "input")},
    True: {"F2": ("attention.self.dropout", "output"), "F3": ("attention.output.dense", "input"),
           "F5": ("output", "output"), "F6": ("", "output[0]"), "resid_pre": ("", "input"),
           "attn_out": ("attention", "output[0]"), "resid_mid": ("intermediate", "input")},
}
WINDOWED = ("F2", "F3", "attn_out")


def make_hf_swin(v2: bool = False, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    kw = dict(image_size=IMG, patch_size=PATCH, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=WINDOW,
              num_labels=5, id2label={i: f"shape_{i}" for i in range(5)}, label2id={f"shape_{i}": i for i in range(5)})
    kw.update(overrides)
    if v2:
        model = transformers.Swinv2ForImageClassification(transformers.Swinv2Config(**kw))
    else:
        model = transformers.SwinForImageClassification(transformers.SwinConfig(**kw))
    with torch.no_grad():  # sharper attention than the near-uniform random init, so windows matter
        for n, p in model.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight", "query.weight", "key.weight")):
                p.mul_(20.0)
            if "continuous_position_bias_mlp" in n or "logit_scale" in n:
                p.add_(torch.randn_like(p) * 0.5)
            if "relative_position_bias_table" in n:
                p.copy_(torch.randn_like(p))
    return model.eval()


def make_image(seed: int = 1) -> torch.Tensor:
    return torch.randn(1, 3, IMG, IMG, generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=2)
def traced(v2: bool) -> tuple:
    model = make_hf_swin(v2=v2)
    x = make_image()
    before = snapshot(model)
    windows = [(b.window_size, b.shift_size) for s in model.base_model.encoder.layers for b in s.blocks]
    impl = model.config._attn_implementation_internal
    tr = vc.trace(model, x, targets="top2", sites=list(MODULES[v2]))
    assert_unchanged(before, model)
    assert [(b.window_size, b.shift_size) for s in model.base_model.encoder.layers for b in s.blocks] == windows
    assert model.config._attn_implementation_internal == impl
    return model, x, tr, reference(model, x, [int(c) for c in tr["target_class"].values[:-1]], v2)


def _merge(blk: torch.nn.Module, grid: tuple[int, int], windowed: torch.Tensor, v2: bool) -> torch.Tensor:
    """The layer's own merge path (window_reverse on the padded grid, roll by +shift, crop) on (windows, N, C)."""
    mod = transformers.models.swinv2.modeling_swinv2 if v2 else transformers.models.swin.modeling_swin
    ws, shift = int(blk.window_size), int(blk.shift_size)
    h, w = grid
    hp, wp = -(-h // ws) * ws, -(-w // ws) * ws
    x = mod.window_reverse(windowed.reshape(-1, ws, ws, windowed.shape[-1]), ws, hp, wp)
    if shift:
        x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
    return x[:, :h, :w, :].reshape(h * w, -1)


def reference(model: torch.nn.Module, x: torch.Tensor, classes: list[int], v2: bool) -> dict:
    """Every site of every layer with retain_grad, one backward per target (classes + expected logit)."""
    model = copy.deepcopy(model)
    model.set_attn_implementation("eager")
    blocks = [b for s in model.base_model.encoder.layers for b in s.blocks]
    keep: dict = {}

    def grab(key, tensor):
        tensor.retain_grad()
        keep[key] = tensor

    for i, blk in enumerate(blocks):
        for site, (path, io) in MODULES[v2].items():
            module = blk.get_submodule(path) if path else blk
            if io == "input":
                module.register_forward_pre_hook(lambda m, a, k=(i, site): grab(k, a[0]))
            else:
                index = int(io[-2]) if io.endswith("]") else None
                module.register_forward_hook(
                    lambda m, a, o, k=(i, site), j=index: grab(k, o if j is None else o[j]))
    z = model(x.clone()).logits[0]
    p = torch.softmax(z.detach(), 0)
    outputs = [z[c] for c in classes] + [(p * z).sum()]
    grads = {k: [] for k in keep}
    for out in outputs:
        for t in keep.values():
            t.grad = None
        out.backward(retain_graph=True)
        for k, t in keep.items():
            grads[k].append(t.grad.detach().clone())
    g = IMG // PATCH
    ref = {}
    for (layer, site), t in keep.items():
        blk, grid = blocks[layer], (g, g) if layer < 2 else (g // 2 + g % 2, g // 2 + g % 2)
        gr = torch.stack(grads[(layer, site)])
        if site not in WINDOWED:
            ref[(layer, site)] = (t.detach()[0], gr[:, 0])
        elif site != "F2":
            merged = torch.stack([_merge(blk, grid, gi, v2) for gi in gr])
            ref[(layer, site)] = (_merge(blk, grid, t.detach(), v2), merged)
        else:  # (windows, heads, N, N) -> rows by raster query token through the merge path of slot ids
            n_win, heads, n, _ = t.shape
            slots = torch.arange(n_win * n, dtype=torch.float64).reshape(n_win, n, 1)
            slot_of = _merge(blk, grid, slots, v2)[:, 0].long()  # raster token -> its (window, position) slot
            rows = t.detach().transpose(0, 1).reshape(heads, n_win * n, n)[:, slot_of]
            grows = gr.transpose(1, 2).reshape(len(outputs), heads, n_win * n, n)[:, :, slot_of]
            raster_of_slot = torch.full((n_win * n,), -1, dtype=torch.long)
            raster_of_slot[slot_of] = torch.arange(slot_of.numel())
            keys = raster_of_slot.reshape(n_win, n)[slot_of // n]
            ref[(layer, site)] = (rows, grows, keys)
    return ref


def _stage(tr: xr.DataTree, layer: int) -> xr.Dataset:
    return vc.stages.stage_dataset(tr, 0 if layer < 2 else 1)


def _close(got: np.ndarray, want: torch.Tensor) -> None:
    want = want.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("family", ["hf_swin", "hf_swinv2"])
def test_site_reference(family, site):
    v2 = family == "hf_swinv2"
    if site not in MODULES[v2]:
        pytest.skip("Swin V2 layers are post-norm: no LayerNorm feeds attention or the MLP")
    _, _, tr, ref = traced(v2)
    for layer in range(4):
        ds = _stage(tr, layer)
        if site == "F2":
            rows, grows, keys = ref[(layer, site)]
            np.testing.assert_array_equal(ds["attn_window_key"].sel(layer=layer).values, keys.numpy())
            _close(ds["attn_window"].sel(layer=layer).values, rows)
            _close(ds["attn_window_grad"].sel(layer=layer).values, grows)
        else:
            act, grad = ref[(layer, site)]
            _close(ds["act"].sel(layer=layer, site=site).values, act)
            _close(ds["grad"].sel(layer=layer, site=site).values, grad)


@pytest.mark.parametrize("family,site", [("hf_swinv2", "F1"), ("hf_swinv2", "F4")],
                         ids=["hf_swinv2-F1", "hf_swinv2-F4"])
def test_site_not_applicable(family, site):
    model = make_hf_swin(v2=True)
    with pytest.raises(vc.TraceError, match=rf"sites: .*{site}.*this hf_swinv2 model has \['F2', 'F3', 'F5', 'F6'"):
        vc.trace(model, make_image(), targets="top1", sites=[site])


@pytest.mark.parametrize("v2", [False, True], ids=["hf_swin", "hf_swinv2"])
def test_tree_attrs_checklist_and_labels(v2):
    model, x, tr, _ = traced(v2)
    prefix = "swinv2" if v2 else "swin"
    assert sorted(tr.children) == ["stage_0", "stage_1"]
    assert tr.attrs["model_family"] == ("hf_swinv2" if v2 else "hf_swin")
    assert (tr["stage_0"].attrs["grid_h"], tr["stage_1"].attrs["grid_h"]) == (14, 7)
    assert (tr["stage_0"].attrs["num_heads"], tr["stage_1"].attrs["num_heads"]) == (2, 4)
    assert (tr["stage_0"].attrs["stage_dim"], tr["stage_1"].attrs["head_dim"]) == (16, 8)
    f3 = "attention.output.dense" if v2 else "attention.o_proj"
    assert tr["stage_1"].attrs["hook_F3"] == f"{prefix}.encoder.layers.{{stage}}.blocks.{{block}}.{f3}:input"
    checklist = json.loads(vc.cam(tr, vc.Recipe(site="F3", layer="1.-1")).attrs["checklist"])
    assert checklist["feature representation"]["module"] == f"{prefix}.encoder.layers.1.blocks.1.{f3}"
    assert all(str(v).startswith("shape_") for v in tr["target_label"].values[:-1])
    with torch.no_grad():
        np.testing.assert_allclose(tr["logits"].values, model(x).logits[0].numpy(), rtol=1e-5, atol=1e-6)
    if not v2:
        assert tr.attrs["hf_attn_implementation"] == "sdpa" and "sdpa" in tr.attrs["attention_backend"]


def test_bare_swin_model_and_clamped_window_restored():
    """SwinModel (no ``swin.`` prefix, similarity target on the pooled output) with 8 x 8 windows: stage 1 (an
    8 x 8 grid) runs clamped and unshifted; the layer's own window and shift come back after the trace."""
    torch.manual_seed(0)
    cfg = transformers.SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                                  window_size=8)
    model = transformers.SwinModel(cfg).eval()
    last = model.encoder.layers[1].blocks[1]
    assert (last.window_size, last.shift_size) == (8, 4)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():  # on a copy: the forward of transformers clamps the window in place
        feat = copy.deepcopy(model)(x).pooler_output
    tr = vc.trace(model, x, targets=vc.targets.similarity(feat), sites=["F2", "F6"])
    assert (last.window_size, last.shift_size) == (8, 4)
    assert tr["stage_1"].attrs["hook_F6"] == "encoder.layers.{stage}.blocks.{block}:output"
    keys = tr["stage_1"]["attn_window_key"].sel(layer=3).values
    np.testing.assert_array_equal(keys[0], np.arange(64))  # one unshifted window holds the whole 8 x 8 grid
    ref_model = copy.deepcopy(model)
    ref_model.set_attn_implementation("eager")
    with torch.no_grad():
        weights = ref_model(x, output_attentions=True).attentions[-1][0]  # (heads, 64, 64), last layer
    np.testing.assert_allclose(tr["stage_1"]["attn_window"].sel(layer=3).values, weights.numpy(), rtol=1e-5,
                               atol=1e-7)


def test_absolute_position_embeddings_refuse_another_size():
    model = make_hf_swin(use_absolute_embeddings=True)
    with pytest.raises(vc.TraceError, match=r"image: the model was built for 56x56 .*got 64x64.*interpolate_pos"):
        vc.trace(model, torch.randn(1, 3, 64, 64), targets="top1", sites=["F1"])


def test_other_layer_layout_is_refused_with_the_version():
    model = make_hf_swin()
    del model.swin.encoder.layers[0].blocks[0].attention.o_proj  # as in transformers 4 (attention.output.dense)
    with pytest.raises(TypeError, match=r"no 'attention.o_proj'.*pip install 'transformers>=5'"):
        vc.trace(model, make_image(), targets="top1", sites=["F1"])
