"""Acceptance tests of vc.map_many (issue #35, items 3 and 4): maps computed per batch from a pass capturing only
what the recipes read, stored on the token grid, read back bitwise as vc.cam gives them on the image's trace;
resumable, refusing what it cannot compute before any model call; sharded over a LocalCluster of processes into
the same store a single process writes."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import timm
import torch
import zarr

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb.capture.store_lock import StoreLock
from vitcam_nb.compute import map_many as map_many_module
from vitcam_nb.evaluate import atlas

N = 4
SPEC = {"timm": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 8, "depth": 2, "num_classes": 10}
RECIPES = [
    Recipe(site="F1", layer=-1),
    Recipe(site="F4", layer=0, weighting="hirescam", upsample="bicubic"),
    Recipe(site="F4", layer=(0, 1), layer_fusion="mean"),  # fused: each block upsampled before the mean
    vc.presets.attention_rollout(),
    Recipe(site="F2", layer=1, heads="mean_then_relu", attn_rows="mean"),
    Recipe(site="F3", layer=1, heads="max", weighting="layercam", upsample="nearest"),
    Recipe(site="F1", layer=0, target="prob", class_="top2", normalize="max", relu="none"),
    Recipe(site="F6", layer=1),  # the last block's patch tokens never reach the CLS output: degenerate
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = {k: v for k, v in SPEC.items() if k != "timm"}
    return timm.create_model(SPEC["timm"], pretrained=False, **kwargs).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def images():
    return list(np.random.default_rng(0).integers(0, 256, (N, 32, 32, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def store(tmp_path_factory, model, images):
    path = tmp_path_factory.mktemp("maps") / "maps.zarr"
    return vc.map_many(model, images, RECIPES, path, batch_size=2, progress=False)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        return fn(*args, **kwargs)


def _arrays(path) -> dict[str, np.ndarray]:
    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(arr[:]) for name, arr in group.arrays()}


def _assert_same_store(a, b) -> None:
    got, want = _arrays(a), _arrays(b)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    attrs_a, attrs_b = dict(zarr.open_group(str(a)).attrs), dict(zarr.open_group(str(b)).attrs)
    assert attrs_a == attrs_b


def _forward_count(model) -> tuple[list[int], object]:
    calls: list[int] = []
    return calls, model.register_forward_pre_hook(lambda _m, args: calls.append(int(args[0].shape[0])))


# -- maps read back are vc.cam's ----------------------------------------------------------------------------------
def test_maps_equal_cam_on_a_full_trace_bitwise(tmp_path, model, images):
    # A batch of one is the pass vc.trace makes: the maps equal vc.cam on a full trace (every site and block).
    path = vc.map_many(model, images[:3], RECIPES, tmp_path / "one.zarr", batch_size=1, progress=False)
    ds = vc.open_maps(path)
    assert ds["maps"].dims == ("image", "recipe", "gy", "gx") and ds["maps"].shape == (3, len(RECIPES), 4, 4)
    assert ds["parts"].shape == (3, 2, 4, 4)  # only the fused recipe keeps its blocks
    table = json.loads(ds.attrs["recipes"])
    for i, img in enumerate(images[:3]):
        tr = vc.trace(model, img, targets="top2")
        one = vc.image_maps(ds, i)
        if i == 0:  # the recipes as stored: id, canonical text, JSON and id, checklist (on this first image)
            # The table's canonical id is the one on any image of the model: its "topK" stays as written.
            assert [(row["id"], row["text"], row["json"], row["canonical_id"]) for row in table] == \
                [(r.id, r.to_string(), r.to_json(), r.resolve(tr).replace(class_=r.class_).id) for r in RECIPES]
            checklists = [json.loads(_quiet(vc.cam, one, r).attrs["checklist"]) for r in RECIPES]
            assert [json.loads(row["checklist"]) for row in table] == checklists
        assert str(one["input_sha256"].values) == tr.attrs["input_sha256"]
        for r in RECIPES:
            got, want = _quiet(vc.cam, one, r), _quiet(vc.cam, tr, r)
            np.testing.assert_array_equal(got.values, want.values, err_msg=r.to_string())
            assert got.dims == want.dims
            # The store's pass traced only what the recipes read: its trace id is its own; the rest is the same.
            differ = {k for k in want.attrs if got.attrs[k] != want.attrs[k]}
            assert differ <= {"trace_id", "checklist", "methods"}, (r.to_string(), differ)
            assert got.attrs["methods"].replace(got.attrs["trace_id"], want.attrs["trace_id"]) == want.attrs["methods"]
        # Any upsampling of a stored recipe is read from the same token-grid maps (vc.cam(..., grid=True) too).
        np.testing.assert_array_equal(_quiet(vc.cam, one, RECIPES[2], grid=True).values,
                                      _quiet(vc.cam, tr, RECIPES[2], grid=True).values)
    degenerate = ds["degenerate"].values[:, RECIPES.index(RECIPES[-1])]
    assert all("gradients are exactly zero" in str(d) for d in degenerate)
    with pytest.warns(vc.DegenerateMapWarning):
        assert not vc.cam(vc.image_maps(ds, 0), RECIPES[-1]).values.any()


def test_batched_store_equals_cam_on_the_same_batched_pass(store, model, images, tmp_path):
    # A batch of B images is not bitwise a batch of 1; the store is bitwise vc.cam on the same batched pass.
    traces = vc.open_traces(vc.trace_many(model, images, tmp_path / "t.zarr", targets="top2", batch_size=2,
                                          progress=False))
    ds = vc.open_maps(store)
    for i in range(N):
        one, tr = vc.image_maps(ds, i), vc.image_trace(traces, i)
        for r in RECIPES:
            np.testing.assert_array_equal(_quiet(vc.cam, one, r).values, _quiet(vc.cam, tr, r).values,
                                          err_msg=r.to_string())
    for r in RECIPES[2:4]:  # every image at once: (image, y, x), each image's degeneracy a coordinate
        stacked = _quiet(vc.cam, ds, r)
        assert stacked.dims == ("image", "y", "x") and stacked["degenerate"].values.tolist() == [""] * N
        np.testing.assert_array_equal(stacked.values[1], _quiet(vc.cam, vc.image_maps(ds, 1), r).values)
    assert ds["target_class"].shape == (N, 3) and (ds["target_class"].values[:, -1] == -1).all()
    np.testing.assert_array_equal(ds["logits"].values, traces["logits"].values)
    # Readers of a trace store read a map store alike: the atlas over its images, and cam_many.
    want = _quiet(atlas, [vc.image_trace(traces, i) for i in range(N)], RECIPES[:4])
    got = _quiet(atlas, ds, RECIPES[:4])
    for name in ("mean", "std", "count"):
        np.testing.assert_array_equal(got[name].values, want[name].values, err_msg=name)
    np.testing.assert_array_equal(vc.cam_many(ds, RECIPES[0]).values, _quiet(vc.cam, ds, RECIPES[0]).values)


def test_a_space_and_preset_names(tmp_path, model, images):
    path = vc.map_many(model, images[:2], {"site": ["F1", "F4"], "layer": [0, 1], "heads": ["channels", "max"]},
                       tmp_path / "s.zarr", progress=False)
    ds = vc.open_maps(path)
    assert ds.sizes["recipe"] == 4  # heads='max' off F2/F3 is no recipe: those combinations are skipped
    path = vc.map_many(model, images[:2], ["gradcam", "F4@0 layercam"], tmp_path / "p.zarr", progress=False)
    one = vc.image_maps(vc.open_maps(path), 1)
    assert vc.cam(one, Recipe.parse("F4@0 layercam")).shape == (32, 32)
    with pytest.raises(vc.RecipeError, match="not in this map store"):
        vc.cam(one, Recipe(site="F5", layer=0))


# -- resumable ------------------------------------------------------------------------------------------------------
def _gen(images, stop):
    for i, img in enumerate(images):
        if i == stop:
            raise KeyboardInterrupt
        yield img


def test_interrupted_runs_resume_to_the_same_store(tmp_path, store, model, images, monkeypatch):
    path = tmp_path / "r.zarr"
    with pytest.raises(KeyboardInterrupt):
        vc.map_many(model, _gen(images, 3), RECIPES, path, batch_size=2, progress=False)
    with pytest.raises(vc.TraceFileError, match="incomplete"):
        vc.open_maps(path)
    assert vc.open_maps(path, incomplete=True).sizes["image"] == 2
    # A batch that fails in its computation is never marked done, and is computed again on resume.
    real, calls = map_many_module.compute_batch, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(map_many_module, "compute_batch", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        vc.map_many(model, images, RECIPES, path, batch_size=2, progress=False)
    monkeypatch.setattr(map_many_module, "compute_batch", real)
    sizes, handle = _forward_count(model)
    try:
        vc.map_many(model, images, RECIPES, path, batch_size=2, progress=False)
    finally:
        handle.remove()
    assert sizes == [2]  # only the batch not done was computed
    _assert_same_store(path, store)


def test_per_image_arrays_are_chunked_by_row_width_and_hold_the_same_values(tmp_path, store, model, images,
                                                                           monkeypatch):
    """Each batch rewrites the chunk its images fall in, so wide rows (one per recipe) get fewer images per chunk;
    a store cut into one-image chunks holds exactly what the default store holds."""
    from vitcam_nb.compute import map_writer

    group = zarr.open_group(str(store), mode="r")
    for name in ("degenerate", "scale", "logits", "trace_id"):
        assert group[name].chunks[0] == map_writer.meta_rows(group[name].shape[1:]), name
    assert group["trace_id"].chunks[0] == map_writer.META_CHUNK
    monkeypatch.setattr(map_writer, "META_CHUNK_VALUES", 1)
    path = vc.map_many(model, images, RECIPES, tmp_path / "small.zarr", batch_size=2, progress=False)
    assert zarr.open_group(str(path), mode="r")["trace_id"].chunks[0] == 1
    got, want = _arrays(path), _arrays(store)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# -- refusals -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe, match", [
    (Recipe(site="F1", weighting="scorecam"), "scorecam"),
    (Recipe(site="F2", layer_fusion="transition"), "transition"),
    (Recipe(site="xattn"), "xattn"),
    (Recipe(site="F1", class_=3), "class 3"),
    (Recipe(site="F1", weighting="gradsam"), "'published' trace kind"),
])
def test_recipes_it_cannot_compute_are_refused_before_any_model_call(tmp_path, model, images, recipe, match):
    sizes, handle = _forward_count(model)
    try:
        with pytest.raises(vc.RecipeError, match=match) as info:
            vc.map_many(model, images, [RECIPES[0], recipe], tmp_path / "x.zarr", targets="top2", progress=False)
    finally:
        handle.remove()
    assert recipe.to_string() in str(info.value) and sizes == []
    assert not (tmp_path / "x.zarr").exists()


def test_other_models_settings_paths_and_sizes_are_refused(tmp_path, store, model, images):
    before = _arrays(store)
    other = _model()
    with torch.no_grad():
        other.head.bias.add_(1.0)
    with pytest.raises(vc.TraceFileError, match="another model or settings.*weights_sha256"):
        vc.map_many(other, images, RECIPES, store, batch_size=2, progress=False)
    with pytest.raises(vc.TraceFileError, match="another model or settings.*recipes"):
        vc.map_many(model, images, RECIPES[:3], store, batch_size=2, progress=False)
    assert all(np.array_equal(v, before[k]) for k, v in _arrays(store).items())
    with StoreLock(store, writer="map_many"), pytest.raises(vc.TraceFileError, match="another map_many call"):
        vc.map_many(model, images, RECIPES, store, batch_size=2, progress=False)  # one writer per store
    traces = vc.trace_many(model, images[:1], tmp_path / "t.zarr", targets="top1", sites=["F1"], progress=False)
    with pytest.raises(vc.TraceFileError, match="not a vitcam_nb map store"):
        vc.map_many(model, images, RECIPES, traces, overwrite=True, progress=False)
    assert vc.open_traces(traces).sizes["image"] == 1  # overwrite never deletes what map_many did not write
    with pytest.raises(vc.TraceFileError, match="not a vitcam_nb map store"):
        vc.open_maps(traces)
    with pytest.raises(vc.TraceFileError, match=r"\.zarr"):
        vc.map_many(model, images, RECIPES, tmp_path / "maps", progress=False)
    with pytest.raises(vc.TraceError, match=r"max_bytes: 8 recipes .* kB of maps per batch"):
        vc.map_many(model, images, RECIPES, tmp_path / "big.zarr", max_bytes=1000, progress=False)
    dyn = timm.create_model(SPEC["timm"], pretrained=False, img_size=32, patch_size=8, depth=1, num_classes=10,
                            dynamic_img_size=True)
    with pytest.raises(vc.TraceError, match="one input size"):
        vc.map_many(dyn, [torch.randn(3, 24, 40), torch.randn(3, 32, 32)], ["F1@0"], tmp_path / "mixed.zarr",
                    batch_size=1, progress=False)


# -- sharded over a dask.distributed cluster --------------------------------------------------------------------------
@pytest.mark.slow
def test_a_local_cluster_of_processes_writes_the_single_process_store(tmp_path, store, model, images):
    distributed = pytest.importorskip("distributed")
    path = tmp_path / "cluster.zarr"
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=40) as cluster, distributed.Client(cluster) as client:
        vc.map_many(model, images + images[:2], RECIPES, path, batch_size=2, progress=False, worker_model=SPEC)
        executed = client.run(lambda dask_worker: dask_worker.state.executed_count)
    # Every batch runs on the workers (the first one's maps shape the store, which the calling process creates).
    assert sum(executed.values()) == 3, executed
    whole = vc.map_many(model, images + images[:2], RECIPES, tmp_path / "whole.zarr", batch_size=2, progress=False)
    _assert_same_store(path, whole)
