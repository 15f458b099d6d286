"""The registries the layers extend by (vitcam_nb/core/registry.py, weighting.py, kinds.py): ordered tables,
a weighting registered from outside the package computed on a real trace, and the trace kind a trace gets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb.core.kinds import TRACE_KINDS, TraceKind, kind_for
from vitcam_nb.core.registry import Registry
from vitcam_nb.core.weighting import WEIGHTINGS, Weighting, register_weighting


@pytest.fixture(scope="module")
def tr() -> xr.Dataset:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    return vc.trace(model.eval(), image, targets="top2")


def test_registry_keeps_order_refuses_duplicates_and_names_what_it_holds():
    r: Registry[int] = Registry("colour")
    r.register("red", 1)
    r.register("green", 2)
    r.register("blue", 3, first=True)
    assert r.names() == ["blue", "red", "green"] and r.values() == [3, 1, 2] and len(r) == 3
    with pytest.raises(ValueError, match="a colour named 'red' is registered already"):
        r.register("red", 9)
    r.register("red", 9, replace=True)
    assert r.names() == ["blue", "red", "green"] and r.get("red") == 9
    with pytest.raises(ValueError, match="no colour named 'pink'; registered: \\['blue', 'red', 'green'\\]"):
        r.get("pink")
    assert r.unregister("blue") == 3 and "blue" not in r
    with pytest.raises(ValueError, match="name: expected a non-empty string"):
        r.register("", 0)


def test_a_registered_weighting_is_a_recipe_value_with_its_formula_and_map(tr):
    def grad_times_abs_act(A, G, wmask, patch, groups):
        terms = (G * np.abs(A))[..., patch, :]
        terms = terms.reshape(*terms.shape[:-1], groups, terms.shape[-1] // groups)
        return terms.sum(-1), np.abs(terms).sum(-1)

    register_weighting(Weighting("grad_abs_act", "map[t] = sum_k G[t,k] |A[t,k]|", grad_times_abs_act))
    try:
        recipe = vc.Recipe(site="F1", layer=0, weighting="grad_abs_act", upsample="none", relu="none",
                           normalize="none")
        m = vc.cam(tr, recipe)
        A = tr["act"].sel(layer=0, site="F1").values[1:]
        G = tr["grad"].sel(layer=0, site="F1").isel(target=0).values[1:]
        want = (G * np.abs(A)).sum(-1).reshape(4, 4)
        np.testing.assert_allclose(m.values, want, rtol=1e-5, atol=1e-7)
        assert "map[t] = sum_k G[t,k] |A[t,k]|" in m.attrs["checklist"]
        with pytest.raises(vc.RecipeError, match="weight_tokens: only weightings that pool"):
            vc.Recipe(weighting="grad_abs_act", weight_tokens="all")
    finally:
        WEIGHTINGS.unregister("grad_abs_act")
    with pytest.raises(vc.RecipeError, match="weighting: got 'grad_abs_act'; allowed values"):
        vc.Recipe(weighting="grad_abs_act")


def test_register_weighting_refuses_what_is_not_a_weighting():
    with pytest.raises(TypeError, match="weighting: expected a vitcam_nb.core.weighting.Weighting"):
        register_weighting("gradcam")
    with pytest.raises(TypeError, match="not callable"):
        register_weighting(Weighting("broken", "?", kernel=None))
    with pytest.raises(ValueError, match="registered already"):
        register_weighting(WEIGHTINGS.get("gradcam"))


def test_each_trace_gets_its_kind(tr, tmp_path):
    assert kind_for(tr, vc.Recipe()).name == "flat"
    assert kind_for(None, vc.Recipe(site="xattn")).name == "flat"  # a report without a trace
    assert kind_for(tr, vc.Recipe(site="xattn")).name == "xattn"
    assert kind_for(xr.DataTree(), vc.Recipe()).name == "stages"
    assert kind_for(xr.Dataset(coords={"image": [0]}), vc.Recipe()).name == "many"
    with pytest.raises(TypeError, match="trace: expected an xarray.Dataset from vitcam_nb.trace\\(\\), got list"):
        kind_for([tr], vc.Recipe())


def test_a_trace_no_kind_accepts_is_refused_with_the_kinds(tr):
    saved = {name: (TRACE_KINDS.get(name), TRACE_KINDS.priority(name)) for name in list(TRACE_KINDS)}
    for name in saved:
        TRACE_KINDS.unregister(name)
    try:
        with pytest.raises(vc.TraceError, match="no registered trace kind accepts this Dataset with site 'F1'; "
                                                "registered kinds: \\[\\]"):
            vc.cam(tr, vc.Recipe())

        class Everything(TraceKind):
            name = "everything"

            def accepts(self, trace, recipe):
                return True

            def cam(self, trace, recipe):
                return xr.DataArray(np.zeros((1, 1)), attrs={"recipe_id": recipe.id})

        TRACE_KINDS.register("everything", Everything())
        assert vc.cam(tr, vc.Recipe()).attrs["recipe_id"] == vc.Recipe().id
        with pytest.raises(NotImplementedError):
            vc.gallery(tr, vc.Recipe())
    finally:
        for name in list(TRACE_KINDS):
            TRACE_KINDS.unregister(name)
        for name, (kind, priority) in saved.items():  # restored at their declared priorities
            TRACE_KINDS.register(name, kind, priority=priority)


def test_recipe_checklist_is_the_checklist_its_map_carries(tr):
    for recipe in (vc.Recipe(), vc.Recipe(site="F2", layer="all", layer_fusion="grad_rollout"),
                   vc.Recipe(site="F4", layer=(0, 1), layer_fusion="mean", target="prob")):
        m = vc.cam(tr, recipe)
        assert recipe.checklist(tr).to_json() == m.attrs["checklist"]
        assert recipe.describe(tr) == m.attrs["methods"]
