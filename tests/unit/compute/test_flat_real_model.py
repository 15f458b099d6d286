"""``vc.cam`` and ``vc.gallery`` on a real model (issue #3), a tiny random-init timm ViT (``vitcam_testing``):
derived prob/logprob gradients against autograd, a map's attrs, the degenerate last block under CLS pooling,
the Chefer attention baseline, and the gallery against individual cams."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from cam_reference import cam_warns as _cam_warns
from cam_reference import minmax, raw_cam, relu

import vitcam_nb as vc

# --------------------------------------------------------------------------------------------------
# Real model: derived gradients against autograd, attrs, degenerate last block, Chefer baseline, gallery


@pytest.fixture(scope="module")
def real():
    from vitcam_testing import make_input, make_model

    torch.manual_seed(0)
    model, x = make_model("vit"), make_input("vit")
    return model, x, vc.trace(model, x, targets="top3")


@pytest.mark.parametrize("target", ["logit", "prob", "logprob"])
@pytest.mark.parametrize("class_", ["top1", "top2"])
def test_derived_gradients_match_autograd(real, target, class_):
    model, x, tr = real
    store = {}
    handle = model.blocks[1].norm1.register_forward_hook(lambda _m, _i, out: store.setdefault("a", out))
    try:
        z = model(x)[0]
    finally:
        handle.remove()
    c = int(torch.argsort(z, descending=True)[int(class_[3:]) - 1])
    scalar = {"logit": z[c], "prob": torch.softmax(z, 0)[c], "logprob": torch.log_softmax(z, 0)[c]}[target]
    (g,) = torch.autograd.grad(scalar, store["a"])
    want = g[0, 1:].sum(-1).reshape(4, 4).numpy()
    got = raw_cam(tr, site="F1", layer=1, target=target, class_=class_, weighting="gradient")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_attrs_of_a_map(real):
    _, _, tr = real
    r = vc.Recipe(site="F4", layer=0, weighting="layercam")
    m = vc.cam(tr, r)
    assert m.dims == ("y", "x") and m.shape == (32, 32) and m.dtype == np.float32
    assert m.attrs["recipe"] == r.to_json() and m.attrs["recipe_id"] == r.id
    assert m.attrs["trace_id"] == tr.attrs["trace_id"] and m.attrs["degenerate"] == ""
    assert vc.Recipe.from_json(m.attrs["recipe"]) == r
    import json

    checklist = json.loads(m.attrs["checklist"])
    for cat in ("feature representation", "gradient target", "token handling", "aggregation",
                "spatial reconstruction"):
        assert cat in checklist


@pytest.mark.parametrize("site", ["F3", "F4", "F5", "F6"])
def test_last_block_cls_pooling_degenerate(real, site):
    _, _, tr = real
    assert not np.any(tr["grad"].sel(layer=2, site=site).values[..., 1:, :])   # the premise: zero gradients
    for weighting in ("gradcam", "hirescam", "layercam", "gradcampp", "xgradcam", "eigengradcam", "gradient"):
        m, ws = _cam_warns(tr, vc.Recipe(site=site, layer=-1, weighting=weighting))
        assert ws and m.attrs["degenerate"], (site, weighting)
        assert np.all(m.values == 0)
    # with CLS weights the map is a real map; EigenCAM uses no gradient
    for fields in ({"weight_tokens": "cls"}, {"weighting": "eigencam"}):
        m, ws = _cam_warns(tr, vc.Recipe(site=site, layer=-1, **fields))
        assert not ws and m.attrs["degenerate"] == "" and m.values.max() == 1


def test_last_block_F2_only_cls_row_has_gradient(real):
    _, _, tr = real
    m, ws = _cam_warns(tr, vc.Recipe(site="F2", layer=-1, attn_rows="patch_mean"))
    assert ws and m.attrs["degenerate"] and np.all(m.values == 0)
    m, ws = _cam_warns(tr, vc.Recipe(site="F2", layer=-1))
    assert not ws and m.values.max() == 1


def test_chefer_attention_gradcam_real(real):
    _, _, tr = real
    c = int(np.argmax(tr["logits"].values))
    A = tr["attn"].isel(layer=-1).values[:, 0, 1:].astype(np.float64)                   # (head, patch key)
    G = tr["attn_grad"].sel(target=f"logit_{c}").isel(layer=-1).values[:, 0, 1:].astype(np.float64)
    want = minmax(relu((A * G.mean(-1, keepdims=True)).mean(0))).reshape(4, 4)
    got = vc.cam(tr, vc.presets.chefer_attention_gradcam(), grid=True)
    np.testing.assert_allclose(got.values, want, atol=1e-5)
    assert got.attrs["degenerate"] == ""


SITES_ALL = ["F1", "F2", "F3", "F4", "F5", "F6"]


def _quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        return fn(*a, **k)


@pytest.mark.parametrize("base", [vc.Recipe(), vc.Recipe(weighting="hirescam", upsample="none"),
                                  vc.Recipe(weighting="eigencam", relu="none", normalize="max"),
                                  vc.Recipe(target="prob", class_="top2", upsample="bicubic")])
def test_gallery_layers_and_sites_equal_individual_cams(real, base):
    _, _, tr = real
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        g = vc.gallery(tr, base, vary={"layer": "all", "site": SITES_ALL})
    assert g.dims[:2] == ("layer", "site") and g.shape[:2] == (3, 6)
    assert list(g.site.values) == SITES_ALL and list(g.layer.values) == [0, 1, 2]
    any_degenerate = False
    for layer in range(3):
        for site in SITES_ALL:
            r = base.replace(layer=layer, site=site)
            m = _quiet(vc.cam, tr, r)
            cell = g.sel(layer=layer, site=site)
            np.testing.assert_allclose(cell.values, m.values, atol=1e-6, err_msg=f"{site}@{layer}")
            assert str(cell.recipe_id.values) == r.id
            assert str(cell.degenerate.values) == m.attrs["degenerate"], f"{site}@{layer}"
            any_degenerate |= bool(m.attrs["degenerate"])
    if any_degenerate:
        assert any(issubclass(w.category, vc.DegenerateMapWarning) for w in rec)


@pytest.mark.parametrize("sites", [["F1", "F3", "F4", "F5", "F6"], ["F6", "F4", "F1"], ["F3", "F5"]])
def test_gallery_maps_are_bitwise_the_cams_whichever_way_the_sites_are_batched(real, sites):
    # Consecutive stored sites go through the pipeline as one view, others one site at a time; every map must
    # be the one vc.cam computes for its recipe alone, bit for bit.
    _, _, tr = real
    g = _quiet(vc.gallery, tr, vc.Recipe(), vary={"layer": "all", "site": sites})
    for layer in range(3):
        for site in sites:
            m = _quiet(vc.cam, tr, vc.Recipe(layer=layer, site=site))
            np.testing.assert_array_equal(g.sel(layer=layer, site=site).values, m.values, err_msg=f"{site}@{layer}")


def test_gallery_other_fields(real):
    _, _, tr = real
    vary = {"weighting": ["gradcam", "layercam", "eigencam"], "target": ["logit", "prob", "logprob"],
            "class_": ["top1", 0]}
    tr_classes = [int(c) for c in tr.target_class.values if c >= 0]
    if 0 not in tr_classes:
        vary["class_"] = ["top1", tr_classes[-1]]
    g = _quiet(vc.gallery, tr, vc.Recipe(site="F1", layer=1), vary=vary)
    assert g.dims == ("weighting", "target", "class_", "y", "x")
    for w in vary["weighting"]:
        for t in vary["target"]:
            for c in vary["class_"]:
                m = _quiet(vc.cam, tr, vc.Recipe(site="F1", layer=1, weighting=w, target=t, class_=c))
                np.testing.assert_allclose(g.sel(weighting=w, target=t, class_=c).values, m.values, atol=1e-6)


def test_gallery_with_layer_fusion_varying_site(real):
    _, _, tr = real
    base = vc.Recipe(layer=(0, 1), layer_fusion="mean")
    g = _quiet(vc.gallery, tr, base, vary={"site": ["F1", "F2", "F4"], "layer_fusion": ["mean", "max"]})
    for s in ["F1", "F2", "F4"]:
        for f in ["mean", "max"]:
            m = _quiet(vc.cam, tr, base.replace(site=s, layer_fusion=f))
            np.testing.assert_allclose(g.sel(site=s, layer_fusion=f).values, m.values, atol=1e-6)


def test_gallery_refusals(real):
    _, _, tr = real
    with pytest.raises(vc.RecipeError, match="colour"):
        vc.gallery(tr, vc.Recipe(), vary={"colour": ["red"]})
    with pytest.raises(vc.RecipeError, match="vary"):
        vc.gallery(tr, vc.Recipe(), vary={"weighting": []})
    with pytest.raises(vc.RecipeError, match="heads"):
        vc.gallery(tr, vc.Recipe(), vary={"heads": ["max"]})   # heads on F1 is meaningless
    with pytest.raises(vc.RecipeError, match="site"):
        vc.gallery(tr, vc.Recipe(), vary={"site": ["F1", "resid_pre"]})   # not traced
    with pytest.raises(vc.RecipeError, match="layer"):
        vc.gallery(tr, vc.Recipe(), vary={"layer": [0, 9]})   # out of range
    with pytest.raises(vc.RecipeError, match="vary"):
        vc.gallery(tr, vc.Recipe(), vary={"layer": 1})        # not a list
    with pytest.raises(vc.RecipeError, match="vary"):
        vc.gallery(tr, vc.presets.attention_rollout(), vary={"layer": "all"})
    with pytest.raises(TypeError, match="recipe"):
        vc.gallery(tr, "F1")


def test_gallery_field_names_mean_all(real):
    _, _, tr = real
    g = _quiet(vc.gallery, tr, vc.Recipe(layer=0))
    assert g.dims[:2] == ("layer", "site") and list(g.layer.values) == [0, 1, 2]
    assert set(g.site.values) == set(SITES_ALL)
    m = _quiet(vc.cam, tr, vc.Recipe(layer=1, site="F2"))
    np.testing.assert_allclose(g.sel(layer=1, site="F2").values, m.values, atol=1e-6)


def test_a_block_named_twice_through_a_negative_index_is_refused(real):
    _, _, tr = real
    n = int(tr.attrs["num_layers"])
    with pytest.raises(vc.RecipeError, match=r"^layer: .*twice"):
        vc.cam(tr, vc.Recipe(layer=(0, -n), layer_fusion="mean"))


def test_gallery_over_sites_without_a_cls_token_reads_f2_by_mean_rows():
    import timm

    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                          embed_dim=32, num_heads=2, num_classes=4, class_token=False, global_pool="avg").eval()
    tr = vc.trace(m, torch.randn(1, 3, 32, 32), targets="top2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        g = vc.gallery(tr, vc.Recipe(), vary={"layer": "all", "site": "all"})
        f2 = vc.cam(tr, vc.Recipe(site="F2", layer=1, attn_rows="mean"))
        f3 = vc.cam(tr, vc.Recipe(site="F3", layer=1))
        back = vc.gallery(tr, vc.Recipe(site="F2", attn_rows="patch_mean"), vary={"site": ["F2", "F4"]})
    np.testing.assert_array_equal(g.sel(site="F2", layer=1).values, f2.values)
    np.testing.assert_array_equal(g.sel(site="F3", layer=1).values, f3.values)
    assert g.recipe_id.sel(site="F2", layer=1).item() == f2.attrs["recipe_id"]
    assert back.recipe_id.values[0] == vc.Recipe(site="F2", attn_rows="patch_mean").id
    assert back.recipe_id.values[1] == vc.Recipe(site="F4").id
