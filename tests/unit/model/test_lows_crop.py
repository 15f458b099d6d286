"""An image the eval transform crops says so: a warning of the kit's own class when the trace is made, the crop box in
the trace's preprocessing attrs and a line of the checklist naming the original size and the box."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb.preprocess import InputCropWarning, prepare_input


def _model(crop_pct: float, crop_mode: str = "center") -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3)
    model.pretrained_cfg = {"input_size": (3, 32, 32), "crop_pct": crop_pct, "crop_mode": crop_mode,
                            "interpolation": "bilinear", "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    return model


def _expected_box(h: int, w: int, size: int, crop_pct: float) -> list[float]:
    """timm's centre eval transform by hand: the shorter side to floor(size / crop_pct) (the longer side
    truncated as torchvision's Resize does), then a centred size x size crop at round((side - size) / 2)."""
    short = math.floor(size / crop_pct)
    if h <= w:
        rh, rw = short, int(short * w / h)
    else:
        rh, rw = int(short * h / w), short
    top, left = round((rh - size) / 2), round((rw - size) / 2)
    sy, sx = h / rh, w / rw
    return [left * sx, top * sy, (left + size) * sx, (top + size) * sy]


def test_a_300x200_image_centre_cropped_warns_and_records_its_box():
    image = np.random.default_rng(0).integers(0, 256, (200, 300, 3), dtype=np.uint8)  # 300 wide, 200 high
    with pytest.warns(InputCropWarning, match=r"200x300 \(HxW\).*centre-cropped \(timm crop_pct 0.9") as caught:
        prepared = prepare_input(_model(0.9), image)
    assert caught[0].filename == __file__  # points at the user's line
    facts = prepared.preprocessing
    assert facts["original_size"] == [200, 300] and facts["cropped"] is True
    np.testing.assert_allclose(facts["crop_box"], _expected_box(200, 300, 32, 0.9), atol=0.006)
    x0, y0, x1, y1 = _expected_box(200, 300, 32, 0.9)
    assert f"({(x1 - x0) * (y1 - y0) / (300 * 200):.0%} of the image)" in str(caught[0].message)


def test_the_checklist_states_the_original_size_and_the_box():
    image = np.random.default_rng(0).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    with pytest.warns(InputCropWarning):
        tr = vc.trace(_model(0.9), image, targets=[0], sites=["F1"])
    text = vc.Recipe(site="F1").checklist(tr)["model and input"]["resize and crop"]
    x0, y0, x1, y1 = _expected_box(200, 300, 32, 0.9)
    assert text.startswith("original 200x300 (HxW), resized 200x300 -> 35x52, centre-cropped to 32x32")
    assert f"the model sees only the box x {round(x0, 2):g}..{round(x1, 2):g}, y {round(y0, 2):g}..{round(y1, 2):g}" \
        in text
    assert json.loads(tr.attrs["preprocessing"])["crop_box"] == [round(v, 2) for v in (x0, y0, x1, y1)]


def test_a_squashed_image_warns_that_its_aspect_changed_and_an_exact_fit_is_silent():
    image = np.zeros((20, 40, 3), np.uint8)
    with pytest.warns(InputCropWarning, match="stretched"):
        facts = prepare_input(_model(1.0, "squash"), image).preprocessing
    assert facts["stretched"] is True and facts["cropped"] is False and facts["crop_box"] == [0, 0, 40, 20]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = vc.trace(_model(1.0), np.zeros((32, 32, 3), np.uint8), targets=[0], sites=["F1"])
    assert vc.Recipe(site="F1").checklist(tr)["model and input"]["resize and crop"] == (
        "original 32x32 (HxW), used at its size; nothing cropped")


def test_a_trace_without_recorded_geometry_keeps_its_checklist():
    tr = vc.trace(_model(1.0), torch.zeros(1, 3, 32, 32), targets=[0], sites=["F1"])  # a tensor used as given
    assert "resize and crop" not in vc.Recipe(site="F1").checklist(tr)["model and input"]
    tr.attrs["preprocessing"] = "<b>not json</b>"
    assert "resize and crop" not in vc.Recipe(site="F1").checklist(tr)["model and input"]
