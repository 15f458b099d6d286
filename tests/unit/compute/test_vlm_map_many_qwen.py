"""``vc.map_many`` on Qwen2-VL / 2.5-VL answers (issue 55, item 7; tiny models of tests/vlm_qwen_tiny.py): each
image's packed ``pixel_values`` are prepared with its own answer target's ``image_grid_thw`` (as ``vc.trace``
prepares them), and each tower-site map read back is bitwise ``vc.cam`` on ``vc.trace`` of that image with that
target and the sites and blocks the store's pass captured (the same pass, a batch of one: structural), with the same
checklist, methods and trace id; within 1e-6 of a trace of every site. Checksums and resume (with verify) work;
what the store cannot hold (images on other patch grids, a target without image_grid_thw, bad packed pixels) is
refused by name before any write. LM-site maps on the 2x2-merged grid (and the crops families):
test_map_many_vlm_crops.py."""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import zarr

import vitcam_nb as vc

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
import vlm_qwen_tiny as tiny  # noqa: E402

RECIPES = [vc.Recipe(site="F1", layer=1, class_=0),
           vc.Recipe(site="F4", layer="all", layer_fusion="mean", class_=3),  # the sequence log-prob, fused
           vc.Recipe(site="F6", layer=-1, class_=2, weighting="layercam", relu="none")]
SITES = ["F1", "F4", "F6"]


def _inputs(seed: int, size: tuple[int, int] = tiny.SIZE, answer=(10, 11, 12)):
    img = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    out = tiny.processor()(images=[img], return_tensors="pt")
    t = vc.targets.answer(input_ids=tiny.PROMPT, answer_ids=list(answer),
                          model_kwargs={"image_grid_thw": out["image_grid_thw"]})
    return out["pixel_values"], t


@pytest.fixture(scope="module", params=["qwen2", "qwen2_5"])
def case(request, tmp_path_factory):
    model = tiny.make_model(request.param)
    pairs = [_inputs(1), _inputs(2, answer=(13, 14, 15)), _inputs(3, answer=(20, 9, 30))]
    images, targets = [p for p, _ in pairs], [t for _, t in pairs]
    path = tmp_path_factory.mktemp("qwen") / "answers.zarr"
    vc.map_many(model, images, RECIPES, path, targets=targets, batch_size=2, progress=False)
    return model, images, targets, path


def _cam(ds, r):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        return vc.cam(ds, r)


def test_each_image_map_is_vc_cam_on_its_trace(case):
    model, images, targets, path = case
    ds = vc.open_maps(path)
    assert ds.sizes["image"] == 3 and (ds.sizes["gy"], ds.sizes["gx"]) == (6, 10)
    assert ds.attrs["checksums"].startswith("sha256")
    maps = []
    for i in range(3):
        one = vc.image_maps(ds, i)
        same_pass = vc.trace(model, images[i], targets=targets[i], sites=SITES)
        every_site = vc.trace(model, images[i], targets=targets[i])
        assert str(one["trace_id"].values) == same_pass.attrs["trace_id"]
        np.testing.assert_array_equal(one["logits"].values, same_pass["logits"].values)
        for r in RECIPES:
            got, want = _cam(one, r), _cam(same_pass, r)
            assert got.dims == ("y", "x") and got.shape == tuple(tiny.SIZE)
            np.testing.assert_array_equal(got.values, want.values)
            for key in ("checklist", "methods", "degenerate", "recipe_id"):
                assert got.attrs[key] == want.attrs[key], key
            np.testing.assert_allclose(got.values, _cam(every_site, r).values, rtol=0, atol=1e-6)
        maps.append(_cam(one, RECIPES[0]).values)
    # each image's own answer and pixels: a store that mixed them up would fail above
    assert not np.array_equal(maps[0], maps[1])


def test_resume_verifies_each_image_with_its_target_and_damage_is_refused(case, tmp_path):
    model, images, targets, path = case
    copy = tmp_path / "copy.zarr"
    shutil.copytree(path, copy)
    assert vc.map_many(model, images, RECIPES, copy, targets=targets, progress=False, verify=True,
                       batch_size=2) == copy
    swapped = [images[1], images[0], images[2]]
    with pytest.raises(vc.TraceFileError, match="holds another image at index 0"):
        vc.map_many(model, swapped, RECIPES, copy, targets=targets, progress=False, verify=True,
                       batch_size=2)
    group = zarr.open_group(str(copy), mode="r+")
    group["maps"][1, 0] = np.asarray(group["maps"][1, 0]) + 1.0
    with pytest.raises(vc.TraceFileError, match=r"is damaged: image 1's array 'maps' no longer"):
        vc.image_maps(vc.open_maps(copy), 1)
    vc.image_maps(vc.open_maps(copy), 0)  # image 0 is whole


def _refused(model, images, recipes, targets, tmp_path, match):
    path = tmp_path / "refused.zarr"
    with pytest.raises(vc.VitcamError, match=match):
        vc.map_many(model, images, recipes, path, targets=targets, progress=False)
    assert not path.exists()


def test_what_a_qwen_store_cannot_hold_is_refused_before_any_write(tmp_path):
    model = tiny.make_model("qwen2")
    (x0, t0), (x1, t1) = _inputs(1), _inputs(2)
    # a portrait image packs as many patches (60) on a 10x6 grid: another grid, the same input shape
    xp, tp = _inputs(4, size=(tiny.SIZE[1], tiny.SIZE[0]))
    assert xp.shape == x0.shape
    _refused(model, [x0, xp], RECIPES[:1], [t0, tp], tmp_path,
             r"targets: image 1's answer target states a 10x6 patch grid \(image_grid_thw\), image 0's 6x10")
    bare = vc.targets.answer(input_ids=tiny.PROMPT, answer_ids=[10, 11, 12])
    _refused(model, [x0, x1], RECIPES[:1], [t0, bare], tmp_path,
             r"model_kwargs: Qwen2VLForConditionalGeneration needs image_grid_thw")
    _refused(model, [x0, x1[:, :-1]], RECIPES[:1], [t0, t1], tmp_path,
             r"images\[1\]: expected pixel_values of shape \(N_patches, 1176\).*got \(60, 1175\)")
