"""The up-front image check (``vitcam_nb.preprocess.check_image``, run on every in-memory image before a
``trace_many`` or ``map_many`` pass) refuses exactly what the input rule (``to_pixels``) refuses, with the same
error, without converting anything, and takes what it takes without a warning."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import vitcam_nb as vc
from vitcam_nb.preprocess import check_image, to_pixels

BAD = {
    "str": "x.png",
    "None": None,
    "bool array": np.zeros((8, 8, 3), bool),
    "complex array": np.zeros((8, 8), complex),
    "object array": np.full((8, 8), "a", object),
    "1-D array": np.zeros(5, np.uint8),
    "0-d array": np.zeros((), np.uint8),
    "5 channels": np.zeros((8, 8, 5), np.uint8),
    "empty": np.zeros((0, 8, 3), np.uint8),
    "batch of arrays": np.zeros((1, 3, 8, 8), np.uint8),
    "NaN floats": np.full((8, 8, 3), np.nan, np.float32),
    "inf floats": np.full((8, 8), np.inf),
    "float tensor 2 images": torch.zeros(2, 3, 8, 8),
    "float tensor 4 channels": torch.zeros(4, 8, 8),
    "float tensor NaN": torch.full((1, 3, 8, 8), float("nan")),
    "bool tensor": torch.zeros(3, 8, 8, dtype=torch.bool),
    "int tensor 5-D": torch.zeros(1, 1, 3, 8, 8, dtype=torch.uint8),
}
GOOD = {
    "uint8 HxWx3": np.zeros((8, 8, 3), np.uint8),
    "grey": np.zeros((8, 8), np.uint8),
    "RGBA": np.zeros((8, 8, 4), np.uint8),
    "16-bit": np.arange(64, dtype=np.uint16).reshape(8, 8) * 500,  # rescaled, with a warning when prepared
    "floats in 0..1": np.full((8, 8, 3), 0.5),
    "uint8 CHW tensor": torch.zeros(3, 8, 8, dtype=torch.uint8),
    "uint8 batch of one": torch.zeros(1, 3, 8, 8, dtype=torch.uint8),
    "float tensor": torch.zeros(3, 8, 8),
    "PIL I;16": Image.fromarray(np.arange(64, dtype=np.uint16).reshape(8, 8) * 500),
}


@pytest.mark.parametrize("name", list(BAD))
def test_check_image_refuses_what_to_pixels_refuses_with_the_same_error(name):
    with pytest.raises(vc.VitcamError) as rule:
        to_pixels(BAD[name])
    with pytest.raises(vc.VitcamError) as check:
        check_image(BAD[name])
    assert type(check.value) is type(rule.value) and str(check.value) == str(rule.value)


@pytest.mark.parametrize("name", list(GOOD))
def test_check_image_takes_what_to_pixels_takes_without_a_warning(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_image(GOOD[name])


def test_a_float_tensor_with_a_processor_is_refused_as_prepare_input_refuses_it():
    with pytest.raises(vc.TraceError, match=r"^processor: given with a float tensor image"):
        check_image(torch.zeros(3, 8, 8), processor=object())
