"""vc.ambiguity with spatial reconstruction open (issue #33, part 4): upsample and normalize open by default, the
maps compared on the image grid (each one exactly vc.cam's map; "none" as blocks), a user's space used, the
token-grid path unchanged while upsample is stated, and text_tokens open on a cross-attention trace."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage
from vitcam_testing import make_input, make_model

import vitcam_nb as vc
from vitcam_nb.core.errors import DegenerateMapWarning


@pytest.fixture(scope="module")
def tr():
    return vc.trace(make_model("vit"), make_input("vit"))


@pytest.fixture(scope="module")
def shapes():
    img, _label, _mask = vc.sample_image("shapes", 0, with_mask=True)
    return vc.trace(vc.load_model("shapes-vit"), img)


def _cam(trace, recipe):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateMapWarning)
        return vc.cam(trace, recipe).values.astype(np.float64)


def _on_image(trace, recipe):
    """vc.cam's map of ``recipe`` on the image grid; "none" repeated over each patch by hand (np.repeat)."""
    values = _cam(trace, recipe)
    if recipe.upsample != "none":
        return values
    h, w = trace["image"].shape[:2]
    return np.repeat(np.repeat(values, h // values.shape[0], axis=0), w // values.shape[1], axis=1)


def test_spatial_reconstruction_share_matches_an_independent_anova(shapes):
    # Only relu and the two spatial fields are open (upsample x normalize x relu = 8 cells, 8 distinct maps).
    reported = dict(site="F1", layer=-1, weighting="gradcam", target="logit", weight_tokens="patch")
    amb = vc.ambiguity(shapes, reported=reported)
    assert amb.open == ["upsample", "relu", "normalize"] and amb.maps.attrs["grid"] == "image grid"
    assert amb.sensitivity.design.startswith("exact") and len(amb.recipes) == 8
    ups, relus, norms = amb.space["upsample"], amb.space["relu"], amb.space["normalize"]
    assert ups == ("none", "bilinear") and norms == ("minmax", "max")
    y = np.array([[[_on_image(shapes, vc.Recipe(**reported, upsample=u, relu=r, normalize=n)).ravel()
                    for n in norms] for r in relus] for u in ups])
    grand = y.mean(axis=(0, 1, 2))
    total = ((y - grand) ** 2).sum(-1).mean()
    expected = {}
    for axis, field in enumerate(["upsample", "relu", "normalize"]):
        others = tuple(a for a in range(3) if a != axis)
        expected[field] = ((y.mean(axis=others) - grand) ** 2).sum(-1).mean() / total
        assert amb.sensitivity.fields[field] == pytest.approx(expected[field], abs=1e-6), field
    # the category joins upsample and normalize: its levels are their 4 joint values
    joint = y.mean(axis=1)  # (upsample, normalize, pixel)
    spatial = ((joint - grand) ** 2).sum(-1).mean() / total
    assert amb.sensitivity.categories["spatial reconstruction"] == pytest.approx(spatial, abs=1e-6)
    assert amb.sensitivity.categories["spatial reconstruction"] > 0.001
    assert expected["upsample"] > 0 and expected["normalize"] > 0
    assert amb.spread.std.values.ravel() == pytest.approx(y.reshape(8, -1).std(axis=0), abs=1e-6)
    assert amb.to_dict()["grid"] == "image grid" and "compared on the image grid" in amb.report()


def test_image_grid_maps_are_each_recipes_vc_cam(tr):
    # Sites open, so the attention (F2) recipes that share their rows in the analysis are checked too.
    amb = vc.ambiguity(tr, reported=dict(layer=-1, weighting="gradcam", target="logit", relu="after"))
    assert amb.maps.attrs["grid"] == "image grid" and amb.maps.shape[1:] == (32, 32)
    assert {r.upsample for r in amb.recipes} == {"none", "bilinear"} and any(r.site == "F2" for r in amb.recipes)
    for recipe, values in zip(amb.recipes, amb.maps.values):
        np.testing.assert_allclose(values, _on_image(tr, recipe), rtol=0, atol=1e-6, err_msg=recipe.id)
    # fused blocks (max fusion is not linear, so not upsampled from the token map) and a rollout
    amb = vc.ambiguity(tr, reported=dict(site="F2", weighting="gradcam", target="logit", relu="after",
                                         attn_rows="cls", normalize="minmax", weight_tokens="patch"),
                       space={"layer_fusion": ["max", "grad_rollout"], "upsample": ["none", "bicubic"],
                              "heads": ["max"], "layer": ["all"]})
    assert {(r.layer_fusion, r.upsample) for r in amb.recipes} == {
        (f, u) for f in ("max", "grad_rollout") for u in ("none", "bicubic")}
    for recipe, values in zip(amb.recipes, amb.maps.values):
        np.testing.assert_allclose(values, _on_image(tr, recipe), rtol=0, atol=1e-6, err_msg=recipe.id)


def test_a_large_image_is_compared_on_its_own_pixels_at_a_stride():
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=96, patch_size=16, depth=2)
    big = vc.trace(model, np.random.default_rng(3).integers(0, 256, (96, 96, 3), np.uint8))
    mask = np.zeros((96, 96), bool)
    mask[10:40, 50:90] = True
    reported = dict(site="F4", layer=1, weighting="gradcam", target="logit", relu="after")
    amb = vc.ambiguity(big, reported=reported, mask=mask)
    # 96 x 96 = 9216 pixels > 64 x 64: every 2nd pixel from 1 (48 x 48 = 2304 samples, 8 per side of a patch)
    assert amb.maps.attrs["stride"] == 2 and amb.maps.shape[1:] == (48, 48)
    for recipe, values in zip(amb.recipes, amb.maps.values):
        np.testing.assert_allclose(values, _on_image(big, recipe)[1::2, 1::2], rtol=0, atol=1e-6, err_msg=recipe.id)
    # the pointing game reads the mask at the same pixels: each map's peak against mask[1::2, 1::2]
    hit = ndimage.distance_transform_edt(~mask[1::2, 1::2]) <= 15.0 * 48 / 224
    shares = []
    for m in amb.maps.values:
        peaks = m == m.max()
        shares.append((peaks & hit).sum() / peaks.sum() if np.ptp(m) > 0 else 0.0)
    assert amb.localises == pytest.approx(np.mean(shares))


def test_a_space_the_user_passes_is_used(tr):
    space = {"upsample": ["bicubic", "nearest", "none"], "normalize": ["max"]}
    amb = vc.ambiguity(tr, reported=dict(site="F1", layer=0, weighting="gradcam", target="logit",
                                         weight_tokens="patch", relu="none"), space=space)
    assert [r.upsample for r in amb.recipes] == ["bicubic", "nearest", "none"]
    assert {r.normalize for r in amb.recipes} == {"max"} and amb.space["normalize"] == ("max",)
    maps = amb.maps.values
    # on the integer patch grid (8 px patches), "none" shown as blocks is "nearest": the same picture
    np.testing.assert_array_equal(maps[1], maps[2])
    assert not np.allclose(maps[0], maps[1])
    assert amb.sensitivity.fields["upsample"] > 0
    # a single user value of upsample keeps the token grid; the value is not open, so it is in no recipe's choice
    one = vc.ambiguity(tr, reported=dict(site="F1", layer=0, weighting="gradcam"), space={"upsample": ["bicubic"]})
    assert one.maps.attrs["grid"] == "token grid" and one.space["upsample"] == ("bicubic",)


def test_a_stated_upsample_keeps_the_token_grid_maps(tr):
    reported = dict(site="F1", layer=0, weighting="gradcam", normalize="minmax")
    stated = vc.ambiguity(tr, reported={**reported, "upsample": "bilinear"})
    none = vc.ambiguity(tr, reported={**reported, "upsample": "none"})
    assert stated.maps.attrs["grid"] == none.maps.attrs["grid"] == "token grid"
    assert stated.maps.shape[1:] == (4, 4)
    np.testing.assert_array_equal(stated.maps.values, none.maps.values)
    assert stated.sensitivity.fields == none.sensitivity.fields
    for recipe, values in zip(none.recipes, none.maps.values):
        assert np.array_equal(values, _cam(tr, recipe).astype(np.float32))


def test_spatial_fields_are_refused_when_reported(tr):
    with pytest.raises(ValueError, match="space: 'upsample' is reported"):
        vc.ambiguity(tr, reported={"upsample": "none"}, space={"upsample": ["none", "bilinear"]})
    with pytest.raises(ValueError, match="space: normalize needs a non-empty list"):
        vc.ambiguity(tr, reported={"site": "F1"}, space={"normalize": "minmax"})
    with pytest.raises(ValueError, match=r"space: upsample takes \['bilinear', 'bicubic', 'nearest', 'none'\], "
                                         r"got \['lanczos'\]"):
        vc.ambiguity(tr, reported={"site": "F1"}, space={"upsample": ["bilinear", "lanczos"]})


def _blip_module():
    path = Path(__file__).resolve().parents[1] / "model" / "test_blip.py"
    spec = importlib.util.spec_from_file_location("_ambiguity_blip_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # skips (importorskip) when transformers is missing
    return module


def test_text_tokens_open_on_a_cross_attention_trace():
    pytest.importorskip("transformers")
    blip = _blip_module()
    tr = vc.trace(blip.make_blip(), blip.make_x(), targets=blip.itm_target(), sites=["F1", "xattn"])
    reported = dict(site="xattn", layer=1, weighting="layercam", heads="mean_then_relu", target="logit",
                    relu="after", upsample="none", normalize="minmax")
    amb = vc.ambiguity(tr, reported=reported)
    assert amb.open == ["text_tokens"] and amb.space["text_tokens"] == ("all", "cls")
    assert [r.text_tokens for r in amb.recipes] == ["all", "cls"]
    for recipe, values in zip(amb.recipes, amb.maps.values):
        assert np.array_equal(values, _cam(tr, recipe).astype(np.float32))
    assert not np.array_equal(amb.maps.values[0], amb.maps.values[1])
    assert amb.sensitivity.categories["token handling"] == pytest.approx(1.0)
    # off cross-attention the field does not apply: the default leaves it at "all"
    vit = vc.ambiguity(tr, reported={**reported, "site": "F1", "weighting": "gradcam", "heads": "channels"})
    assert "text_tokens" not in vit.space
