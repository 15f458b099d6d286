"""Readers of a map store (issue #35, items 3 and 4): the ambiguity analysis over the recipes a vc.map_many
store holds equals the analysis of the same recipes on the traces of the same pass; a requested space outside
the store is refused by name. The Explorer picks the images of a map store and offers only its recipes.
The score card of a map store equals the traces' for the metrics that read maps only.
vc.trace_many sharded over a LocalCluster of processes writes the store a single process writes."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import numpy as np
import pytest
import timm
import torch
import zarr

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb.core.presets import PRESETS
from vitcam_nb.core.recipe import UPSAMPLES
from vitcam_nb.evaluate.metric_registry import metric_names

N = 3
SPEC = {"timm": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 8, "depth": 2, "num_classes": 10}
SPACE = {"site": ["F1", "F4"], "layer": [0, 1], "weighting": ["gradcam", "layercam"]}
FIELDS = [f.name for f in dataclasses.fields(Recipe)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return timm.create_model(SPEC["timm"], pretrained=False, **{k: v for k, v in SPEC.items() if k != "timm"}).eval()


@pytest.fixture(scope="module")
def images():
    return list(np.random.default_rng(1).integers(0, 256, (N, 32, 32, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def stores(tmp_path_factory, model, images):
    # The same batches of the same pass: the map store's maps are bitwise vc.cam on the trace store's traces.
    root = tmp_path_factory.mktemp("readers")
    maps = vc.map_many(model, images, SPACE, root / "maps.zarr", batch_size=N, progress=False)
    traces = vc.trace_many(model, images, root / "traces.zarr", targets="top2", batch_size=N, progress=False)
    return vc.open_maps(maps), vc.open_traces(traces)


def _trace_space(**open_values) -> dict:
    # On a trace every open field ranges over its documented defaults: pin the others to the store's values.
    return {**{f: [getattr(Recipe(), f)] for f in FIELDS}, **open_values}


def _assert_same(got, want) -> None:
    assert len(got.results) == len(want.results) == N
    for g, w in zip(got.results, want.results):
        assert [r.id for r in g.recipes] == [r.id for r in w.recipes]
        np.testing.assert_array_equal(g.maps.values, w.maps.values)
        assert g.sensitivity == w.sensitivity and g.open == w.open and g.skipped == w.skipped
        np.testing.assert_array_equal(g.rho, w.rho)
    np.testing.assert_array_equal(got.sensitivity.values, want.sensitivity.values)
    np.testing.assert_array_equal(got.median_spearman, want.median_spearman)


def test_ambiguity_over_a_map_store_equals_it_over_the_traces(stores):
    maps, traces = stores
    # No space given: the store's recipes are the space (2 sites x 2 blocks x 2 weightings, token grid).
    got = vc.ambiguity(maps, reported={})
    want = vc.ambiguity(traces, reported={}, space=_trace_space(**SPACE))
    _assert_same(got, want)
    assert len(got.results[0].recipes) == 8 and sorted(got.results[0].open) == ["layer", "site", "weighting"]
    assert set(got.sensitivity["factor"].values) >= {"site", "layer", "weighting"}
    # A requested upsampling opens the image grid: every stored map read at each upsampling, token maps as blocks.
    ups = {"upsample": ["none", "bilinear", "nearest"]}
    got = vc.ambiguity(maps, reported={"site": "F4"}, space=ups)
    want = vc.ambiguity(traces, reported={"site": "F4"},
                        space={k: v for k, v in _trace_space(**SPACE, **ups).items() if k != "site"})
    _assert_same(got, want)
    assert got.results[0].maps.attrs["grid"] == "image grid" and len(got.results[0].recipes) == 12
    # A reported value narrows the store's recipes: the last block read as -1.
    got = vc.ambiguity(maps, reported={"layer": -1, "weighting": "layercam"})
    assert [r.to_string() for r in got.results[0].recipes] == \
        [Recipe(site=s, layer=-1, weighting="layercam", upsample="none").to_string() for s in ("F1", "F4")]


def test_a_requested_space_outside_the_store_is_refused_by_name(stores):
    maps, _ = stores
    with pytest.raises(vc.RecipeError, match=r"not in this map store.*hirescam") as err:
        vc.ambiguity(maps, reported={"site": "F1", "layer": 0}, space={"weighting": ["gradcam", "hirescam"]})
    assert "layercam" not in str(err.value)  # only the missing recipes are named


def _cam(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        return vc.cam(*args, **kwargs)


def test_the_explorer_picks_images_of_a_map_store_and_offers_only_its_recipes(stores):
    maps, _ = stores
    ex = vc.Explorer(maps, index=1)
    assert ex.store is maps and [pos for _, pos in ex.images] == list(range(N)) and ex.index == 1
    assert ex.recipe == Recipe(site="F1", layer=0, weighting="gradcam")  # the store's first recipe
    offered = {f["name"]: f for f in ex.options["fields"]}
    assert [v for v, _ in offered["site"]["values"]] == ["F1", "F4"]
    assert sorted(v for v, _ in offered["weighting"]["values"]) == ["gradcam", "layercam"]
    assert offered["layer"]["layers"] == [0, 1]
    assert [v for v, _ in offered["target"]["values"]] == ["logit"]
    assert [v for v, _ in offered["layer_fusion"]["values"]] == ["none"]
    assert [v for v, _ in offered["upsample"]["values"]] == list(UPSAMPLES)  # applied on read
    held = {r.replace(upsample="none").id for r in (Recipe(**dict(zip(SPACE, c)))
                                                   for c in itertools.product(*SPACE.values()))}
    assert [name for name, _, _ in ex.options["presets"]] == \
        [name for name, make in PRESETS.items() if make().replace(upsample="none").id in held]
    # Each map shown is the store's, read as vc.cam reads it, on the image picked.
    for i, recipe in ((1, Recipe(site="F4", layer=1, weighting="layercam", upsample="nearest")),
                      (2, Recipe(site="F1", layer=-1))):
        ex.index = i
        ex.recipe = recipe
        one = vc.image_maps(maps, i)
        np.testing.assert_array_equal(ex.cam().values, _cam(one, recipe).values)
        np.testing.assert_array_equal(ex.map, _cam(one, recipe, grid=True).values)
        assert ex.image_shape == [32, 32] and ex.methods == recipe.describe(one)
    assert ex.static() is not None
    # A combination of offered values the store lacks is refused in the page, the map kept.
    shown = ex.map.copy()
    ex.request = {"id": 7, "recipe": {"relu": "none"}, "changed": ["relu"]}
    assert "not in this map store" in ex.error and ex.response_id == 7
    np.testing.assert_array_equal(ex.map, shown)
    with pytest.raises(TypeError, match="to_html"):
        ex.to_html()



def test_the_scorecard_of_a_map_store_equals_the_traces_for_the_metrics_that_read_maps(stores):
    maps, traces = stores
    recipes = [Recipe(site="F1", layer=0), Recipe(site="F4", layer=-2, weighting="layercam", upsample="bicubic")]
    masks = [np.pad(np.ones((12, 10 + 2 * k), bool), ((4, 16), (2, 20 - 2 * k))) for k in range(N)]
    card = vc.evaluate.scorecard(maps, recipes, masks=masks, n_boot=50, progress=False)
    names = [str(m) for m in card["metric"].values]
    assert names == metric_names("localisation") + metric_names("complexity")  # no model, no trace: these only
    want = vc.evaluate.scorecard(traces, recipes, names, masks=masks, n_boot=50, progress=False)
    for var in ("values", "mean", "low", "high", "count"):
        np.testing.assert_array_equal(card[var].values, want[var].values, err_msg=var)
    assert int(card["count"].min()) == N
    with pytest.raises(ValueError, match=r"deletion_auc.*map store holds maps only"):
        vc.evaluate.scorecard(maps, recipes, ["sparseness", "deletion_auc"], progress=False)
    with pytest.raises(ValueError, match="target"):
        vc.evaluate.scorecard(maps, recipes, ["sparseness"], target="label", progress=False)
    with pytest.raises(vc.RecipeError, match="hirescam"):
        vc.evaluate.scorecard(maps, [*recipes, Recipe(weighting="hirescam")], ["sparseness"], progress=False)

# -- trace_many sharded over a dask.distributed cluster ---------------------------------------------------------------
def _arrays(path) -> dict[str, np.ndarray]:
    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(arr[:]) for name, arr in group.arrays()}


@pytest.mark.slow
def test_trace_many_on_a_local_cluster_of_processes_writes_the_single_process_store(tmp_path, model, images):
    distributed = pytest.importorskip("distributed")
    many = images * 2  # three batches of two: the first in this process, the others on the workers
    masks = [np.pad(np.ones((8 + 2 * k, 8), bool), ((4, 20 - 2 * k), (4, 20))) for k in range(len(many))]
    args = dict(targets="top2", batch_size=2, image_labels=[3, -1, 7, 0, 1, 2], masks=masks, progress=False)
    path = tmp_path / "cluster.zarr"
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=40) as cluster, distributed.Client(cluster) as client:
        calls: list[int] = []
        hook = model.register_forward_pre_hook(lambda _m, a: calls.append(int(a[0].shape[0])))
        try:
            vc.trace_many(model, many, path, worker_model=SPEC, **args)
        finally:
            hook.remove()
        executed = client.run(lambda dask_worker: dask_worker.state.executed_count)
    # The first batch is traced here (it shapes the store), the other two on the workers, each batch once.
    assert calls == [2] and sum(executed.values()) >= 2, (calls, executed)
    whole = vc.trace_many(model, many, tmp_path / "whole.zarr", **args)
    got, want = _arrays(path), _arrays(whole)
    assert sorted(got) == sorted(want) and {"act", "grad", "mask", "done"} <= set(got)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert dict(zarr.open_group(str(path)).attrs) == dict(zarr.open_group(str(whole)).attrs)
    assert got["done"].all() and got["label"].tolist() == [3, -1, 7, 0, 1, 2]
