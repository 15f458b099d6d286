"""LLaVA-NeXT / LLaVA-OneVision layouts against the models' own packing (``pack_image_features``): the
projector is replaced by a marker writing (crop, patch) into each vector, the newline parameter gets its own
flag, and the LM's ``inputs_embeds`` are read back position by position."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vlm_marks import Marker, lm_inputs, tiny_llama, zero_text  # noqa: E402

from vitcam_nb.adapters.vlm_layouts import (  # noqa: E402
    LLAVA_NEXT_ANATOMY,
    LLAVA_ONEVISION_ANATOMY,
    llava_next_layout,
    llava_onevision_layout,
)
from vitcam_nb.core.errors import ArgumentError  # noqa: E402

IMG_ID, TILE, PATCH = 5, 32, 8
SIDE = TILE // PATCH
PINPOINTS = [[32, 64], [64, 32], [64, 64], [32, 96], [96, 96]]


def make(kind: str, **extra):
    from transformers import (
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        SiglipVisionConfig,
    )

    # LLaVA-NeXT uses a CLIP tower (CLS dropped, 'default'), OneVision a SigLIP one (no CLS, 'full')
    vc_cls = CLIPVisionConfig if kind == "next" else SiglipVisionConfig
    vc = vc_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                image_size=TILE, patch_size=PATCH)
    cfg_cls, model_cls = ((LlavaNextConfig, LlavaNextForConditionalGeneration) if kind == "next" else
                          (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration))
    cfg = cfg_cls(vision_config=vc, text_config=tiny_llama(), image_grid_pinpoints=PINPOINTS,
                  image_token_index=IMG_ID, **extra)
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    model.model.multi_modal_projector = Marker(32)
    with torch.no_grad():
        model.model.image_newline.zero_()
        model.model.image_newline[0] = -1.0
    zero_text(model)
    return model


def n_tokens(model, layout_fn, image_size, **kw) -> int:
    """The image-token count the layout packs, read from its own mismatch error (a wrong count raises)."""
    with pytest.raises(ArgumentError, match="image tokens") as err:
        layout_fn(model.config, np.array([1, IMG_ID, 2]), image_size, **kw)
    return int(str(err.value).split("packs ")[1])


# more crops than any pinpoint needs (96x96: 9 + the base): the model keeps the first as many as its own
# image_size_to_num_patches says, so the crop count is the model's, not the layout's
CROPS = 10


def processor_count(kind: str, image_size, var: str = "anyres_max_9") -> int:
    """The image tokens the family's processor writes into the prompt for one image (its own best-fit choice
    and unpadded-feature count), which the layout must match."""
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    ph, pw = select_best_resolution(list(image_size), PINPOINTS)
    if kind == "next":
        unpadded, newlines = LlavaNextProcessor._get_unpadded_features(None, *image_size, SIDE, SIDE, ph // TILE,
                                                                      pw // TILE)
    else:
        me = SimpleNamespace(vision_aspect_ratio=var)
        unpadded, newlines = LlavaOnevisionProcessor._get_unpadded_features(me, *image_size, SIDE, SIDE,
                                                                           ph // TILE, pw // TILE)
    return SIDE * SIDE + unpadded + newlines


def run(model, layout_fn, image_size, **kw):
    """The layout of a prompt with text around the image, and the LM inputs the model built for it (the model
    itself raises if the prompt's image-token count is not what its packing produced)."""
    ids = np.concatenate([[1, 2, 3], np.full(n_tokens(model, layout_fn, image_size, **kw), IMG_ID), [4, 6]])
    layout = layout_fn(model.config, ids, image_size, **kw)
    pv = torch.randn(1, CROPS, 3, TILE, TILE)
    emb = lm_inputs(model, model.model.language_model, input_ids=torch.from_numpy(ids)[None], pixel_values=pv,
                    image_sizes=torch.tensor([list(image_size)]))
    return ids, layout, emb.numpy()


@pytest.mark.parametrize("image_size", [(40, 90), (90, 40), (50, 50), (30, 100)])
def test_llava_next_marks_land_where_the_layout_says(image_size):
    model = make("next")
    ids, lay, emb = run(model, llava_next_layout, image_size)
    flag = emb[:, 0]
    assert np.array_equal(np.nonzero(flag == 1)[0], lay.positions)
    assert np.array_equal(np.nonzero(flag == -1)[0], lay.dropped_positions["newline"])
    assert lay.dropped["newline"] == lay.dropped_positions["newline"].size > 0
    assert lay.positions.size + lay.dropped["newline"] == processor_count("next", image_size)
    crop, patch = emb[lay.positions, 1].astype(int), emb[lay.positions, 2].astype(int)
    # crop k of the processor's row-major crops is tile k of the layout (tile 0 the base view)
    assert np.array_equal(crop, lay.tile_of)
    assert np.array_equal(patch, lay.rows * SIDE + lay.cols)
    assert lay.description.startswith("LLaVA-NeXT any-res: base 4x4 + ")
    assert f"{lay.dropped['newline']} newline tokens dropped" in lay.description
    # every tile's cells are distinct, and the crops (tiles group) cover the whole image once padding is undone
    assert len({(t, r, c) for t, r, c in zip(lay.tile_of, lay.rows, lay.cols)}) == lay.positions.size
    maps = lay.on_image(emb[lay.positions, 2], image_size)
    assert set(maps) == {"base", "tiles"} and not np.isnan(maps["tiles"]).any() and not np.isnan(maps["base"]).any()


def test_llava_next_unpadding_cuts_the_letterbox_rows():
    # by hand: 40x90 fits 96x96 best (scale 96/90 keeps all 3600 px), so 3x3 crops = a 12x12 cell grid; the
    # image fills round(40*12/90) = 5 rows, padding (12-5)//2 = 3 is cut each side: rows 3..8 kept (6 rows)
    model = make("next")
    _, lay, _ = run(model, llava_next_layout, (40, 90))
    assert "3x3 tiles of 4x4, unpadded to 6x12 (72 padding cells cut)" in lay.description
    assert lay.dropped == {"newline": 6}
    stitched = [(int(t) - 1) // 3 * SIDE + int(r) for t, r in zip(lay.tile_of, lay.rows) if t > 0]
    assert sorted(set(stitched)) == [3, 4, 5, 6, 7, 8]
    assert lay.tiles[1].box == pytest.approx((-0.5, 0.0, 1 / 6, 1 / 3))
    assert lay.tiles[-1].box == pytest.approx((5 / 6, 2 / 3, 9 / 6, 1.0))


@pytest.mark.parametrize(("image_size", "var"), [((40, 90), "anyres_max_9"), ((90, 90), "anyres_max_9"),
                                                  ((90, 90), "anyres_max_1"), ((40, 100), "anyres_max_1")])
def test_llava_onevision_marks_land_where_the_layout_says(image_size, var):
    model = make("ov", vision_aspect_ratio=var)
    ids, lay, emb = run(model, llava_onevision_layout, image_size)
    flag = emb[:, 0]
    assert np.allclose(flag[lay.positions], 1.0)
    assert np.array_equal(np.nonzero(np.isclose(flag, -1))[0], lay.dropped_positions["newline"])
    assert np.count_nonzero(np.abs(flag) > 0.5) == lay.positions.size + lay.dropped["newline"]
    assert lay.positions.size + lay.dropped["newline"] == processor_count("ov", image_size, var)
    base = lay.tile_of == 0
    assert np.array_equal(emb[lay.positions[base], 1], np.zeros(base.sum()))
    assert np.array_equal(emb[lay.positions[base], 2].astype(int), lay.rows[base] * SIDE + lay.cols[base])
    if lay.tiles[-1].name == "tiles":  # resampled: marks are blends, so check each token's centre instead
        assert "bilinearly resized" in lay.description
        _check_resampled(model, ids, lay, image_size)
    else:
        assert np.array_equal(emb[lay.positions, 1].astype(int), lay.tile_of)
        assert np.array_equal(emb[lay.positions, 2].astype(int), lay.rows * SIDE + lay.cols)


def _check_resampled(model, ids, lay, image_size):
    """Mark each crop cell with its row and column in the stitched crop grid; bilinear resizing keeps such a
    linear ramp linear (clamped at the border), so each token's mark is where its cell's centre samples."""
    from vitcam_nb.adapters.vlm_layouts.anyres import best_fit_resolution

    _, pw = best_fit_resolution(image_size, PINPOINTS)
    ncol = pw // TILE

    def ramp(x):
        out = torch.zeros(x.shape[:-1] + (32,), dtype=x.dtype)
        out[..., 0] = 1.0
        crop = torch.arange(x.shape[0])[:, None] - 1
        p = torch.arange(x.shape[1])[None, :]
        out[..., 1] = (crop // ncol * SIDE + p // SIDE).to(x.dtype)
        out[..., 2] = (crop % ncol * SIDE + p % SIDE).to(x.dtype)
        return out

    model.model.multi_modal_projector = Marker(32, ramp)
    emb = lm_inputs(model, model.model.language_model, input_ids=torch.from_numpy(ids)[None],
                    pixel_values=torch.randn(1, CROPS, 3, TILE, TILE), image_sizes=torch.tensor([list(image_size)]))
    sel = lay.tile_of == 1
    g_r, g_c = lay.tiles[1].grid
    got_r = emb[lay.positions[sel], 1].numpy().reshape(g_r, g_c)
    got_c = emb[lay.positions[sel], 2].numpy().reshape(g_r, g_c)
    assert np.allclose(got_r, got_r[:, :1]) and np.allclose(got_c, got_c[:1, :])  # rows and columns separate
    # token i of an out-long resize of an in-long unpadded run samples it at (i + 0.5) * in / out - 0.5 (a
    # downscale never reaches the clamp), counted from the first kept cell: a whole number of padding cells
    rr, cc = (int(v) for v in re.search(r"unpadded to (\d+)x(\d+)", lay.description).groups())
    for got, n_in, n_out in ((got_r[:, 0], rr, g_r), (got_c[0], cc, g_c)):
        want = (np.arange(n_out) + 0.5) * n_in / n_out - 0.5
        offset = got - want
        assert np.allclose(offset, offset[0]) and np.isclose(offset[0], round(offset[0])) and offset[0] >= 0


def test_anatomy_paths_resolve():
    for kind, anat in (("next", LLAVA_NEXT_ANATOMY), ("ov", LLAVA_ONEVISION_ANATOMY)):
        model = make(kind)
        assert type(model).__name__ == anat.model_class
        assert len(model.get_submodule(anat.vision_blocks)) == 3
        assert len(model.get_submodule(anat.lm_layers)) == 2
        model.get_submodule(anat.projector)
        assert getattr(model.config, anat.image_token_key) == IMG_ID


def test_bad_inputs_raise():
    model = make("ov")
    with pytest.raises(ArgumentError, match="vision_aspect_ratio"):
        llava_onevision_layout(model.config, np.full(10, IMG_ID), (40, 90), vision_aspect_ratio="pad")
    with pytest.raises(ArgumentError, match="image_size"):
        llava_next_layout(model.config, np.full(10, IMG_ID), (0, 90))


def test_llava_next_two_images_each_with_crops():
    model = make("next")
    sizes = [(40, 90), (90, 40)]
    n = [n_tokens(model, llava_next_layout, s) for s in sizes]
    ids = np.concatenate([[1], np.full(n[0], IMG_ID), [2, 3], np.full(n[1], IMG_ID), [4]])
    emb = lm_inputs(model, model.model.language_model, input_ids=torch.from_numpy(ids)[None],
                    pixel_values=torch.randn(2, CROPS, 3, TILE, TILE), image_sizes=torch.tensor(sizes)).numpy()
    got = [llava_next_layout(model.config, ids, sizes, image_index=k) for k in range(2)]
    assert np.array_equal(np.concatenate([g.positions for g in got]), np.nonzero(emb[:, 0] == 1)[0])
    assert np.array_equal(np.concatenate([g.dropped_positions["newline"] for g in got]),
                          np.nonzero(emb[:, 0] == -1)[0])
    first = int(emb[got[1].positions, 1].min())  # the second image's crops follow the first's 1 + 9 crops
    assert first == 10
    for k, lay in enumerate(got):
        assert np.array_equal(emb[lay.positions, 1].astype(int) - k * first, lay.tile_of)
        assert np.array_equal(emb[lay.positions, 2].astype(int), lay.rows * SIDE + lay.cols)
    assert got[1].description.endswith("image 2 of 2")


def test_llava_onevision_several_images_are_base_views_padded_to_squares():
    from transformers import LlavaOnevisionImageProcessor

    model = make("ov")
    sizes = [(40, 90), (90, 40)]
    ids = np.concatenate([[1], np.full(SIDE * SIDE + 1, IMG_ID), [2], np.full(SIDE * SIDE + 1, IMG_ID), [4]])
    emb = lm_inputs(model, model.model.language_model, input_ids=torch.from_numpy(ids)[None],
                    pixel_values=torch.randn(2, CROPS, 3, TILE, TILE), image_sizes=torch.tensor(sizes),
                    batch_num_images=torch.tensor([2])).numpy()
    got = [llava_onevision_layout(model.config, ids, sizes, image_index=k) for k in range(2)]
    assert np.array_equal(np.concatenate([g.positions for g in got]), np.nonzero(emb[:, 0] == 1)[0])
    assert [g.dropped for g in got] == [{"newline": 1}] * 2
    for k, lay in enumerate(got):
        assert np.all(emb[lay.positions, 1] == k) and [t.name for t in lay.tiles] == ["base"]
        assert np.array_equal(emb[lay.positions, 2].astype(int), lay.rows * SIDE + lay.cols)
    # the box against the processor's own padding: a 40x90 image of 1000s padded to 90x90, shrunk to 32x32
    assert got[0].tiles[0].box == pytest.approx((-25 / 40, 0.0, 65 / 40, 1.0))
    proc = LlavaOnevisionImageProcessor(size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS,
                                        do_rescale=False, do_normalize=False)
    pv = proc(images=[[torch.full((3, 40, 90), 1000.0), torch.full((3, 90, 40), 1000.0)]],
              return_tensors="pt")["pixel_values"]
    image_rows = np.nonzero(pv[0, 0, 0, :, TILE // 2].numpy() > 900)[0]
    top, bottom = got[0].tiles[0].box[0], got[0].tiles[0].box[2]
    want = (np.arange(TILE) + 0.5) / TILE * (bottom - top) + top  # each row's centre as a fraction of the image
    assert np.array_equal(image_rows, np.nonzero((want > 0) & (want < 1))[0])  # rows 9..22: inside the box
