"""vc.score on trace_many stores (issue #19): scores are written into the store image by image, equal those of the
single-image path (itself checked against hand-written forward passes in test_scoring.py), and a rerun scores only
the images not done, calling the model for nothing else."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitcam_nb as vc
from vitcam_nb.core.errors import TraceError, TraceFileError


@pytest.fixture
def setup(model_factory, model_input, tmp_path):
    model = model_factory("vit")
    images = [model_input("vit", seed)[0] for seed in range(3)]
    path = vc.trace_many(model, images, tmp_path / "t.zarr", targets="top2", sites=["F1", "F4"], progress=False)
    return model, images, path


def _counting(model: torch.nn.Module) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    calls: list[int] = []
    return calls, model.register_forward_hook(lambda _m, args, _o: calls.append(int(args[0].shape[0])))


def test_store_scores_equal_the_single_trace_path(setup):
    model, images, path = setup
    ds = vc.score(path, model, "ablationcam", images, layer=1, site="F4", batch_size=7, progress=False)
    assert ds["ablation"].dims == ("image", "layer", "site", "target", "channel")
    for i, img in enumerate(images):
        single = vc.score(vc.trace(model, img[None], targets="top2", sites=["F1", "F4"]), model, "ablationcam",
                          img[None], layer=1, site="F4", progress=False)
        want = single["ablation"].sel(layer=1, site="F4").values
        got = ds["ablation"].isel(image=i).sel(layer=1, site="F4").values
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.isnan(ds["ablation"].isel(image=i).sel(layer=0).values).all()  # only what was asked
        one = vc.image_trace(ds, i)
        np.testing.assert_allclose(vc.cam(one, vc.Recipe(weighting="ablationcam", layer=1, site="F4")).values,
                                   vc.cam(single, vc.Recipe(weighting="ablationcam", layer=1, site="F4")).values,
                                   atol=1e-5)


def test_a_rerun_scores_only_the_images_not_done(setup):
    model, images, path = setup
    wrong = [images[0], images[2], images[1]]  # image 1 is not the traced one: the run stops there
    with pytest.raises(TraceError, match="images: image 1"):
        vc.score(path, model, "scorecam", wrong, site="F1", batch_size=64, progress=False)
    ds = vc.open_traces(path)
    done = [bool(np.isfinite(ds["score"].isel(image=i).sel(layer=2, site="F1")).all()) for i in range(3)]
    assert done == [True, False, False]
    calls, handle = _counting(model)
    try:
        ds = vc.score(ds, model, "scorecam", images, site="F1", batch_size=64, progress=False)
        n = ds.sizes["channel"]
        # images 1 and 2: a check pass of the unperturbed input, then one pass over every channel; image 0 skipped
        assert calls == [1, n, 1, n]
        calls.clear()
        vc.score(path, model, "scorecam", images, site="F1", progress=False)
        assert calls == []
    finally:
        handle.remove()
    assert np.isfinite(ds["score"].sel(layer=2, site="F1")).all()


def test_trace_many_resumes_a_scored_store(model_factory, model_input, tmp_path):
    model = model_factory("vit")
    images = [model_input("vit", seed)[0] for seed in range(3)]
    path = vc.trace_many(model, iter(images[:2]), tmp_path / "t.zarr", targets="top1", sites=["F1"], progress=False)
    vc.score(path, model, "scorecam", images[:2], site="F1", progress=False)
    vc.trace_many(model, iter(images), path, targets="top1", sites=["F1"], progress=False)
    ds = vc.open_traces(path)
    assert ds.sizes["image"] == 3
    assert np.isnan(ds["score"].isel(image=2).values).all()
    assert np.isfinite(ds["score"].isel(image=1).sel(layer=2).values).all()


def test_store_refusals(setup, model_factory):
    model, images, path = setup
    with pytest.raises(TraceError, match="images: vc.score on a store needs the images"):
        vc.score(path, model, "scorecam")
    with pytest.raises(TraceFileError, match="images: 2 images"):
        vc.score(path, model, "scorecam", images[:2], progress=False)
    with pytest.raises(TraceError, match="targets: trace_many stores hold class targets"):
        vc.score(path, model, "scorecam", images, targets=vc.targets.region(np.ones((4, 4)), 0))
    with pytest.raises(TypeError, match="pass the store's path"):
        vc.score(vc.open_traces(path).isel(image=[0]), model, "scorecam", images)
    with pytest.raises(TraceError, match="weights"):
        vc.score(path, model_factory("vit", seed=1), "scorecam", images, progress=False)
