"""Issue #17, "images mean what they look like": one input rule (vitcam_nb.preprocess.to_pixels) for every
entry point, PIL modes and non-8-bit pixels rescaled with a warning naming the rule, padded grids cropped not
stretched, and maps refused on traces that cannot give them (sliced tokens, gradients missing)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from vitcam_testing import assert_unchanged, make_model, snapshot

import vitcam_nb as vc
from vitcam_nb import evaluate as ev
from vitcam_nb.preprocess import to_pixels

MODEL = make_model("vit")
RGB = np.random.default_rng(4).integers(0, 256, (32, 32, 3), dtype=np.uint8)
MODES = ["1", "L", "LA", "P", "I", "I;16", "F", "RGBA", "CMYK", "RGB"]


def test_a_16_bit_scan_is_rescaled_from_its_range_with_a_warning_naming_the_rule():
    ct = np.linspace(1600, 3696, 32 * 32).reshape(32, 32).astype(np.uint16)
    with pytest.warns(UserWarning, match=r"image: PIL I;16 image values 1600..3696 .* rescaled linearly from their "
                                         r"min..max to 0..255"):
        pixels, how = to_pixels(Image.fromarray(ct))
    expected = np.round((ct - 1600.0) / (3696 - 1600) * 255).astype(np.uint8)
    np.testing.assert_array_equal(pixels[..., 0], expected)
    assert "rescaled linearly" in how["pixel_rule"]


def test_floats_in_0_1_are_times_255_without_a_warning_wherever_they_come_from():
    values = np.random.default_rng(0).random((32, 32)).astype(np.float32)
    expected = np.round(values.astype(np.float64) * 255).astype(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for image in (Image.fromarray(values), values, np.repeat(values[..., None], 3, -1)):
            np.testing.assert_array_equal(to_pixels(image)[0][..., 1], expected)


@pytest.mark.parametrize("mode", MODES)
def test_every_pil_mode_gives_the_rgb_pixels_pil_itself_gives(mode):
    base = Image.fromarray(RGB)
    image = base.convert(mode) if mode not in ("I", "I;16", "F") else base.convert("L").convert(mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pixels, _ = to_pixels(image)
    if mode in ("I", "I;16", "F"):  # numbers 0..255 from an 8-bit grey image: read back as that grey
        want = np.asarray(base.convert("L"))
        got = pixels[..., 0]
        if mode == "F":  # floats beyond 0..1 are rescaled from their own range
            want = np.round((want - want.min()) / (want.max() - want.min()) * 255)
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_array_equal(pixels, np.asarray(image.convert("RGB")))


def test_one_rule_for_trace_trace_many_and_deletion(tmp_path):
    chw = torch.from_numpy(np.moveaxis(RGB, -1, 0).copy())
    grey = RGB[..., 0]
    a = vc.trace(MODEL, RGB, targets="top1", sites=["F1"])
    b = vc.trace(MODEL, chw, targets="top1", sites=["F1"])  # uint8 CHW tensor, refused by 0.1's trace
    assert a.attrs["input_sha256"] == b.attrs["input_sha256"]
    c = vc.trace(MODEL, grey, targets="top1", sites=["F1"])  # numpy HxW, refused by 0.1's trace
    d = vc.trace(MODEL, Image.fromarray(grey), targets="top1", sites=["F1"])
    assert c.attrs["input_sha256"] == d.attrs["input_sha256"]
    store = vc.open_traces(vc.trace_many(MODEL, [chw, grey], tmp_path / "s.zarr", targets="top1", sites=["F1"],
                                         progress=False))
    assert [str(v) for v in store["input_sha256"].values] == [a.attrs["input_sha256"], c.attrs["input_sha256"]]
    saliency = np.ones((32, 32))
    saliency[:8, :8] = 2
    runs = [ev.deletion(MODEL, image, saliency, patch_size=8, progress=False) for image in (RGB, Image.fromarray(RGB))]
    np.testing.assert_array_equal(runs[0].values, runs[1].values)  # PIL refused by 0.1's deletion


def test_refusals_name_the_image():
    for bad, match in ((np.zeros((8, 8, 3), bool), "no pixel meaning"), (np.zeros((1, 3, 8, 8), np.uint8), "HxW"),
                       (np.zeros((8, 8, 2), np.uint8), "HxW"), (torch.zeros(8, 8, 3), "float tensor of shape"),
                       ("x.png", "expected a PIL image")):
        with pytest.raises((vc.TraceError, TypeError), match=f"^image: .*{match}"):
            vc.trace(MODEL, bad)


def test_a_padded_grid_is_cropped_not_stretched():
    model = make_model("vit", dynamic_img_size=True, dynamic_img_pad=True)
    tr = vc.trace(model, torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0)), targets="top1")
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"], tr.attrs["dynamic_img_pad"]) == (4, 4, 1)
    grid = vc.cam(tr, vc.Recipe(upsample="none", normalize="none")).values
    pixels = vc.cam(tr, vc.Recipe(upsample="nearest", normalize="none")).values
    # 4 patches of 8 px cover 32 px, the image is the first 28: the last patch shows 4 px, not 7.
    np.testing.assert_allclose(pixels, np.kron(grid, np.ones((8, 8)))[:28, :28], rtol=1e-6)


def test_maps_of_a_token_sliced_trace_are_refused():
    tr = vc.trace(MODEL, RGB, targets="top1")
    with pytest.raises(vc.TraceError, match=r"^trace: it holds 9 of the 4x4 = 16 patch tokens"):
        vc.cam(tr.isel(token=slice(0, 10)), vc.Recipe())


def test_a_trace_without_gradients_refuses_gradient_weightings_and_serves_eigencam():
    tr = vc.trace(MODEL, RGB, targets="top1")
    bare = tr.drop_vars(["grad", "attn_grad"])
    with pytest.raises(vc.RecipeError, match=r"^weighting: 'gradcam' reads gradients and this trace has no 'grad'"):
        vc.cam(bare, vc.Recipe())
    np.testing.assert_array_equal(vc.cam(bare, vc.Recipe(weighting="eigencam")).values,
                                  vc.cam(tr, vc.Recipe(weighting="eigencam")).values)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(MODES), h=st.integers(1, 48), w=st.integers(1, 48), seed=st.integers(0, 3))
def test_fuzzed_pil_images_give_a_trace_or_a_named_error(mode, h, w, seed):
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    image = Image.fromarray(arr)
    image = image.convert("L").convert(mode) if mode in ("I", "I;16", "F") else image.convert(mode)
    before = snapshot(MODEL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = vc.trace(MODEL, image, targets="top1", sites=["F1"])
    assert np.isfinite(tr["grad"].values).all() and tr["image"].shape == (32, 32, 3)
    assert_unchanged(before, MODEL)
