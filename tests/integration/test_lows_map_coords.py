"""A map_many store names its axes: a ``recipe`` coordinate (each stored recipe's id, in the order of
``attrs["recipes"]``) and an ``image`` coordinate (each image's position); a store written without them (before
they existed) opens and reads as it did."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import zarr
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.DegenerateMapWarning")

RECIPES = [vc.Recipe(site="F1", layer=0), vc.Recipe(site="F1", layer=1, weighting="layercam")]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=4).eval()


@pytest.fixture(scope="module")
def images():
    return list(np.random.default_rng(1).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8))


def test_a_store_has_recipe_and_image_coordinates(tmp_path, model, images):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = vc.map_many(model, iter(images), RECIPES, tmp_path / "m.zarr", batch_size=2, progress=False)
    ds = vc.open_maps(path)
    assert ds["recipe"].values.tolist() == [r.id for r in RECIPES]
    assert [row["id"] for row in json.loads(ds.attrs["recipes"])] == [r.id for r in RECIPES]
    assert ds["image"].values.tolist() == list(range(len(images)))  # grown batch by batch: images of unknown count
    second = ds["maps"].sel(recipe=RECIPES[1].id).values
    np.testing.assert_array_equal(second, ds["maps"].values[:, 1])
    tr = vc.trace(model, images[3], targets="top1", sites=["F1"])
    one = vc.cam(vc.image_maps(ds, 3), RECIPES[1])
    np.testing.assert_array_equal(one.values, vc.cam(tr, RECIPES[1]).values)  # reading is unchanged


def test_a_store_written_without_the_coordinates_opens_and_reads_the_same(tmp_path, model, images):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = vc.map_many(model, images[:3], RECIPES, tmp_path / "m.zarr", batch_size=3, progress=False)
    with_coords = vc.cam(vc.open_maps(path), RECIPES[0]).values
    group = zarr.open_group(str(path), mode="r+")
    del group["recipe"], group["image"]  # the store as the writer before this change left it
    ds = vc.open_maps(path)
    assert "recipe" not in ds.variables and "image" not in ds.variables
    np.testing.assert_array_equal(vc.cam(ds, RECIPES[0]).values, with_coords)
