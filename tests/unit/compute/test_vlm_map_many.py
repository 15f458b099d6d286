"""``vc.map_many`` on a generative VLM's answers (issue 55, item 7), on the tiny LLaVA of test_vlm_llava.py: one
answer target per image (each image's own answer) or one for every image, recipes at the tower's and the LM's
sites; each map read back from the store is bitwise ``vc.cam`` on ``vc.trace`` of that image with that target and
the sites and blocks the store's pass captured (the same pass, a batch of one: structural), with the same
checklist, methods, degeneracy and trace id; within 1e-6 of a trace of every site (another set of hooks, the same
kernels). The per-image checksums cover the stored maps and checklists; what a store cannot hold is refused by
name before any pass or write. Qwen2-VL / 2.5-VL: test_vlm_map_many_qwen.py; the crops families and LM sites off
the tower's grid: test_map_many_vlm_crops.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

import vitcam_nb as vc

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_vlm_gemma_families import SETUP  # noqa: E402
from test_vlm_gemma_families import make as make_gemma  # noqa: E402
from test_vlm_gemma_families import make_x as make_gemma_x  # noqa: E402
from test_vlm_llava import PROMPT, make_llava, make_x  # noqa: E402

ANSWERS = ([9, 10, 11], [12, 13, 14], [20, 9, 30])
RECIPES = [vc.Recipe(site="F1", layer=1, class_=0),
           vc.Recipe(site="F1", layer=-1, class_=1),  # the tower layer LLaVA never reads: degenerate
           vc.Recipe(site="F4", layer=(0, 1), layer_fusion="mean", class_=3),  # the sequence log-prob, fused
           vc.Recipe(site="lm_resid", layer=-1, class_=1),
           vc.Recipe(site="lm_resid", layer="all", layer_fusion="max", class_=2, relu="none"),
           vc.Recipe(site="lm_attn", layer=(0, 1), layer_fusion="mean", class_=2, weighting="layercam",
                     heads="mean_then_relu"),
           vc.Recipe(site="projector", class_=0, relu="none")]
# what the store's pass captures for RECIPES
SITES, LAYERS = ["F1", "F4", "projector", "lm_resid", "lm_attn"], [0, 1, 2]


@pytest.fixture(scope="module")
def llava():
    return make_llava()


@pytest.fixture(scope="module")
def images():
    return [make_x(s) for s in (1, 2, 3)]


@pytest.fixture(scope="module")
def targets():
    return [vc.targets.answer(input_ids=PROMPT, answer_ids=a) for a in ANSWERS]


@pytest.fixture(scope="module")
def store(llava, images, targets, tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm") / "answers.zarr"
    return vc.map_many(llava, images, RECIPES, path, targets=targets, batch_size=2, progress=False)


def _same(a, b, exact: bool = True):
    if exact:
        np.testing.assert_array_equal(b.values, a.values)
    else:
        np.testing.assert_allclose(b.values, a.values, rtol=0, atol=1e-6)
    # another pass is another trace id, which the checklist and methods name
    for key in ("checklist", "methods", "degenerate", "recipe_id") if exact else ("degenerate", "recipe_id"):
        assert a.attrs[key] == b.attrs[key], key


def test_each_image_map_is_vc_cam_on_its_trace(llava, images, targets, store):
    ds = vc.open_maps(store)
    assert ds.sizes["image"] == 3 and ds.attrs["checksums"].startswith("sha256")
    for i in range(3):
        one = vc.image_maps(ds, i)
        same_pass = vc.trace(llava, images[i], targets=targets[i], sites=SITES, layers=LAYERS)
        every_site = vc.trace(llava, images[i], targets=targets[i])
        assert str(one["trace_id"].values) == same_pass.attrs["trace_id"]
        np.testing.assert_array_equal(one["logits"].values, same_pass["logits"].values)
        for r in RECIPES:
            with pytest.warns(vc.DegenerateMapWarning) if r.layer == -1 and r.site == "F1" else _nothing():
                got = vc.cam(one, r)
            _same(_quiet(same_pass, r), got)
            _same(_quiet(every_site, r), got, exact=False)
            # read at another upsampling: vc.cam's values and the report it writes at that upsampling
            other = r.replace(upsample="nearest")
            _same(_quiet(same_pass, other), _quiet(one, other))
        # the maps differ between images (their own answers), so a store that mixed them up would fail above
    first = [vc.cam(vc.image_maps(ds, i), RECIPES[3]).values for i in range(3)]
    assert not np.array_equal(first[0], first[1])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _quiet(trace, r):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        return vc.cam(trace, r)


def test_the_unread_tower_layer_is_degenerate_in_the_store_too(store):
    one = vc.image_maps(vc.open_maps(store), 0)
    with pytest.warns(vc.DegenerateMapWarning, match="zero gradient"):
        m = vc.cam(one, RECIPES[1])
    assert not np.any(m.values)


def test_all_images_at_once_and_every_spelling(store):
    ds = vc.open_maps(store)
    both = vc.cam(ds, vc.Recipe(site="lm_resid", layer=1, class_=1))  # layer 1 of 2 is the stored layer -1
    assert both.dims == ("image", "y", "x")
    for i in range(3):
        np.testing.assert_array_equal(both.values[i], vc.cam(vc.image_maps(ds, i), RECIPES[3]).values)


def test_one_target_for_every_image(llava, images, tmp_path):
    t = vc.targets.answer(input_ids=PROMPT, answer_ids=[9, 10, 11])
    path = vc.map_many(llava, images[:2], [RECIPES[3]], tmp_path / "one.zarr", targets=t, progress=False)
    ds = vc.open_maps(path)
    assert json.loads(ds.attrs["settings"])["targets"]["answer_ids"] == [9, 10, 11]
    # an LM-only store's pass also captures F1 at the last tower block (the store's grid and token kinds)
    assert json.loads(ds.attrs["settings"])["sites"] == ["F1", "lm_resid"]
    tr = vc.trace(llava, images[1], targets=t, sites=["F1", "lm_resid"], layers=[2])
    _same(vc.cam(tr, RECIPES[3]), vc.cam(vc.image_maps(ds, 1), RECIPES[3]))
    # the same call again resumes the finished store; other answers are another store
    assert vc.map_many(llava, images[:2], [RECIPES[3]], path, targets=t, progress=False) == path
    other = vc.targets.answer(input_ids=PROMPT, answer_ids=[12, 13, 14])
    with pytest.raises(vc.TraceFileError, match="another model or settings"):
        vc.map_many(llava, images[:2], [RECIPES[3]], path, targets=other, progress=False)


def test_a_stored_map_or_checklist_changed_on_disk_is_refused(store, tmp_path):
    import shutil

    path = tmp_path / "copy.zarr"
    shutil.copytree(store, path)
    group = zarr.open_group(str(path), mode="r+")
    group["maps"][1, 3] = np.asarray(group["maps"][1, 3]) * 0.5
    with pytest.raises(vc.TraceFileError, match=r"is damaged: image 1's array 'maps' no longer"):
        vc.image_maps(vc.open_maps(path), 1)
    prov = json.loads(str(group["provenance"][2]))
    prov["map_reports"] = prov["map_reports"].replace("lm_resid", "lm_attn")
    group["provenance"][2] = json.dumps(prov)
    with pytest.raises(vc.TraceFileError, match=r"is damaged: image 2's array 'provenance' no longer"):
        vc.image_maps(vc.open_maps(path), 2)
    vc.image_maps(vc.open_maps(path), 0)  # image 0 is whole


@pytest.mark.parametrize("case, match", [
    ("count", r"targets: 2 answer targets \(one per image\) for 3 images"),
    ("lengths", r"targets: image 1's answer target traces 5 entries, image 0's 7"),
    ("mixed", r"targets: a list of answer targets holds one vitcam_nb.targets.answer per image"),
    ("ranked", r"class 'top1' ranks or names no traced entry"),
    ("torch", r"backend: an answer target's sequence is scored per image"),
])
def test_what_a_store_cannot_hold_is_refused_before_any_write(llava, images, targets, tmp_path, case, match):
    kw = {"targets": targets, "recipes": RECIPES[3:4]}
    if case == "count":
        kw["targets"] = targets[:2]
    elif case == "lengths":
        kw["targets"] = [targets[0], vc.targets.answer(input_ids=PROMPT, answer_ids=[9, 10]), targets[2]]
    elif case == "mixed":
        kw["targets"] = [targets[0], 3, targets[2]]
    elif case == "torch":
        kw["recipes"] = RECIPES[:1]
    elif case == "ranked":
        kw["recipes"] = [vc.Recipe(site="lm_resid", class_="top1")]
    path = tmp_path / "refused.zarr"
    with pytest.raises(vc.VitcamError, match=match):
        vc.map_many(llava, images, kw["recipes"], path, targets=kw["targets"], progress=False,
                    backend="torch" if case == "torch" else "numpy")
    assert not path.exists()


def test_lm_sites_on_another_grid_than_the_towers_are_stored_on_their_own(tmp_path):
    """Gemma 3 pools the 8x8 patch grid into 4x4 image tokens: the LM-site maps are stored on that 4x4 grid
    (``lm_maps``), the tower's on the 8x8 (``maps``), each read back bitwise as vc.cam gives it on the same pass."""
    model = make_gemma("gemma3")
    t = vc.targets.answer(input_ids=SETUP["gemma3"][2], answer_ids=[9, 10, 11])
    recipes = [vc.Recipe(site="F1", layer=1, class_=0), vc.Recipe(site="lm_resid", layer=-1, class_=1)]
    path = vc.map_many(model, [make_gemma_x("gemma3")], recipes, tmp_path / "g.zarr", targets=t, progress=False)
    ds = vc.open_maps(path)
    assert (ds.sizes["gy"], ds.sizes["lgy"], ds.sizes["lgx"]) == (8, 4, 4)
    settings = json.loads(ds.attrs["settings"])
    tr = vc.trace(model, make_gemma_x("gemma3"), targets=t, sites=settings["sites"], layers=settings["layers"])
    for r in recipes:
        _same(vc.cam(tr, r), vc.cam(vc.image_maps(ds, 0), r))
