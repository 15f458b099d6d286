"""LLaVA-NeXT and LLaVA-OneVision (issue 55) on tiny random models built in code: the tower runs on every crop
and every crop is kept (a ``crop`` dim, never crop 0 alone); every site's stored gradient equals torch.autograd's
(tower sites on every crop, projector, lm_resid and lm_attn at the image tokens); each crop is the layout tile the
family's own packing code puts it in (marked); bad input is refused by name before any model call."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from vitcam_testing import assert_rel_close

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")

from anyres_cases import (  # noqa: E402
    ANSWER,
    N_TOKENS,
    SIZE,
    TOWER,
    build,
    make,
    pixels,
    prompt,
    target,
    tower_values,
)
from vlm_marks import Marker, lm_inputs  # noqa: E402

TILES = ["base", "tile_r0_c0", "tile_r0_c1", "tile_r1_c0", "tile_r1_c1"]


@pytest.fixture(scope="module", params=["next", "onevision"])
def case(request):
    return build(request.param)


@pytest.fixture(scope="module")
def resampled():
    return build("resampled", TOWER[:2] + ("F6", "lm_resid", "lm_attn"))


# --------------------------------------------------------------------------------------------------
# every crop the tower ran on is kept, in its order


def test_every_crop_the_tower_ran_on_is_kept(case):
    tr = case.trace
    # pixel_values hold 6 rows; the model runs the 5 its image_sizes need (base + 2x2), as its own code slices
    assert tr.sizes["crop"] == 5 and tr.attrs["crops"] == 5
    assert tr["crop_tile"].values.tolist() == TILES
    assert tr["crop_group"].values.tolist() == ["base"] + ["tiles"] * 4
    assert tr["act"].dims[0] == "crop" and tr["grad"].dims[:2] == ("crop", "target")
    assert tr["attn"].dims[0] == "crop" and tr["image"].dims == ("crop", "y", "x", "rgb")
    for var in ("projector", "lm_resid", "lm_attn", "logits"):
        assert "crop" not in tr[var].dims
    assert tr.attrs["vlm_family"] == {"next": "llava_next", "onevision": "llava_onevision"}[case.kind]
    assert tr.attrs["crop_source_size"] == "60x70"


def test_image_is_each_crop_as_the_tower_saw_it(case):
    mean, std = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    x = case.x[0, :5].permute(0, 2, 3, 1).numpy()
    want = np.round(np.clip(x * np.array(std) + np.array(mean), 0, 1) * 255).astype(np.uint8)
    np.testing.assert_array_equal(case.trace["image"].values, want)


def test_scores_are_the_reference(case):
    np.testing.assert_allclose(case.trace["logits"].values, case.scores.numpy(), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# every stored gradient is torch.autograd's


@pytest.mark.parametrize("site", TOWER)
def test_tower_site_gradients_equal_autograd_on_every_crop(case, site):
    for layer in range(3):
        act, grad = tower_values(case.trace, site, layer)
        want_a, want_g = case.acts[(layer, site)], case.grads[(layer, site)]
        assert want_a.shape[0] == 5  # the reference's tower ran on 5 crops too
        for k in range(5):
            assert_rel_close(act[k], want_a[k], f"{case.kind} {site}@{layer} crop {k}")
            assert_rel_close(grad[k], want_g[:, k], f"{case.kind} {site}@{layer} crop {k} grad")
    # a real comparison: every crop's gradient reaches the answer at the first layer
    g = tower_values(case.trace, site, 0)[1]
    assert all(np.abs(g[k]).max() > 0 for k in range(5))


def test_lm_site_gradients_equal_autograd_at_the_image_tokens(case):
    tr, acts, grads = case.trace, case.acts, case.grads
    pos = tr["image_token_pos"].values
    # the newline token after each of the 6 kept cell rows is no image token
    assert pos.size == N_TOKENS[case.kind] - 6 and tr["projector"].attrs["layout_dropped"] == "newline:6"
    rows = np.arange(len(prompt(case.kind)), len(prompt(case.kind)) + len(ANSWER)) - 1
    for layer in range(2):
        assert_rel_close(tr["lm_resid"].values[layer], acts[(layer, "lm_resid")][pos], f"lm_resid@{layer}")
        g = grads[(layer, "lm_resid")][:, pos]
        assert np.abs(g).max() > 1e-3
        assert_rel_close(tr["lm_resid_grad"].values[:, layer], g, f"lm_resid@{layer} grad")
        assert_rel_close(tr["lm_attn"].values[layer], acts[(layer, "lm_attn")][:, rows][:, :, pos], "lm_attn")
        assert_rel_close(tr["lm_attn_grad"].values[:, layer], grads[(layer, "lm_attn")][:, :, rows][:, :, :, pos],
                         f"lm_attn@{layer} grad")
    # the projector's output per image token IS what the LM reads at that position (the model's own packing
    # copies it there), so it equals the reference's LM input there, value and gradient
    assert_rel_close(tr["projector"].values, acts[(0, "lm_resid")][pos], "projector = LM input at image tokens")
    assert_rel_close(tr["projector_grad"].values, grads[(0, "lm_resid")][:, pos], "projector grad")
    # and the reference projector's rows of the crops the kit names (tile -> crop, cell -> row)
    tiles = [s.split(":")[0] for s in tr["projector"].attrs["layout_tiles"].split(";")]
    crop = np.array([TILES.index(tiles[t]) for t in tr["image_token_tile"].values])
    row = tr["image_token_row"].values * 4 + tr["image_token_col"].values
    assert_rel_close(tr["projector_grad"].values, grads[(0, "projector")][:, crop, row], "projector rows")


def test_resampled_onevision_keeps_every_crop_and_its_gradients(resampled):
    tr = resampled.trace
    assert tr["crop_tile"].values.tolist() == ["base"] + ["tiles"] * 4  # one resampled tile
    assert "bilinearly resized to 3x4" in tr["lm_resid"].attrs["layout"]
    # each crop still lies in its own cell of the crop grid
    np.testing.assert_allclose(tr["crop_box_left"].values, [0, 0, 0.5, 0, 0.5])
    for site in ("F1", "F2", "F6"):
        for layer in range(3):
            act, grad = tower_values(tr, site, layer)
            for k in range(5):
                assert_rel_close(grad[k], resampled.grads[(layer, site)][:, k], f"{site}@{layer} crop {k}")
                assert_rel_close(act[k], resampled.acts[(layer, site)][k], f"{site}@{layer} crop {k} act")
    pos = tr["image_token_pos"].values
    assert_rel_close(tr["lm_resid_grad"].values[:, 0], resampled.grads[(0, "lm_resid")][:, pos], "lm_resid grad")


# --------------------------------------------------------------------------------------------------
# each crop is the tile the family's own packing code puts it in


def test_crop_tiles_are_where_the_model_packs_each_crop(case):
    """A marker projector writes (1, crop index, patch index) into each projected vector; the LM's input at each
    stored image token then says which crop and cell the model's pack_image_features put there."""
    tr = case.trace
    model = copy.deepcopy(case.model)
    model.model.multi_modal_projector = Marker(32)
    seq = torch.tensor([prompt(case.kind) + ANSWER])
    emb = lm_inputs(model, model.model.language_model, input_ids=seq, pixel_values=case.x,
                    image_sizes=torch.tensor([SIZE])).numpy()
    tiles = [s.split(":")[0] for s in tr["projector"].attrs["layout_tiles"].split(";")]
    names = tr["crop_tile"].values
    for i, p in enumerate(tr["image_token_pos"].values):
        flag, crop, patch = emb[p, :3]
        assert flag == 1
        assert names[int(crop)] == tiles[tr["image_token_tile"].values[i]]
        assert patch == tr["image_token_row"].values[i] * 4 + tr["image_token_col"].values[i]


def test_pass_over_crops_never_gives_one_batch_row(case):
    from vitcam_nb.capture.passes import run_pass
    from vitcam_nb.capture.plan import TracePlan

    plan = TracePlan.for_trace(case.model, target(case.kind), sites=["F1"], layers=[0])
    run = run_pass(plan, case.x)
    assert run.crops == 5 and run.whole().acts[(0, "F1")].shape[0] == 5
    with pytest.raises(vc.TraceError, match="ran on 5 crops of one image"):
        run.image(0)


# --------------------------------------------------------------------------------------------------
# bad input is refused by name, before the model runs


@pytest.fixture
def counted():
    model = make("next")
    calls = []
    model.model.vision_tower.register_forward_pre_hook(lambda *_: calls.append(1))
    return model, calls


@pytest.mark.parametrize("image, match", [
    (np.zeros((60, 70, 3), np.uint8), r"image: got ndarray; llava_next tiles the image"),
    (torch.zeros(2, 5, 3, 32, 32), r"image: got a tensor of shape \(2, 5, 3, 32, 32\)"),
    (torch.zeros(1, 5, 3, 64, 64), r"image: crops of 64x64 px, but the tower takes 32x32"),
    (torch.zeros(1, 5, 3, 32, 32, dtype=torch.int64), r"image: got a torch.int64 tensor"),
    (torch.zeros(1, 4, 3, 32, 32), r"image: holds 4 crops, but the model runs 5 for this image"),
    (torch.full((1, 5, 3, 32, 32), float("nan")), r"image: contains NaN"),
])
def test_bad_crops_are_refused_before_the_model_runs(counted, image, match):
    model, calls = counted
    with pytest.raises(vc.TraceError, match=match):
        vc.trace(model, image, targets=target("next"), sites=["F1"])
    assert not calls


def test_missing_image_sizes_and_processor_are_refused(counted):
    model, calls = counted
    no_sizes = vc.targets.answer(input_ids=prompt("next"), answer_ids=ANSWER)
    with pytest.raises(vc.TraceError, match="model_kwargs: LlavaNextForConditionalGeneration needs the processor's "
                                            "image_sizes"):
        vc.trace(model, pixels(), targets=no_sizes, sites=["F1"])
    with pytest.raises(vc.TraceError, match="model_kwargs: image_sizes must be one image's"):
        vc.trace(model, pixels(), targets=target("next", image_sizes=[[60, 70], [60, 70]]), sites=["F1"])
    with pytest.raises(vc.TraceError, match="processor: llava_next takes the processor's pixel_values as given"):
        vc.trace(model, pixels(), targets=target("next"), sites=["F1"], processor=object())
    assert not calls


def test_projector_of_a_resampled_grid_is_refused_by_name():
    model = make("resampled")
    calls = []
    model.model.vision_tower.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(vc.TraceError, match=r"sites: 'projector' .* layout tile 'tiles' is not one crop's projector "
                                            r"rows \(4 crops make it"):
        vc.trace(model, pixels(), targets=target("resampled"), sites=["F1", "projector"])
    assert not calls


def test_a_tower_of_another_kind_is_refused_by_name():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    v = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         image_size=32, patch_size=8)
    t = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64)
    model = LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(
        vision_config=v, text_config=t, image_token_id=63, image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]]))
    with pytest.raises(vc.TraceError, match="the llava_onevision row reads a siglip_vision_model tower"):
        vc.trace(model, pixels(), targets=target("onevision"), sites=["F1"])


def test_vision_aspect_ratio_the_model_ignores_is_refused():
    # transformers 5's OneVision forward takes vision_aspect_ratio but packs with its config's value
    with pytest.raises(vc.TraceError, match="model_kwargs: vision_aspect_ratio='anyres_max_4', but the model packs"):
        vc.trace(make("onevision"), pixels(), targets=target("onevision", vision_aspect_ratio="anyres_max_4"),
                 sites=["F1"])


def test_lm_sites_alone_keep_every_crops_image(case):
    tr = vc.trace(case.model, case.x, targets=target(case.kind), sites=["lm_resid"])
    assert tr["image"].dims == ("crop", "y", "x", "rgb") and tr.sizes["crop"] == 5 and "act" not in tr
    np.testing.assert_array_equal(tr["image"].values, case.trace["image"].values)
    assert_rel_close(tr["lm_resid_grad"].values, case.trace["lm_resid_grad"].values, "lm_resid alone")
