"""The tracer's inputs (issue #2): unsupported models, bad images and bad arguments refused with the model
untouched, and images given as PIL images, uint8 arrays (normalised with the model's data config) or tensors
(used as given)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

import vitcam_nb as vc

# --------------------------------------------------------------------------------------------------
# 5. Bad input, and the model untouched after each refusal


def _tiny_resnet():
    from timm.models.resnet import BasicBlock, ResNet

    return ResNet(block=BasicBlock, layers=[1, 1, 1, 1], num_classes=10).eval()


@pytest.mark.parametrize("make", [
    _tiny_resnet,
    lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(4, 10)),
], ids=["timm_resnet", "sequential"])
def test_unsupported_model_refused(make, model_snapshot, assert_model_unchanged):
    model = make()
    before = model_snapshot(model)
    with pytest.raises(TypeError, match="vit") as info:
        vc.trace(model, torch.zeros(1, 3, 32, 32))
    assert "model" in str(info.value)
    assert_model_unchanged(before, model)


def test_non_module_refused():
    with pytest.raises(TypeError, match="model"):
        vc.trace(lambda x: x, torch.zeros(1, 3, 32, 32))


BAD_IMAGES = {
    "rank4_array": np.zeros((1, 32, 32, 3), np.uint8),
    "4_channel_tensor": torch.zeros(1, 4, 32, 32),
    "batch2_tensor": torch.zeros(2, 3, 32, 32),
    "rank2_tensor": torch.zeros(3, 32),
    "nan_tensor": torch.full((1, 3, 32, 32), float("nan")),
    "inf_tensor": torch.zeros(1, 3, 32, 32).index_fill_(2, torch.tensor([5]), float("inf")),
    "wrong_size_tensor": torch.zeros(1, 3, 40, 40),
    "list": [[0, 1], [2, 3]],
    "string": "cat.jpg",
    "bool_array": np.zeros((32, 32, 3), bool),
    "2_channel_array": np.zeros((32, 32, 2), np.uint8),
}

# Refused by 0.1, read by the one input rule since (vitcam_nb.preprocess.to_pixels): the same black image.
SAME_AS_BLACK = {
    "rank2_array": np.zeros((32, 32), np.uint8),
    "4_channel_array": np.zeros((32, 32, 4), np.uint8),
    "float_array": np.zeros((32, 32, 3), np.float32),
    "int64_array": np.zeros((32, 32, 3), np.int64),
    "uint8_tensor": torch.zeros(1, 3, 32, 32, dtype=torch.uint8),
}


@pytest.mark.parametrize("name", list(SAME_AS_BLACK))
def test_other_pixel_layouts_give_the_uint8_rgb_input(name, tiny_vit):
    black = vc.trace(tiny_vit, np.zeros((32, 32, 3), np.uint8), targets="top1", sites=["F1"])
    tr = vc.trace(tiny_vit, SAME_AS_BLACK[name], targets="top1", sites=["F1"])
    assert tr.attrs["input_sha256"] == black.attrs["input_sha256"]


@pytest.mark.parametrize("name", list(BAD_IMAGES))
def test_bad_image_refused(name, tiny_vit, model_snapshot, assert_model_unchanged):
    before = model_snapshot(tiny_vit)
    with pytest.raises((ValueError, TypeError), match="image"):
        vc.trace(tiny_vit, BAD_IMAGES[name])
    assert_model_unchanged(before, tiny_vit)


def test_dynamic_model_size_not_divisible_by_patch_refused(tiny_vit_dynamic, model_snapshot,
                                                           assert_model_unchanged):
    before = model_snapshot(tiny_vit_dynamic)
    with pytest.raises(ValueError, match="image"):
        vc.trace(tiny_vit_dynamic, torch.zeros(1, 3, 30, 40))
    assert_model_unchanged(before, tiny_vit_dynamic)


@pytest.mark.parametrize("kw,arg", [
    (dict(sites=["F7"]), "sites"), (dict(sites="f1"), "sites"), (dict(sites=["F1", "bogus"]), "sites"),
    (dict(sites=[]), "sites"), (dict(sites=3), "sites"),
    (dict(layers=3), "layers"), (dict(layers=-4), "layers"), (dict(layers=[0, 5]), "layers"),
    (dict(layers=[]), "layers"), (dict(layers=1.5), "layers"), (dict(layers="0"), "layers"),
    (dict(layers=True), "layers"),
    (dict(dtype="float64"), "dtype"), (dict(dtype="bfloat16"), "dtype"),
    (dict(labels=["a", "b"]), "labels"),
])
def test_bad_arguments_refused(kw, arg, tiny_vit, model_input, model_snapshot, assert_model_unchanged):
    x = model_input("vit")
    before = model_snapshot(tiny_vit)
    with pytest.raises(ValueError, match=arg):
        vc.trace(tiny_vit, x, **kw)
    assert_model_unchanged(before, tiny_vit)
    assert not x.requires_grad and x.grad is None


# --------------------------------------------------------------------------------------------------
# 11. Image input


def _with_data_config(model, hw):
    model.pretrained_cfg = dict(input_size=(3, *hw), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                                interpolation="bilinear", crop_pct=1.0, crop_mode="center")
    return model


def test_pil_and_uint8_array_give_the_same_trace(tiny_vit):
    from PIL import Image

    model = _with_data_config(tiny_vit, (32, 32))
    arr = np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    from_array = vc.trace(model, arr)
    from_pil = vc.trace(model, Image.fromarray(arr))
    xr.testing.assert_equal(from_array, from_pil)
    assert from_array.attrs["trace_id"] == from_pil.attrs["trace_id"]
    assert from_array.attrs["input_sha256"] == from_pil.attrs["input_sha256"]
    assert from_array["image"].shape == (32, 32, 3) and from_array["image"].dtype == np.uint8


def test_uint8_array_is_normalised_with_the_models_config(tiny_vit):
    """A 32x32 uint8 image on a 32x32 model with crop_pct 1: no resampling, only (v/255 - mean)/std."""
    model = _with_data_config(tiny_vit, (32, 32))
    arr = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    x = (torch.from_numpy(arr).permute(2, 0, 1)[None].float() / 255.0 - 0.5) / 0.5
    from_array = vc.trace(model, arr, targets=[1])
    from_tensor = vc.trace(model, x, targets=[1])
    for name in ("act", "grad", "attn", "attn_grad", "logits"):
        np.testing.assert_allclose(from_array[name].values, from_tensor[name].values, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(from_array["image"].values, arr)


def test_uint8_array_on_a_model_without_pretrained_cfg(tiny_vit):
    """A model built at 32x32 (no pretrained_cfg, or timm.create_model(img_size=32), whose
    pretrained_cfg still says 224) must get its uint8 image resized to 32x32, not 224x224."""
    arr = np.full((50, 60, 3), 128, np.uint8)
    tr = vc.trace(tiny_vit, arr, targets=0)
    assert tr["image"].shape == (32, 32, 3)
    assert tr.sizes["token"] == 17


def test_tensor_used_as_given_and_displayed_unnormalised(tiny_vit, model_input):
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    x = model_input("vit")
    x_before = x.clone()
    tr = vc.trace(tiny_vit, x, targets=[0])
    assert torch.equal(x, x_before) and not x.requires_grad and x.grad is None
    with torch.no_grad():
        np.testing.assert_allclose(tr["logits"].values, tiny_vit(x)[0].numpy(), rtol=1e-5, atol=1e-6)
    mean = np.array(IMAGENET_DEFAULT_MEAN).reshape(1, 1, 3)
    std = np.array(IMAGENET_DEFAULT_STD).reshape(1, 1, 3)
    expected = np.clip(x[0].permute(1, 2, 0).double().numpy() * std + mean, 0, 1) * 255
    img = tr["image"]
    assert img.dtype == np.uint8 and img.dims == ("y", "x", "rgb") and img.shape == (32, 32, 3)
    assert np.max(np.abs(img.values.astype(np.float64) - expected)) <= 0.5 + 1e-3
    assert list(tr["rgb"].values) == ["r", "g", "b"]
