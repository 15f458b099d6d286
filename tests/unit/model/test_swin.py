"""Swin / Swin V2: hierarchical traces (one DataTree child per stage), window reversal and un-shifting,
stage-aware recipes — checked against the model's own forward computed by hand with autograd."""

from __future__ import annotations

import copy
import functools
import json
import warnings

import numpy as np
import pytest
import timm
import torch
import xarray as xr
from timm.models.swin_transformer import window_reverse
from vitcam_testing import assert_unchanged, plain_presets, snapshot

import vitcam_nb as vc
from vitcam_nb.adapters.swin import window_tokens
from vitcam_nb.compute.stages import window_to_dense

IMG = 64
PATCH = 4
SITES = ("F1", "F2", "F3", "F4", "F5", "F6")


def make_swin(v2: bool = False, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    name = "swinv2_tiny_window8_256" if v2 else "swin_tiny_patch4_window7_224"
    model = timm.create_model(name, pretrained=False, img_size=IMG, window_size=4, depths=(2, 2),
                              num_heads=(2, 4), embed_dim=16, num_classes=5).eval()
    with torch.no_grad():  # sharper attention than the near-uniform random init, so windows matter
        for n, p in model.named_parameters():
            if n.endswith("qkv.weight"):
                p.mul_(8.0)
            if "cpb_mlp" in n or "logit_scale" in n:
                p.add_(torch.randn_like(p) * 0.5)
            if v2 and ".norm1." in n or v2 and ".norm2." in n:  # timm zero-inits V2's res-post-norm weights
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


def make_image(seed: int = 1) -> torch.Tensor:
    return torch.randn(1, 3, IMG, IMG, generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=2)
def traced(v2: bool) -> tuple:
    """(v2, model, image, trace, reference) — one trace per family for the whole module."""
    model = make_swin(v2=v2)
    x = make_image()
    before = snapshot(model)
    tr = vc.trace(model, x, targets="top2")
    assert_unchanged(before, model)
    return v2, model, x, tr, reference(model, x, [int(c) for c in tr["target_class"].values[:-1]])


@pytest.fixture(params=[False, True], ids=["swin", "swinv2"])
def case(request):
    return traced(request.param)


def _merge(model: torch.nn.Module, layer: int, windowed: torch.Tensor) -> torch.Tensor:
    """The block's own merge path (window_reverse, crop, roll by +shift) on a (windows, N, C) tensor."""
    blk = [b for s in model.layers for b in s.blocks][layer]
    ws, shift = tuple(blk.window_size), tuple(blk.shift_size)
    h, w = blk_resolution(model, layer)
    hp, wp = -(-h // ws[0]) * ws[0], -(-w // ws[1]) * ws[1]
    x = windowed.reshape(-1, ws[0], ws[1], windowed.shape[-1])
    try:
        x = window_reverse(x, ws, hp, wp)
    except TypeError:  # timm V2 passes the size as one tuple
        x = window_reverse(x, ws, (hp, wp))
    x = x[:, :h, :w, :]
    if any(shift):
        x = torch.roll(x, shifts=shift, dims=(1, 2))
    return x.reshape(h * w, -1)


def blk_resolution(model: torch.nn.Module, layer: int) -> tuple[int, int]:
    g = IMG // PATCH
    return (g, g) if layer < 2 else (g // 2, g // 2)


def reference(model: torch.nn.Module, x: torch.Tensor, classes: list[int]) -> dict:
    """Every site of every block with retain_grad, one backward per target (classes + expected logit)."""
    model = copy.deepcopy(model)
    blocks = [b for s in model.layers for b in s.blocks]
    v2 = "V2" in type(model).__name__
    keep: dict = {}

    def grab(key, tensor):
        tensor.retain_grad()
        keep[key] = tensor

    handles = []
    for i, blk in enumerate(blocks):
        blk.attn.fused_attn = False
        if not v2:
            handles.append(blk.norm1.register_forward_hook(lambda m, a, o, i=i: grab((i, "F1"), o)))
            handles.append(blk.norm2.register_forward_hook(lambda m, a, o, i=i: grab((i, "F4"), o)))
        handles.append(blk.attn.attn_drop.register_forward_hook(lambda m, a, o, i=i: grab((i, "F2"), o)))
        handles.append(blk.attn.proj.register_forward_pre_hook(lambda m, a, i=i: grab((i, "F3"), a[0])))
        handles.append(blk.mlp.register_forward_hook(lambda m, a, o, i=i: grab((i, "F5"), o)))
        handles.append(blk.register_forward_hook(lambda m, a, o, i=i: grab((i, "F6"), o)))
    z = model(x.clone())[0]
    p = torch.softmax(z.detach(), 0)
    outputs = [z[c] for c in classes] + [(p * z).sum()]
    grads = {k: [] for k in keep}
    for out in outputs:
        for t in keep.values():
            t.grad = None
        out.backward(retain_graph=True)
        for k, t in keep.items():
            grads[k].append(t.grad.detach().clone())
    ref = {}
    for (layer, site), t in keep.items():
        g = torch.stack(grads[(layer, site)])
        if site in ("F1", "F6"):
            ref[(layer, site)] = (t.detach().reshape(-1, t.shape[-1]), g.reshape(len(outputs), -1, t.shape[-1]))
        elif site in ("F4", "F5"):
            ref[(layer, site)] = (t.detach()[0], g[:, 0])
        elif site == "F3":
            ref[(layer, site)] = (_merge(model, layer, t.detach()), torch.stack([_merge(model, layer, gi) for gi in g]))
        else:  # F2: (windows, heads, N, N) -> rows by raster query token through the merge path of slot ids
            n_win, heads, n, _ = t.shape
            slots = torch.arange(n_win * n, dtype=torch.float64).reshape(n_win, n, 1)
            slot_of = _merge(model, layer, slots)[:, 0].long()  # raster token -> its (window, position) slot
            rows = t.detach().transpose(0, 1).reshape(heads, n_win * n, n)[:, slot_of]
            grows = g.transpose(1, 2).reshape(len(outputs), heads, n_win * n, n)[:, :, slot_of]
            raster_of_slot = torch.empty(n_win * n, dtype=torch.long)
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
@pytest.mark.parametrize("family", ["swin", "swinv2"])
def test_site_reference(family, site):
    if family == "swinv2" and site in ("F1", "F4"):
        pytest.skip("Swin V2 blocks are post-norm: no LayerNorm feeds attention or the MLP")
    _, model, x, tr, ref = traced(family == "swinv2")
    for layer in range(4):
        ds = _stage(tr, layer)
        if site == "F2":
            rows, grows, keys = ref[(layer, site)]
            _close(ds["attn_window"].sel(layer=layer).values, rows)
            _close(ds["attn_window_grad"].sel(layer=layer).values, grows)
            np.testing.assert_array_equal(ds["attn_window_key"].sel(layer=layer).values, keys.numpy())
        else:
            act, grad = ref[(layer, site)]
            _close(ds["act"].sel(layer=layer, site=site).values, act)
            _close(ds["grad"].sel(layer=layer, site=site).values, grad)


@pytest.mark.parametrize("family,site", [("swinv2", "F1"), ("swinv2", "F4")], ids=["swinv2-F1", "swinv2-F4"])
def test_site_not_applicable(family, site):
    model = make_swin(v2=True)
    with pytest.raises(vc.TraceError, match=rf"sites: .*{site}.*this swin model has \['F2', 'F3', 'F5'"):
        vc.trace(model, make_image(), targets="top1", sites=[site])


def test_window_tokens_follow_the_shift_formula():
    # Shifted grid position (i, j) holds original token ((i + s0) % H, (j + s1) % W); window index is
    # row-major over windows, position row-major inside the window.
    h, w, ws, shift = 8, 12, (4, 4), (2, 2)
    got = window_tokens(h, w, ws, shift)
    for i in range(h):
        for j in range(w):
            win = (i // ws[0]) * (w // ws[1]) + j // ws[1]
            pos = (i % ws[0]) * ws[1] + j % ws[1]
            assert got[win, pos] == ((i + shift[0]) % h) * w + (j + shift[1]) % w
    padded = window_tokens(6, 6, (4, 4), (0, 0))
    assert padded.shape == (4, 16) and (padded == -1).sum() == 4 * 16 - 36


def test_window_reversal_puts_each_token_at_its_row_and_col(case):
    """F3 in raster order equals dense window attention applied to values computed from F1 in raster order:
    the query, the key and the shift bookkeeping must all be right for this to hold."""
    v2, model, x, tr, _ = case
    if v2:
        pytest.skip("needs F1 (pre-norm); Swin V2 is checked by test_site_reference")
    blocks = [b for s in model.layers for b in s.blocks]
    for layer in (0, 1, 3):  # block 1 and 3 are shifted
        ds = _stage(tr, layer)
        f1 = torch.as_tensor(ds["act"].sel(layer=layer, site="F1").values)
        heads = blocks[layer].attn.num_heads
        with torch.no_grad():
            v = blocks[layer].attn.qkv(f1).reshape(f1.shape[0], 3, heads, -1)[:, 2]  # (token, head, hd)
        dense = window_to_dense(ds, layer)  # (head, query, key)
        expect = np.einsum("hqk,khd->qhd", dense, v.numpy()).reshape(f1.shape[0], -1)
        got = ds["act"].sel(layer=layer, site="F3").values
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-5)
        assert blocks[1].shift_size != (0, 0)


def test_patch_rows_and_cols_locate_the_evidence(case):
    """Layer-0 F1 of the token at (row, col) depends only on the input pixels of that patch cell."""
    _, model, x, tr, _ = case
    ds = _stage(tr, 0)
    token = int(np.flatnonzero((ds["patch_row"].values == 5) & (ds["patch_col"].values == 2))[0])
    m = copy.deepcopy(model)
    seen = {}
    m.patch_embed.register_forward_hook(lambda mod, a, o: seen.setdefault("t", o))
    xin = x.clone().requires_grad_(True)
    m(xin)
    gh, gw = IMG // PATCH, IMG // PATCH
    feature = seen["t"].reshape(1, gh * gw, -1)[0, token]
    # A plain sum of a LayerNorm output is constant; weight the channels so every pixel of the cell counts.
    (feature * torch.linspace(-1, 2, feature.numel())).sum().backward()
    nz = xin.grad[0].abs().sum(0) > 0
    rows, cols = np.nonzero(nz.numpy())
    assert rows.min() == 5 * PATCH and rows.max() == 6 * PATCH - 1
    assert cols.min() == 2 * PATCH and cols.max() == 3 * PATCH - 1


def test_tree_structure_and_attrs(case):
    v2, model, x, tr, _ = case
    assert isinstance(tr, xr.DataTree)
    assert sorted(tr.children) == ["stage_0", "stage_1"]
    assert set(tr.to_dataset(inherit=False).data_vars) == {"logits", "image"}
    assert (tr["stage_0"].attrs["grid_h"], tr["stage_1"].attrs["grid_h"]) == (16, 8)
    assert list(tr["stage_1"]["layer"].values) == [2, 3]
    assert tr["stage_1"].attrs["num_heads"] == 4 and tr["stage_0"].attrs["num_heads"] == 2
    assert tr.attrs["trace_id"] == tr["stage_0"].attrs["trace_id"] == tr["stage_1"].attrs["trace_id"]
    assert tr["stage_1"].attrs["hook_F3"] == "layers.{stage}.blocks.{block}.attn.proj:input"
    with torch.no_grad():
        np.testing.assert_allclose(tr["logits"].values, model(x)[0].numpy(), rtol=1e-5, atol=1e-6)


def test_layer_addresses_global_and_stage_block(case):
    _, _, _, tr, _ = case
    a = vc.cam(tr, vc.Recipe(site="F3", layer=3))
    b = vc.cam(tr, vc.Recipe(site="F3", layer="1.-1"))
    c = vc.cam(tr, vc.Recipe(site="F3", layer=-1))
    np.testing.assert_array_equal(a.values, b.values)
    np.testing.assert_array_equal(a.values, c.values)
    assert json.loads(b.attrs["recipe_as_given"])["layer"] == "1.-1"
    assert "layers.1.blocks.1.attn.proj" in json.loads(a.attrs["checklist"])["feature representation"]["module"]
    with pytest.raises(vc.RecipeError, match="layer: '2.0' does not exist"):
        vc.cam(tr, vc.Recipe(layer="2.0"))


def test_fusion_across_stages_resamples_to_the_finest_grid(case):
    v2, _, _, tr, _ = case
    site = "F5"
    fused = vc.cam(tr, vc.Recipe(site=site, layer=(0, 3), layer_fusion="mean", upsample="none"))
    assert fused.shape == (16, 16)
    m0 = vc.cam(tr, vc.Recipe(site=site, layer=0, upsample="none")).values
    m3 = vc.cam(tr, vc.Recipe(site=site, layer=3, upsample="none")).values
    up = torch.nn.functional.interpolate(torch.as_tensor(m3)[None, None], size=(16, 16), mode="bilinear",
                                         align_corners=False)[0, 0].numpy()
    want = (m0 + up) / 2
    want = (want - want.min()) / (want.max() - want.min())
    np.testing.assert_allclose(fused.values, want, atol=1e-6)
    note = json.loads(fused.attrs["checklist"])["spatial reconstruction"]["stages"]
    assert "16x16, 8x8" in note and "common 16x16 grid" in note


def test_window_attention_rows_match_the_dense_matrix(case):
    _, _, _, tr, _ = case
    layer = 3
    ds = _stage(tr, layer)
    dense = window_to_dense(ds, layer).astype(np.float64)  # (head, q, k)
    dense_g = window_to_dense(ds, layer, "attn_window_grad").astype(np.float64)[0]  # top1 logit
    want = (dense_g.mean(axis=1) * dense.mean(axis=1)).sum(axis=0)  # hirescam over heads, mean query rows
    got = vc.cam(tr, vc.Recipe(site="F2", layer=layer, attn_rows="mean", weighting="hirescam", relu="none",
                               normalize="none", upsample="none"))
    np.testing.assert_allclose(got.values.ravel(), want, rtol=1e-4, atol=1e-7)


def test_swin_refuses_what_does_not_apply(case):
    _, _, _, tr, _ = case
    with pytest.raises(vc.RecipeError, match="not applicable"):
        vc.cam(tr, vc.presets.attention_rollout())
    with pytest.raises(vc.RecipeError, match="attn_rows.*needs a cls token"):
        vc.cam(tr, vc.Recipe(site="F2", layer=0, attn_rows="cls"))
    with pytest.raises(vc.RecipeError, match="weight_tokens.*needs a cls token"):
        vc.cam(tr, vc.Recipe(site="F5", layer=0, weight_tokens="cls"))
    if tr.attrs["swin_version"] == 2:
        with pytest.raises(vc.RecipeError, match=r"site: this swin model has no 'F1'.*its sites are \['F2'"):
            vc.cam(tr, vc.Recipe(site="F1", layer=0))


def test_every_preset_runs_or_is_refused_clearly(case):
    _, _, _, tr, _ = case
    ran = 0
    for name in plain_presets():
        recipe = vc.presets.get(name)
        if recipe.site == "F1" and tr.attrs["swin_version"] == 2:  # post-norm: read the block output instead
            recipe = recipe.replace(site="F6")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", vc.DegenerateMapWarning)
                out = vc.cam(tr, recipe)
        except vc.RecipeError as exc:
            assert ("cls token" in str(exc)) or ("not applicable" in str(exc)) or ("not in this trace" in str(exc))
            continue
        assert np.isfinite(out.values).all() and out.shape == (IMG, IMG)
        ran += 1
    assert ran >= 8


def test_gallery_spans_stages(case):
    _, _, _, tr, _ = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        g = vc.gallery(tr, vc.Recipe(site="F5"), vary={"layer": "all"})
        one = vc.cam(tr, vc.Recipe(site="F5", layer=2))
    assert g.dims == ("layer", "y", "x") and g.shape == (4, IMG, IMG)
    np.testing.assert_array_equal(g.sel(layer=2).values, one.values)
    grid = vc.gallery(tr, vc.Recipe(site="F5", upsample="none"), vary={"layer": [0, 3]})
    assert grid.shape == (2, 16, 16) and grid.attrs["common_grid"] == "16x16"
    assert "common 16x16 grid" in json.loads(grid.attrs["checklist"])["spatial reconstruction"]["stages"]


@pytest.mark.parametrize("ext", ["nc", "zarr"])
def test_tree_round_trip_and_checksum(case, tmp_path, ext):
    _, _, _, tr, _ = case
    path = vc.save(tr, tmp_path / f"t.{ext}")
    back = vc.load(path)
    assert isinstance(back, xr.DataTree)
    for node in tr.subtree:
        assert node.to_dataset(inherit=False).identical(back[node.path].to_dataset(inherit=False)), node.path
    np.testing.assert_array_equal(vc.cam(back, vc.Recipe(site="F2", layer=1, attn_rows="mean")).values,
                                  vc.cam(tr, vc.Recipe(site="F2", layer=1, attn_rows="mean")).values)
    if ext == "nc":
        import h5py

        with h5py.File(path, "r+") as f:
            f["stage_1/act"][0, 0, 0, 0] += 1.0
        with pytest.raises(vc.TraceFileError, match="checksum"):
            vc.load(path)


def test_widgets_and_trace_many_say_what_to_do_with_a_tree(case, tmp_path):
    v2, model, x, tr, _ = case
    with pytest.raises(TypeError, match="stage_dataset"):
        vc.Explorer(tr)
    ex = vc.Explorer(vc.stages.stage_dataset(tr, 1))  # one stage is an ordinary trace
    assert ex.recipe.site == ("F3" if v2 else "F1") and ex.recipe_json  # V2 has no F1
    with pytest.raises(vc.TraceError, match="trace_many stores flat token layouts"):
        vc.trace_many(model, [np.zeros((IMG, IMG, 3), np.uint8)], tmp_path / "s.zarr", progress=False)


def test_review_fixes_on_trees_and_stages(case):
    v2, model, x, tr, _ = case
    # A stage alone refuses rollouts clearly (it holds window attention only).
    with pytest.raises(vc.RecipeError, match="layer_fusion: 'rollout'.*not applicable"):
        vc.cam(vc.stages.stage_dataset(tr, 0), vc.Recipe(site="F2", layer=(0, 1), layer_fusion="rollout",
                                                        attn_rows="mean"))
    # The checklist of a fusion across stages names every block's module.
    fused = vc.cam(tr, vc.Recipe(site="F3", layer=(0, 3), layer_fusion="mean"))
    module = json.loads(fused.attrs["checklist"])["feature representation"]["module"]
    assert module == "layers.0.blocks.0.attn.proj, layers.1.blocks.1.attn.proj"
    # Varying sites includes F2, which on a model without CLS reads the mean over query rows.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        g = vc.gallery(tr, vc.Recipe(site="F3"), vary={"layer": [1], "site": ["F2", "F3"]})
        f2 = vc.cam(tr, vc.Recipe(site="F2", layer=1, attn_rows="mean"))
    np.testing.assert_array_equal(g.sel(site="F2").values[0], f2.values)
    assert g.recipe_id.values[0, 0] == f2.attrs["recipe_id"]
    with pytest.raises(vc.RecipeError, match="vary: upsample"):
        vc.gallery(tr, vc.Recipe(site="F3"), vary={"upsample": ["none", "bilinear"]})
    both = vc.gallery(tr, vc.Recipe(site="F3", layer=1), vary={"upsample": ["bilinear", "nearest"]})
    np.testing.assert_array_equal(both.values[1], vc.cam(tr, vc.Recipe(site="F3", layer=1, upsample="nearest")).values)
    # Trace ids tell site sets apart.
    only = vc.trace(model, x, targets="top2", sites=["F3"])
    assert only.attrs["trace_id"] != vc.trace(model, x, targets="top2", sites=["F2", "F3"]).attrs["trace_id"]
    assert "num_heads" not in tr.attrs and json.loads(tr.attrs["num_heads_per_stage"]) == [2, 4]


def test_stage_block_strings_are_canonical_and_refused_on_flat_traces():
    assert vc.Recipe(layer="01.-0").layer == "1.0" and vc.Recipe(layer="01.0").id == vc.Recipe(layer="1.0").id
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, num_classes=5,
                            embed_dim=32, num_heads=2).eval()
    tr = vc.trace(vit, make_image()[..., :32, :32], targets="top2")
    with pytest.raises(vc.RecipeError, match="layer: '1.0' is a 'stage.block' address"):
        vc.cam(tr, vc.Recipe(layer="1.0"))
    with pytest.raises(vc.RecipeError, match="layer: '0.1' is a 'stage.block' address"):
        vc.gallery(tr, vc.Recipe(), vary={"layer": ["0.1", 1]})


def test_a_head_index_is_checked_when_a_stage_has_one_head():
    torch.manual_seed(0)
    m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=IMG, window_size=4,
                          depths=(1, 1), num_heads=(1, 2), embed_dim=16, num_classes=5).eval()
    tr = vc.trace(m, make_image(), targets="top1", sites=["F3"])
    with pytest.raises(vc.RecipeError, match=r"heads: head 3 does not exist \(the model has 1 heads"):
        vc.cam(tr, vc.Recipe(site="F3", layer=0, heads=3))
    np.testing.assert_array_equal(vc.cam(tr, vc.Recipe(site="F3", layer=0, heads=0)).values,
                                  vc.cam(tr, vc.Recipe(site="F3", layer=0)).values)


def test_atlas_compares_maps_from_different_stages_on_the_finest_grid(case):
    from scipy.stats import spearmanr

    _, _, _, tr, _ = case
    recipes = [vc.Recipe(site="F5", layer=1), vc.Recipe(site="F3", layer=3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        da = vc.evaluate.atlas(tr, recipes, metric="spearman")
        fine = vc.cam(tr, recipes[0], grid=True).values
        coarse = vc.cam(tr, recipes[1], grid=True).values
    up = torch.nn.functional.interpolate(torch.as_tensor(coarse)[None, None], size=fine.shape, mode="bilinear",
                                         align_corners=False)[0, 0].numpy()
    want = spearmanr(fine.ravel(), up.ravel()).statistic
    # float32 rounding of the two bilinear implementations can swap near-tied ranks: a small tolerance
    assert da.values[0, 1] == pytest.approx(want, abs=1e-4) and da.values[0, 0] == pytest.approx(1.0)


@pytest.mark.parametrize("v2", [False, True], ids=["swin", "swinv2"])
def test_resid_mid_is_the_residual_after_attention(v2):
    """V1 (pre-norm): resid_mid = resid_pre + attn_out; V2 (post-norm): resid_pre + norm1(attn_out)."""
    model = make_swin(v2=v2)
    tr = vc.trace(model, make_image(), targets="top1", sites=["resid_pre", "attn_out", "resid_mid"])
    blocks = [b for s in model.layers for b in s.blocks]
    for layer in range(4):
        ds = _stage(tr, layer).sel(layer=layer)
        attn = torch.as_tensor(ds["act"].sel(site="attn_out").values)
        if v2:
            with torch.no_grad():
                attn = blocks[layer].norm1(attn)
        want = ds["act"].sel(site="resid_pre").values + attn.numpy()
        np.testing.assert_allclose(ds["act"].sel(site="resid_mid").values, want, rtol=1e-5, atol=1e-5)
