"""Acceptance tests of maps from a trace_many store (issue #10): maps and atlases are computed lazily, one task
per image, and equal the maps of single traces, also on a dask.distributed LocalCluster with two workers; the
Explorer on a store picks an image and keeps the recipe."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch
import xarray as xr
from many_store import N, random_images, traced_store

import vitcam_nb as vc
from vitcam_nb import atlas_many, cam_many, image_trace, open_traces
from vitcam_nb.evaluate import atlas


@pytest.fixture(scope="module")
def store(tmp_path_factory, model_factory):
    return traced_store(tmp_path_factory.mktemp("many"), model_factory("vit"), random_images(N))


# -- lazy maps --------------------------------------------------------------------------------------------------
RECIPES = [
    vc.Recipe(site="F1", layer=-1),
    vc.Recipe(site="F4", layer=(0, 1), layer_fusion="mean", weighting="layercam", target="prob"),
    vc.Recipe(site="F2", layer=0, class_="top2", heads="mean_then_relu"),
    vc.Recipe(site="F2", layer="all", layer_fusion="rollout"),
    vc.Recipe(site="F6", layer=-1),  # degenerate with CLS pooling: zeros and a reason
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.site}-{r.layer_fusion}")
@pytest.mark.parametrize("grid", [False, True])
def test_cam_many_is_lazy_and_equals_single_cam(store, recipe, grid):
    ds = open_traces(store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        refs = [vc.cam(image_trace(ds, i), recipe, grid=grid) for i in range(N)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        maps = cam_many(ds, recipe, grid=grid)
    # one warning, at call time, when the map of the first image (checked eagerly) is degenerate
    assert [w.category for w in caught] == ([vc.DegenerateMapWarning] if refs[0].attrs["degenerate"] else [])
    assert maps.chunks is not None and maps.chunks[0] == (1,) * N  # one task per image
    assert maps.dims == (("image", "patch_row", "patch_col") if grid else ("image", "y", "x"))
    got = maps.compute()
    for i, ref in enumerate(refs):
        np.testing.assert_array_equal(got[i].values, ref.values)
        assert str(got["degenerate"].values[i]) == ref.attrs["degenerate"]
        assert str(got["trace_id"].values[i]) == ref.attrs["trace_id"]
    if recipe.site == "F6":
        assert all(got["degenerate"].values)
    assert got.attrs["recipe_id"] == (recipe.replace(upsample="none").id if grid else recipe.id)
    assert "checklist" in got.attrs


def test_cam_many_in_memory_and_bad_recipe(store):
    ds = open_traces(store)
    eager = cam_many(ds.load(), vc.Recipe(site="F1", layer=0))
    assert eager.chunks is None
    np.testing.assert_array_equal(eager.values, cam_many(ds, vc.Recipe(site="F1", layer=0)).values)
    with pytest.raises(vc.RecipeError, match="class_"):
        cam_many(ds, vc.Recipe(site="F1", class_=9))  # raised now, not at compute time
    with pytest.raises(TypeError, match="image"):
        cam_many(image_trace(ds, 0), vc.Recipe())


def test_atlas_many_equals_list_atlas(store):
    ds = open_traces(store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = atlas_many(ds, RECIPES[:4], scheduler="sync")
        want = atlas([image_trace(ds, i) for i in range(N)], RECIPES[:4])
    xr.testing.assert_identical(got, want)


def _on_cluster(ds: xr.Dataset, processes: bool) -> None:
    """atlas_many and cam_many on a LocalCluster with two workers give what the in-process computation gives."""
    distributed = pytest.importorskip("distributed")
    recipes = {"F1": RECIPES[0], "F4 fused": RECIPES[1], "F2": RECIPES[2]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = atlas([image_trace(ds, i) for i in range(N)], recipes, "pearson")
        want_maps = cam_many(ds, RECIPES[0]).compute(scheduler="sync")
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=processes, dashboard_address=None,
                                      silence_logs=40) as cluster, distributed.Client(cluster) as client:
            got = atlas_many(ds, recipes, "pearson")
            got_maps = cam_many(ds, RECIPES[0]).compute()
            # Asked of each worker: client.scheduler_info() answers from a cache that a slow reply leaves empty.
            executed = client.run(lambda dask_worker: dask_worker.state.executed_count)
    assert len(executed) == 2 and all(n > 0 for n in executed.values()), executed
    xr.testing.assert_identical(got, want)
    xr.testing.assert_identical(got_maps, want_maps)


def test_atlas_and_maps_on_a_local_cluster(store):
    # Two in-process workers keep this quick; the lazy store survives pickling as process workers need it.
    ds = pickle.loads(pickle.dumps(open_traces(store)))
    _on_cluster(ds, processes=False)


@pytest.mark.slow
def test_atlas_and_maps_on_a_local_cluster_of_processes(store):
    # Worker processes import torch, timm and vitcam_nb: 10 s or more on a busy machine.
    _on_cluster(open_traces(store), processes=True)


def test_explorer_on_a_store_picks_an_image_and_keeps_the_recipe(tmp_path):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=4)
    images = np.random.default_rng(1).integers(0, 255, (3, 32, 32, 3), dtype=np.uint8)
    path = vc.trace_many(model, list(images), tmp_path / "s.zarr", targets="top1", progress=False)
    ds = vc.open_traces(path)
    ex = vc.Explorer(ds, vc.Recipe(site="F4", layer=0))
    assert isinstance(ex, vc.Explorer) and ex.index == 0 and ex.store is ds
    assert [pos for _, pos in ex.images] == [0, 1, 2]
    ex.index = 2
    assert ex.recipe == vc.Recipe(site="F4", layer=0) and ex.trace.attrs["image_index"] == 2
    want = vc.cam(vc.image_trace(ds, 2), vc.Recipe(site="F4", layer=0), grid=True).values
    np.testing.assert_array_equal(ex.map, want)
    # The page's picker sends a request, as the browser does; the kernel answers with image_index.
    ex.image_request = {"id": 1, "index": 1}
    assert ex.index == 1 and ex.error == ""
    np.testing.assert_array_equal(ex.map, vc.cam(vc.image_trace(ds, 1), ex.recipe, grid=True).values)
    assert ex.image == vc.widgets.encoding.image_rgba(vc.image_trace(ds, 1)["image"].values)
    with pytest.raises(IndexError, match="index"):
        ex.index = 3
    single = vc.Explorer(vc.image_trace(ds, 0))
    assert single.images == [] and single.store is None
    with pytest.raises(TypeError, match="single trace"):
        single.index = 1


def test_explorer_refuses_an_image_the_recipe_cannot_show_and_keeps_the_one_shown(tmp_path):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=4)
    for p in model.parameters():
        if p.ndim >= 2:  # weights O(1), norms and biases as built: the images get different top classes
            torch.nn.init.normal_(p, std=0.3)
    images = np.random.default_rng(3).integers(0, 255, (6, 32, 32, 3), dtype=np.uint8)
    ds = vc.open_traces(vc.trace_many(model.eval(), list(images), tmp_path / "s.zarr", targets="top1",
                                      progress=False))
    top = [int(vc.image_trace(ds, i)["target_class"].values[0]) for i in range(6)]
    other = next(i for i in range(6) if top[i] != top[0])  # an image whose traced class differs
    ex = vc.Explorer(ds, vc.Recipe(site="F1", layer=0, class_=top[0]))
    seen = []
    ex.observe(lambda change: seen.append(change["new"]), names="image_index")
    shown = ex.map.copy()
    with pytest.raises(vc.RecipeError, match=f"class_: class {top[0]} was not traced"):
        ex.index = other
    assert ex.index == 0 and seen == [] and ex.trace.attrs["image_index"] == 0
    np.testing.assert_array_equal(ex.map, shown)
    ex.image_request = {"id": 1, "index": other}  # from the page: a message in the widget, no exception
    assert ex.index == 0 and seen == [] and f"class {top[0]} was not traced" in ex.error
    np.testing.assert_array_equal(ex.map, shown)
    ex.image_request = {"id": 2, "index": 99}
    assert ex.index == 0 and "index: expected an image position in [0, 5], got 99" in ex.error
