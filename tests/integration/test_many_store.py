"""Acceptance tests of many-image tracing (issue #10): a trace_many store holds, per image, what trace() gives;
interrupted runs resume to the same store; other models, settings and images are refused; images come as a list,
a folder of files, a data loader, a dataset of dicts or (image, label, mask) items."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xarray as xr
import zarr
from many_store import BATCH, N, traced_store
from many_store import random_images as _images

import vitcam_nb as vc
from vitcam_nb import image_choices, image_trace, open_traces, trace_many
from vitcam_nb.capture.store import Store

EXTRA_ATTRS = {"image_index", "image_label", "image_source"}


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("vit")


@pytest.fixture(scope="module")
def images():
    return _images(N)


@pytest.fixture(scope="module")
def store(tmp_path_factory, model, images):
    return traced_store(tmp_path_factory.mktemp("many"), model, images)


def _gen(images, stop: int | None = None):
    """A generator (unknown length) that is 'interrupted' when asked for image ``stop``."""
    for i, img in enumerate(images):
        if i == stop:
            raise KeyboardInterrupt
        yield img


def _assert_same_trace(got: xr.Dataset, want: xr.Dataset) -> None:
    """``got`` (from a store) equals ``want`` (from vc.trace): same schema, labels and attrs; values equal to
    the rounding of batched kernels (a batch of B images is not bitwise a batch of 1)."""
    assert EXTRA_ATTRS <= set(got.attrs)
    assert {k: v for k, v in got.attrs.items() if k not in EXTRA_ATTRS} == want.attrs
    assert set(got.variables) == set(want.variables)
    for name, var in want.variables.items():
        other = got.variables[name]
        assert other.dims == var.dims and other.dtype == var.dtype, name
        if var.dtype.kind == "f":
            scale = float(np.abs(var.values.astype(np.float64)).max()) or 1.0
            rtol = 1e-5 if var.dtype == np.float32 else 2e-3
            np.testing.assert_allclose(other.values, var.values, rtol=rtol, atol=rtol * scale, err_msg=name)
        else:
            np.testing.assert_array_equal(other.values, var.values, err_msg=name)


def _forward_count(model) -> tuple[list[int], object]:
    sizes: list[int] = []
    handle = model.register_forward_pre_hook(lambda _m, args: sizes.append(int(args[0].shape[0])))
    return sizes, handle


# -- per-image slices equal single traces ---------------------------------------------------------------------
def test_slices_equal_single_traces(store, model, images):
    ds = open_traces(store)
    assert ds.sizes["image"] == N and ds["act"].chunks is not None  # lazy, dask-backed
    for i in range(N):
        _assert_same_trace(image_trace(ds, i), vc.trace(model, images[i], targets="top3"))
    assert image_trace(ds, -1).attrs["image_index"] == N - 1


@pytest.mark.parametrize("kind", ["vit_reg", "deit_distilled"])
def test_slices_equal_float16_explicit_classes(tmp_path, model_factory, kind):
    m, imgs = model_factory(kind), _images(3, seed=1)
    p = trace_many(m, imgs, tmp_path / "t.zarr", sites=["F1", "F2"], targets=[4, 1], dtype="float16",
                   batch_size=2, progress=False)
    ds = open_traces(p)
    assert ds["act"].dtype == np.float16
    assert ds["target"].values.tolist() == ["logit_4", "logit_1", "expected_logit"]
    for i in range(3):
        _assert_same_trace(image_trace(ds, i), vc.trace(m, imgs[i], targets=[4, 1], sites=["F1", "F2"],
                                                        dtype="float16"))


def test_store_layout_one_image_one_layer_per_chunk(store):
    group = zarr.open_group(str(store), mode="r")
    n_tokens, n_channels = group["act"].shape[-2:]
    assert group["act"].chunks == (1, 1, 5, n_tokens, n_channels)
    assert group["grad"].chunks == (1, 4, 1, 5, n_tokens, n_channels)
    assert group["attn"].chunks[:2] == (1, 1) and group["attn_grad"].chunks[:3] == (1, 4, 1)
    assert group["pixels"].chunks[0] == 1 and group["logits"].chunks[0] == 1
    ds = open_traces(store)
    one = ds["act"].isel(image=3, layer=1)
    assert one.data.npartitions == 1  # a layer of an image is one chunk: slicing it reads only that chunk
    assert ds["target"].values.tolist() == ["top1", "top2", "top3", "expected_logit"]
    assert ds["target_class"].dims == ("image", "target")
    settings = json.loads(ds.attrs["settings"])
    assert settings["sites"] == ["F1", "F2", "F3", "F4", "F5", "F6"] and settings["targets"] == "top3"
    assert ds.attrs["n_expected"] == N and ds.attrs["complete"] == 1 and ds.attrs["n_images"] == N


# -- resuming ---------------------------------------------------------------------------------------------------
def test_interrupted_run_resumes_to_the_same_store(tmp_path, model, images):
    whole = trace_many(model, _gen(images), tmp_path / "whole.zarr", targets="top3", batch_size=BATCH,
                       progress=False)
    path = tmp_path / "resumed.zarr"
    with pytest.raises(KeyboardInterrupt):
        trace_many(model, _gen(images, stop=5), path, targets="top3", batch_size=BATCH, progress=False)
    partial = open_traces(path)
    assert partial["image"].values.tolist() == [0, 1, 2, 3]  # image 4 was pending, never half-visible
    assert partial.attrs["complete"] == 0
    sizes, handle = _forward_count(model)
    try:
        trace_many(model, _gen(images), path, targets="top3", batch_size=BATCH, progress=False)
    finally:
        handle.remove()
    assert sizes == [2, 1]  # only images 4, 5 and 6 were traced again: nothing duplicated
    xr.testing.assert_identical(open_traces(path).load(), open_traces(whole).load())


def test_crash_between_data_and_done_flag_is_retraced(tmp_path, model, images, monkeypatch):
    whole = trace_many(model, images, tmp_path / "whole.zarr", targets="top3", batch_size=BATCH, progress=False)
    path = tmp_path / "crashed.zarr"
    real, calls = Store.mark_done, []

    def crash_on_second(self, batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("power cut")
        return real(self, batch)

    monkeypatch.setattr(Store, "mark_done", crash_on_second)
    with pytest.raises(RuntimeError, match="power cut"):
        trace_many(model, images, path, targets="top3", batch_size=BATCH, progress=False)
    monkeypatch.setattr(Store, "mark_done", real)
    assert open_traces(path).sizes["image"] == 2
    assert open_traces(path, incomplete=True).sizes["image"] == 4  # data of images 2, 3 written, not marked done
    sizes, handle = _forward_count(model)
    try:
        trace_many(model, images, path, targets="top3", batch_size=BATCH, progress=False)
    finally:
        handle.remove()
    assert sum(sizes) == N - 2
    xr.testing.assert_identical(open_traces(path).load(), open_traces(whole).load())


def test_crash_while_growing_is_repaired(tmp_path, model, images):
    path = tmp_path / "grow.zarr"
    with pytest.raises(KeyboardInterrupt):
        trace_many(model, _gen(images, stop=4), path, targets="top3", batch_size=BATCH, progress=False)
    group = zarr.open_group(str(path), mode="r+")
    group["act"].resize((6, *group["act"].shape[1:]))  # interrupted after growing one array of many
    with pytest.raises(vc.TraceFileError, match="interrupted while growing"):
        open_traces(path)
    trace_many(model, _gen(images), path, targets="top3", batch_size=BATCH, progress=False)
    whole = trace_many(model, _gen(images), tmp_path / "whole.zarr", targets="top3", batch_size=BATCH,
                       progress=False)
    xr.testing.assert_identical(open_traces(path).load(), open_traces(whole).load())


def test_gaps_are_filled_in_place(tmp_path, model, images):
    path = trace_many(model, images, tmp_path / "t.zarr", targets="top3", batch_size=BATCH, progress=False)
    before = open_traces(path).load()
    done = zarr.open_group(str(path), mode="r+")["done"]
    done[1], done[3] = False, False  # e.g. a resumed run with another batch size, interrupted
    assert open_traces(path)["image"].values.tolist() == [0, 2, 4, 5, 6]
    sizes, handle = _forward_count(model)
    try:
        trace_many(model, images, path, targets="top3", batch_size=4, progress=False)
    finally:
        handle.remove()
    assert sizes == [2]  # images 1 and 3, one batch, written as two runs
    after = open_traces(path).load()
    assert after["image"].values.tolist() == list(range(N))
    xr.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


def test_rerun_of_a_complete_store_traces_nothing(store, model, images):
    before = open_traces(store).load()
    sizes, handle = _forward_count(model)
    try:
        trace_many(model, images, store, targets="top3", batch_size=BATCH, progress=False)
    finally:
        handle.remove()
    assert sizes == []
    xr.testing.assert_identical(open_traces(store).load(), before)


# -- refusals ---------------------------------------------------------------------------------------------------
def test_store_from_another_model_is_refused(store, model_factory, images):
    before = open_traces(store).load()
    other = model_factory("vit", seed=1)
    with pytest.raises(vc.TraceFileError, match="another model or settings.*weights_sha256"):
        trace_many(other, images, store, targets="top3", batch_size=BATCH, progress=False)
    xr.testing.assert_identical(open_traces(store).load(), before)


@pytest.mark.parametrize("change, field", [({"dtype": "float16"}, "dtype"), ({"targets": "top2"}, "targets"),
                                           ({"sites": ["F1"]}, "sites"), ({"layers": [0]}, "layers")])
def test_store_with_other_settings_is_refused(store, model, images, change, field):
    kwargs = {"targets": "top3", "batch_size": BATCH, "progress": False, **change}
    with pytest.raises(vc.TraceFileError, match=field):
        trace_many(model, images, store, **kwargs)


def test_other_images_are_refused_and_overwrite_replaces(tmp_path, model, model_factory, images):
    path = trace_many(model, images[:3], tmp_path / "t.zarr", targets="top1", batch_size=BATCH, progress=False)
    with pytest.raises(vc.TraceFileError, match="started for 3 images"):
        trace_many(model, images, path, targets="top1", batch_size=BATCH, progress=False)
    with pytest.raises(vc.TraceFileError, match="another image at index 0"):
        trace_many(model, _gen(_images(3, seed=5)), path, targets="top1", batch_size=BATCH, progress=False)
    other = model_factory("vit", seed=1)
    trace_many(other, images[:2], path, targets="top1", overwrite=True, progress=False)
    ds = open_traces(path)
    assert ds.sizes["image"] == 2 and ds.attrs["weights_sha256"] == vc.trace(other, images[0]).attrs["weights_sha256"]


def test_foreign_paths_are_refused(tmp_path, model, images):
    folder = tmp_path / "not_a_store.zarr"
    folder.mkdir()
    (folder / "theirs.txt").write_text("another program's file")
    with pytest.raises(vc.TraceFileError, match="not a trace_many store"):
        trace_many(model, images, folder, progress=False)
    assert (folder / "theirs.txt").read_text() == "another program's file"
    with pytest.raises(vc.TraceFileError, match="ends in .zarr"):
        trace_many(model, images, tmp_path / "no_extension", progress=False)
    single = vc.save(vc.trace(model, images[0]), tmp_path / "one.zarr")
    with pytest.raises(vc.TraceFileError, match="single trace"):
        open_traces(single)
    with pytest.raises(vc.TraceFileError, match="not a vitcam_nb trace_many store"):
        trace_many(model, images, single, progress=False)
    with pytest.raises(vc.TraceFileError, match="does not exist"):
        open_traces(tmp_path / "missing.zarr")


@pytest.mark.parametrize("kwargs, match", [({"batch_size": 0}, "batch_size"), ({"dtype": "int8"}, "dtype"),
                                           ({"targets": "best"}, "targets"), ({"sites": ["F9"]}, "sites")])
def test_bad_arguments(tmp_path, model, images, kwargs, match):
    with pytest.raises(vc.TraceError, match=match):
        trace_many(model, images, tmp_path / "t.zarr", progress=False, **kwargs)
    assert not (tmp_path / "t.zarr").exists()


def test_bad_inputs(tmp_path, model):
    with pytest.raises(TypeError, match="images"):
        trace_many(model, 42, tmp_path / "a.zarr", progress=False)
    with pytest.raises(vc.TraceError, match="no images"):
        trace_many(model, [], tmp_path / "b.zarr", progress=False)
    with pytest.raises(vc.TraceError, match="image_labels: 1 values for 2"):
        trace_many(model, _images(2), tmp_path / "c.zarr", image_labels=[1], progress=False)


def test_images_of_other_sizes_are_refused(tmp_path, model_factory):
    m = model_factory("vit_dynamic")
    mixed = [torch.randn(3, 24, 40), torch.randn(3, 32, 32)]
    with pytest.raises(vc.TraceError, match="one input size"):
        trace_many(m, mixed, tmp_path / "a.zarr", batch_size=2, progress=False)
    with pytest.raises(vc.TraceFileError, match="img_height"):
        trace_many(m, mixed, tmp_path / "b.zarr", batch_size=1, progress=False)
    assert open_traces(tmp_path / "b.zarr").sizes["image"] == 1


# -- kinds of input ---------------------------------------------------------------------------------------------
def test_folder_of_files(tmp_path, model, images):
    from PIL import Image

    folder = tmp_path / "pics"
    folder.mkdir()
    for i, img in enumerate(images[:3]):
        Image.fromarray(img).save(folder / f"img_{i}.png")
    (folder / "notes.txt").write_text("not an image")
    ds = open_traces(trace_many(model, folder, tmp_path / "t.zarr", targets="top1", progress=False))
    assert ds["source"].values.tolist() == ["img_0.png", "img_1.png", "img_2.png"]
    with Image.open(folder / "img_2.png") as im:
        _assert_same_trace(image_trace(ds, 2), vc.trace(model, im.convert("RGB"), targets="top1"))
    assert image_choices(ds)[1] == ("image 1: img_1.png", 1)


def test_dataloader_with_labels(tmp_path, model):
    x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([0, 3, 1, 2, 9])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3)
    ds = open_traces(trace_many(model, loader, tmp_path / "t.zarr", targets="top2", batch_size=2, progress=False))
    assert ds["label"].values.tolist() == [0, 3, 1, 2, 9]
    assert ds.attrs["n_expected"] == -1 and ds.attrs["complete"] == 1
    tr = image_trace(ds, 4)
    assert tr.attrs["image_label"] == 9
    _assert_same_trace(tr, vc.trace(model, x[4:5], targets="top2"))
    assert image_choices(ds)[4] == ("image 4 (class 9)", 4)


def test_torch_dataset_of_dicts(tmp_path, model):
    class Pictures(torch.utils.data.Dataset):
        def __init__(self, images):
            self.images = images

        def __len__(self):
            return len(self.images)

        def __getitem__(self, i):
            return {"image": self.images[i], "label": i % 2}

    imgs = _images(3, seed=2)
    ds = open_traces(trace_many(model, Pictures(imgs), tmp_path / "t.zarr", targets="top1", progress=False))
    assert ds.attrs["n_expected"] == 3 and ds["label"].values.tolist() == [0, 1, 0]
    _assert_same_trace(image_trace(ds, 1), vc.trace(model, imgs[1], targets="top1"))


def test_masks_follow_the_image_geometry(tmp_path, model):
    imgs = _images(3, size=40)
    mask = np.zeros((40, 40), bool)
    mask[:, :20] = True  # left half; resized to 36 (crop_pct 0.875) and centre-cropped to 32: columns < 16
    items = [(img, i, mask) for i, img in enumerate(imgs)]
    ds = open_traces(trace_many(model, iter(items), tmp_path / "t.zarr", targets="top1", progress=False))
    assert ds["mask"].dims == ("image", "y", "x") and ds["mask"].dtype == bool
    m = ds["mask"].values
    assert m[:, :, :15].all() and not m[:, :, 17:].any()
    assert ds["label"].values.tolist() == [0, 1, 2]
    assert image_trace(ds, 0)["mask"].dims == ("y", "x")
    with pytest.raises(vc.TraceError, match="mask for every image or for none"):
        trace_many(model, [(imgs[0], 0, mask), (imgs[1], 1, None)], tmp_path / "u.zarr", progress=False)


def test_a_store_lists_every_memory_mode_its_batches_ran_in(tmp_path, model, images, monkeypatch):
    import vitcam_nb.capture.trace_many as trace_many_module

    real, calls = trace_many_module.fit_budget, []

    def later_batches_recompute(plan, *args, **kwargs):  # as a budget may choose, batch by batch
        real(plan, *args, **kwargs)
        calls.append(plan)
        if len(calls) > 1:
            plan.recompute, plan.target_groups = True, 1

    monkeypatch.setattr(trace_many_module, "fit_budget", later_batches_recompute)
    args = dict(targets="top3", batch_size=BATCH, progress=False)
    path = trace_many(model, images[:4], tmp_path / "modes.zarr", **args)
    modes = "plain; blocks recomputed, one target at a time"
    assert open_traces(path).attrs["memory_mode"] == modes
    assert image_trace(open_traces(path), 3).attrs["memory_mode"] == modes
    # A store begun before modes were recorded: its first batches' modes are unknown, so resuming it claims none.
    old = tmp_path / "old.zarr"
    with pytest.raises(KeyboardInterrupt):
        trace_many(model, _gen(images[:4], stop=3), old, **args)
    del zarr.open_group(str(old), mode="r+").attrs["memory_mode"]
    trace_many(model, images[:4], old, **args)
    assert open_traces(old)["image"].size == 4 and "memory_mode" not in open_traces(old).attrs
