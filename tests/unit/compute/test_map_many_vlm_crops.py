"""``vc.map_many`` on the answers it refused before (issue 55, item 7): the crops families (tiny LLaVA-NeXT and
OneVision of anyres_cases.py, Idefics3 and SmolVLM of test_vlm_idefics.py: ``VlmFamily.crops``), whose tower maps
are one per crop (crop, y, x) and whose LM-site maps are one per tile group (view, y, x), and Qwen2-VL / 2.5-VL's
LM sites, whose merged token grid is not the tower's (tests/vlm_qwen_tiny.py).

Each map read back from the store is compared with ``vc.cam`` on ``vc.trace`` of that image with that target and
the sites and blocks the store's pass captured. ``map_many`` traces each answer image as a batch of one in a pass
of its own (``compute_batch(image_target(plan, own, i), entries, n_parts, [p])`` in map_many.flush), and
``vc.trace`` runs that same pass on the same shapes: so the values are compared bitwise (structural: the same
kernels on the same arrays), with the dims, the crop/view/tile coords, and at the stored upsampling the checklist,
methods, degeneracy and recipe id. A trace of every site (other hooks, the same kernels) agrees within 1e-6.
Checksums cover the new arrays and resume works; what such a store still cannot hold is refused by name before
any write."""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
import zarr

import vitcam_nb as vc

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
import anyres_cases  # noqa: E402
import test_vlm_idefics as idefics  # noqa: E402
import vlm_qwen_tiny as tiny  # noqa: E402

TOWER = [vc.Recipe(site="F1", layer=1, class_=0),
         vc.Recipe(site="F4", layer=(0, 1), layer_fusion="mean", class_=3)]  # the sequence log-prob, fused
LM = [vc.Recipe(site="lm_resid", layer=-1, class_=1),
      vc.Recipe(site="lm_resid", layer="all", layer_fusion="max", class_=2, relu="none"),
      vc.Recipe(site="lm_attn", layer=(0, 1), layer_fusion="mean", class_=2, weighting="layercam",
                heads="mean_then_relu"),
      vc.Recipe(site="projector", class_=0)]
RECIPES = TOWER + LM
ANSWERS = ([9, 10, 11], [12, 13, 14])


def _qwen_input(seed: int, answer: list[int]):
    img = np.random.default_rng(seed).integers(0, 256, (*tiny.SIZE, 3), dtype=np.uint8)
    out = tiny.processor()(images=[img], return_tensors="pt")
    t = vc.targets.answer(input_ids=tiny.PROMPT, answer_ids=answer,
                          model_kwargs={"image_grid_thw": out["image_grid_thw"]})
    return out["pixel_values"], t


def _case(kind: str):
    """(model, two images, their answer targets, the dims a tower and an LM map have)."""
    if kind in ("next", "onevision"):
        model = anyres_cases.make(kind)
        images = [anyres_cases.pixels(1), anyres_cases.pixels(2)]
        targets = [vc.targets.answer(input_ids=anyres_cases.prompt(kind), answer_ids=a,
                                     model_kwargs={"image_sizes": torch.tensor([anyres_cases.SIZE])})
                   for a in ANSWERS]
        return model, images, targets, ("crop", "y", "x"), ("view", "y", "x")
    if kind in idefics.KINDS:
        model = idefics.make(kind)
        images = [idefics.make_x(seed=1), idefics.make_x(seed=2)]
        targets = [vc.targets.answer(input_ids=idefics.PROMPT, answer_ids=a) for a in ANSWERS]
        return model, images, targets, ("crop", "y", "x"), ("view", "y", "x")
    model = tiny.make_model(kind)
    pairs = [_qwen_input(1, ANSWERS[0]), _qwen_input(2, ANSWERS[1])]
    return model, [p for p, _ in pairs], [t for _, t in pairs], ("y", "x"), ("y", "x")


@pytest.fixture(scope="module", params=["next", "onevision", "idefics3", "smolvlm", "qwen2", "qwen2_5"])
def case(request, tmp_path_factory):
    model, images, targets, tower_dims, lm_dims = _case(request.param)
    path = tmp_path_factory.mktemp(request.param) / "answers.zarr"
    vc.map_many(model, images, RECIPES, path, targets=targets, batch_size=2, progress=False)
    return request.param, model, images, targets, path, tower_dims, lm_dims


def _cam(ds, r):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        return vc.cam(ds, r)


def _same(want, got, report: bool):
    assert got.dims == want.dims
    np.testing.assert_array_equal(got.values, want.values)  # NaN where no tile of a group covers a pixel
    assert sorted(got.coords) == sorted(want.coords)
    for c in want.coords:
        np.testing.assert_array_equal(got[c].values, want[c].values)
    for key in ("checklist", "methods", "degenerate", "recipe_id") if report else ("degenerate", "recipe_id"):
        assert got.attrs[key] == want.attrs[key], key


def test_each_map_is_vc_cam_on_its_trace(case):
    kind, model, images, targets, path, tower_dims, lm_dims = case
    ds = vc.open_maps(path)
    settings = json.loads(ds.attrs["settings"])
    assert ds.sizes["image"] == 2 and ds.attrs["checksums"].startswith("sha256")
    for i in range(2):
        one = vc.image_maps(ds, i)
        same_pass = vc.trace(model, images[i], targets=targets[i], sites=settings["sites"],
                             layers=settings["layers"])
        every_site = vc.trace(model, images[i], targets=targets[i])
        assert str(one["trace_id"].values) == same_pass.attrs["trace_id"]
        for r in RECIPES:
            got = _cam(one, r)
            assert got.dims == (tower_dims if r in TOWER else lm_dims)
            _same(_cam(same_pass, r), got, report=True)
            np.testing.assert_allclose(got.values, _cam(every_site, r).values, rtol=0, atol=1e-6)
            # any upsampling is read from the same stored grid, with the report vc.cam writes at that upsampling
            for up in ("none", "nearest", "bicubic"):
                _same(_cam(same_pass, r.replace(upsample=up)), _cam(one, r.replace(upsample=up)), report=True)
    # each image's own answer and pixels: a store that mixed them up would fail above
    first = [_cam(vc.image_maps(ds, i), LM[0]).values for i in range(2)]
    assert not np.array_equal(first[0], first[1], equal_nan=True)


def test_the_whole_store_and_its_layout_on_disk(case):
    kind, _, _, _, path, tower_dims, lm_dims = case
    ds = vc.open_maps(path)
    for r in (TOWER[0], LM[0]):
        both = _cam(ds, r)
        assert both.dims == ("image", *(tower_dims if r in TOWER else lm_dims))
        for i in range(2):
            np.testing.assert_array_equal(both.values[i], _cam(vc.image_maps(ds, i), r).values)
    if not kind.startswith("qwen"):  # one crop of an image reads as an image of a single-image store: that crop's map
        one = vc.image_maps(ds, 1)
        np.testing.assert_array_equal(_cam(one.isel(crop=2), TOWER[1]).values, _cam(one, TOWER[1]).values[2])
    rows = json.loads(ds.attrs["recipes"])
    crops = not kind.startswith("qwen")
    assert [row.get("grid", "") for row in rows] == ["crop" if crops else ""] * 2 + ["lm"] * 4
    assert ds["maps"].dims == (("image", "crop", "recipe", "gy", "gx") if crops else ("image", "recipe", "gy", "gx"))
    assert ds["lm_maps"].dims == ("image", "recipe", "lgy", "lgx")
    if not crops:  # the 2x2-merged 3x5 grid of the tower's 6x10 patches
        assert (ds.sizes["gy"], ds.sizes["gx"], ds.sizes["lgy"], ds.sizes["lgx"]) == (6, 10, 3, 5)
    else:
        assert ds.sizes["crop"] == 5 and ds.sizes["lgy"] == 1  # every image token of every tile in one row
    digests = json.loads(str(vc.image_maps(ds, 0)["checksum"].values))
    assert {"maps", "lm_maps", "lm_parts", "lm_part_reason", "provenance"} <= set(digests)


def test_damage_to_the_new_arrays_is_refused_and_resume_works(case, tmp_path):
    kind, model, images, targets, path, _, _ = case
    copy = tmp_path / "copy.zarr"
    shutil.copytree(path, copy)
    group = zarr.open_group(str(copy), mode="r+")
    # resume: the batch (both images, batch_size=2) marked not done, as an interrupted call leaves it, is computed
    # again, whole, and reads as before
    want = _cam(vc.image_maps(vc.open_maps(path), 1), LM[1]).values
    group["done"][:] = False
    group.attrs["complete"] = 0
    with pytest.raises(vc.TraceFileError, match="is incomplete"):
        vc.open_maps(copy)
    group["lm_maps"][1] = np.asarray(group["lm_maps"][1]) * 0.5  # garbage the resumed call must overwrite
    assert vc.map_many(model, images, RECIPES, copy, targets=targets, batch_size=2, progress=False,
                       verify=True) == copy
    np.testing.assert_array_equal(_cam(vc.image_maps(vc.open_maps(copy), 1), LM[1]).values, want)
    with pytest.raises(vc.TraceFileError, match="holds another image at index 0"):
        vc.map_many(model, images[::-1], RECIPES, copy, targets=targets, batch_size=2, progress=False)
    # the LM maps, the crop maps (or Qwen's tower maps) and the layout each image's LM maps are placed by
    group["lm_maps"][1, 2] = np.asarray(group["lm_maps"][1, 2]) + 1.0
    group["maps"][0] = np.asarray(group["maps"][0]) * 0.5
    prov = json.loads(str(group["provenance"][1]))
    prov["lm_layout"] = prov["lm_layout"].replace('"tiled": ', '"tiled":')
    group["provenance"][1] = json.dumps(prov)
    ds = vc.open_maps(copy)
    for i, names in ((0, "'maps'"), (1, "'lm_maps', 'provenance'")):
        with pytest.raises(vc.TraceFileError, match=rf"is damaged: image {i}'s arrays? {names} no longer"):
            vc.image_maps(ds, i)


def _refused(model, images, recipes, targets, tmp_path, match):
    path = tmp_path / "refused.zarr"
    with pytest.raises(vc.VitcamError, match=match):
        vc.map_many(model, images, recipes, path, targets=targets, progress=False, batch_size=1)
    assert not path.exists()


def test_what_a_crops_store_cannot_hold_is_refused_before_any_write(tmp_path):
    model = anyres_cases.make("next")
    x = anyres_cases.pixels(1)

    def target(size, n_tokens):
        return vc.targets.answer(input_ids=[1, 5, 6] + [anyres_cases.IMG] * n_tokens + [7, 8],
                                 answer_ids=anyres_cases.ANSWER, model_kwargs={"image_sizes": torch.tensor([size])})

    base = target(anyres_cases.SIZE, 70)
    # a 30x70 image is read as 1x2 crops after the base view: another length of the crop dim
    _refused(model, [x, x], TOWER[:1], [base, target((30, 70), 52)], tmp_path,
             r"targets: the tower runs on 3 crops of image 1 and 5 of image 0")
    # 64x64 keeps 8x8 cells where 60x70 keeps 6x8: as many crops, another number of image tokens
    _refused(model, [x, x], LM[:1], [base, target((64, 64), 88)], tmp_path,
             r"targets: the answer target of image 1 lays its image tokens out as .*unpadded to 8x8.*1x80 grid.*"
             r"1x64")
    m3 = idefics.make("idefics3")
    t3 = vc.targets.answer(input_ids=idefics.PROMPT, answer_ids=idefics.ANSWER)
    _refused(m3, [idefics.make_x(seed=1), idefics.make_x(crops=4, seed=2)], TOWER[:1], t3, tmp_path,
             r"images: image 1 holds crops of shape \(1, 4, 3, 32, 32\), image 0 \(1, 5, 3, 32, 32\)")
    _refused(model, [x], [vc.Recipe(site="lm_logit", class_=0)], base, tmp_path,
             r"site 'lm_logit' \(the token activation map\) is computed by its own trace kind")


def test_the_store_kinds_report_is_its_first_images_maps(case):
    from vitcam_nb.compute.map_store import MAPS

    ds = vc.open_maps(case[4])
    for r in (TOWER[1], LM[2], LM[0].replace(upsample="nearest")):
        m = _cam(vc.image_maps(ds, 0), r)
        assert MAPS.checklist(r, ds).to_json() == m.attrs["checklist"]
        assert MAPS.describe(r, ds) == m.attrs["methods"]


def test_rows_the_other_arrays_hold_read_raw_as_nan_and_written_rows_are_still_checked(case, tmp_path):
    """Opened with xarray alone, a recipe's row in the arrays that do not hold it is NaN (never a map of zeros),
    every row the pass wrote is finite, and a written row that loses its values is still refused as damage."""
    _, _, _, _, path, _, _ = case
    raw = xr.open_zarr(path, consolidated=False)
    rows = json.loads(raw.attrs["recipes"])
    for k, row in enumerate(rows):
        mine, other = ("lm_maps", "maps") if row.get("grid") == "lm" else ("maps", "lm_maps")
        assert np.isfinite(raw[mine].isel(recipe=k).values).all(), row["text"]
        assert np.isnan(raw[other].isel(recipe=k).values).all(), row["text"]
        if row.get("part"):
            start, count = row["part"]
            part = raw[other.replace("maps", "parts")].isel(part=slice(start, start + count)).values
            assert np.isnan(part).all(), row["text"]
    copy = tmp_path / "copy.zarr"
    shutil.copytree(path, copy)
    group = zarr.open_group(str(copy), mode="r+")
    lm_row = next(k for k, row in enumerate(rows) if row.get("grid") == "lm")
    damaged = np.asarray(group["lm_maps"][0])
    damaged[lm_row] = np.nan
    group["lm_maps"][0] = damaged
    with pytest.raises(vc.TraceFileError, match="lm_maps"):
        vc.image_maps(vc.open_maps(copy), 0)


def test_a_store_sliced_along_crop_before_its_image_is_read_is_refused_as_such(case):
    """Slicing the whole store along ``crop`` is not damage: the error says what to do instead."""
    kind, _, _, _, path, _, _ = case
    if kind.startswith("qwen"):
        pytest.skip("Qwen's tower runs on one packed image: no crop dim")
    ds = vc.open_maps(path)
    with pytest.raises(vc.ArgumentError, match=r"isel\(crop=k\)"):
        vc.image_maps(ds.isel(crop=1), 0)
    np.testing.assert_array_equal(vc.image_maps(ds, 0).isel(crop=1)["maps"].values, ds["maps"].values[0, 1])
