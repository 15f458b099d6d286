"""Idefics3 / SmolVLM layouts against the families' own path: the real image processor splits an image whose
pixels hold their own (y, x); the prompt is built by the processor's own ``replace_image_token``; the tower's
output is replaced (forward hook) by each patch's (y, x), read off its top-left pixel; the connector's own pixel
shuffle runs, its projection is replaced by a marker unpacking the shuffled channels; the LM's
``inputs_embeds`` are read back."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vlm_marks import Marker, lm_inputs, tiny_llama, zero_text  # noqa: E402

from vitcam_nb.adapters.vlm_layouts.idefics import (  # noqa: E402
    IDEFICS3_ANATOMY,
    SMOLVLM_ANATOMY,
    idefics3_layout,
    shuffle_patches,
    smolvlm_layout,
)
from vitcam_nb.core.errors import ArgumentError  # noqa: E402

IMG, W, TILE, PATCH, S = 5, 32, 32, 4, 2
G = TILE // PATCH // S  # 4x4 tokens per tile
VOCAB = {"<image>": IMG, "<fake_token_around_image>": 6, "<global-img>": 7, "\n": 8}


def make(kind: str):
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    cfg_cls, cls = ((Idefics3Config, Idefics3ForConditionalGeneration) if kind == "idefics3" else
                    (SmolVLMConfig, SmolVLMForConditionalGeneration))
    cfg = cfg_cls(vision_config=dict(hidden_size=W, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                     image_size=TILE, patch_size=PATCH), text_config=tiny_llama(),
                  image_token_id=IMG, scale_factor=S)
    torch.manual_seed(0)
    return cls(cfg).eval()


def prompt_ids(kind: str, rows, cols) -> np.ndarray:
    """The prompt's ids from the family's own template (``replace_image_token``), tokenized one special token or
    character at a time (``<row_r_col_c>`` tokens get ids from 20 on)."""
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
    from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor

    me = SimpleNamespace(fake_image_token="<fake_token_around_image>", global_image_tag="<global-img>",
                         global_image_token="<global-img>", image_token="<image>", image_seq_len=G * G)
    fn = (Idefics3Processor if kind == "idefics3" else SmolVLMProcessor).replace_image_token
    text = "Q:" + "".join(fn(me, {"rows": [rows], "cols": [cols]}, k) + " and " for k in range(len(rows))) + "?"
    ids = []
    for tok in re.findall(r"<[^>]+>|.", text, flags=re.S):
        m = re.fullmatch(r"<row_(\d)_col_(\d)>", tok)
        ids.append(VOCAB.get(tok, 20 + 6 * int(m[1]) + int(m[2]) if m else 9))
    return np.asarray(ids)


def run(kind: str, sizes, split: bool = True):
    from transformers import Idefics3ImageProcessor, SmolVLMImageProcessor

    model = make(kind)
    zero_text(model)

    def mark(_mod, _args, kwargs, out):  # each patch's (y, x, 1) from its top-left pixel, raster over the tile
        pv = kwargs["pixel_values"]
        m = torch.zeros(out.last_hidden_state.shape)
        m[..., 0] = 1.0
        m[..., 1] = pv[:, 0, ::PATCH, ::PATCH].flatten(1)
        m[..., 2] = pv[:, 1, ::PATCH, ::PATCH].flatten(1)
        out.last_hidden_state = m
        return out

    def unpack(x):  # the shuffled (n, G*G, S*S*W) channels back to each concatenated patch's (y, x)
        blocks = x.reshape(*x.shape[:-1], S * S, W)
        out = torch.zeros(*x.shape[:-1], W)
        out[..., 0] = 1.0
        out[..., 1:1 + S * S], out[..., 1 + S * S:1 + 2 * S * S] = blocks[..., 1], blocks[..., 2]
        return out

    model.model.vision_model.register_forward_hook(mark, with_kwargs=True)
    model.model.connector.modality_projection = Marker(W, unpack)
    proc_cls = Idefics3ImageProcessor if kind == "idefics3" else SmolVLMImageProcessor
    proc = proc_cls(size={"longest_edge": 96}, max_image_size={"longest_edge": TILE}, do_rescale=False,
                    do_normalize=False, do_image_splitting=split)
    images = []
    for h, w in sizes:  # +1 so no pixel is 0 (the model drops all-zero images as padding)
        y = torch.arange(h)[:, None].expand(h, w).float() + 1
        x = torch.arange(w)[None].expand(h, w).float() + 1
        images.append(torch.stack([y, x, torch.ones_like(x)]))
    inputs = proc(images=images, return_tensors="pt", return_row_col_info=True)
    rows, cols = [r for r in inputs.pop("rows")[0]], [c for c in inputs.pop("cols")[0]]
    ids = prompt_ids(kind, rows, cols)
    inputs["pixel_values"] = inputs["pixel_values"].reshape(1, -1, 3, TILE, TILE)
    inputs["pixel_attention_mask"] = inputs["pixel_attention_mask"].reshape(1, -1, TILE, TILE)
    emb = lm_inputs(model, model.model.text_model, input_ids=torch.from_numpy(ids)[None], **inputs).numpy()
    return model, ids, rows, cols, emb


@pytest.mark.parametrize("kind", ["idefics3", "smolvlm"])
def test_tiles_and_global_view_land_where_the_layout_says(kind):
    fn = idefics3_layout if kind == "idefics3" else smolvlm_layout
    # sizes already at the processor's longest edge (96) and multiples of the tile: tiles are exact crops
    model, ids, rows, cols, emb = run(kind, [(64, 96), (96, 64)])
    assert (rows, cols) == ([2, 3], [3, 2])
    got = [fn(model.config, ids, rows, cols, image_index=k) for k in range(2)]
    assert np.array_equal(np.concatenate([g.positions for g in got]), np.nonzero(emb[:, 0])[0])
    sub = shuffle_patches(model.config)  # (G*G, S*S, 2) patch (row, col) per token, channel order
    for (h, w), nr, nc, lay in zip([(64, 96), (96, 64)], rows, cols, got):
        assert [t.name for t in lay.tiles] == [f"tile_r{r}_c{c}" for r in range(nr) for c in range(nc)] + ["global"]
        for k, tile in enumerate(lay.tiles):
            sel = lay.tile_of == k
            e = emb[lay.positions[sel]]
            tok = lay.rows[sel] * G + lay.cols[sel]
            if tile.name != "global":  # exact: tile (r, c) holds pixels from (r*TILE, c*TILE) on (+1, see run)
                r, c = (int(v) for v in re.findall(r"\d+", tile.name))
                assert np.array_equal(e[:, 1:5], r * TILE + sub[tok, :, 0] * PATCH + 1)
                assert np.array_equal(e[:, 5:9], c * TILE + sub[tok, :, 1] * PATCH + 1)
                assert tile.box == pytest.approx((r / nr, c / nc, (r + 1) / nr, (c + 1) / nc))
            else:  # the global view squashes h x w px to one tile: a patch's top-left pixel, within one patch
                fy, fx = h / TILE, w / TILE
                assert np.all(np.abs(e[:, 1:5] - sub[tok, :, 0] * PATCH * fy) <= PATCH * fy)
                assert np.all(np.abs(e[:, 5:9] - sub[tok, :, 1] * PATCH * fx) <= PATCH * fx)
    assert got[0].description.startswith(("Idefics3" if kind == "idefics3" else "SmolVLM")
                                         + ": image split into 2x3 tiles + a global view, each 8x8 patches "
                                         "pixel-shuffled 2x2 into 4x4 tokens")
    lay = got[0]
    maps = lay.on_image(emb[lay.positions, 1], (64, 96))  # each token's first patch row, stitched on the image
    assert set(maps) == {"tiles", "global"} and not np.isnan(maps["tiles"]).any()
    # pixel (y, x) lies in token row y // 8 of its tile, whose first patch starts at pixel row (y // 8) * 8
    assert np.array_equal(maps["tiles"][:, 0], (np.arange(64) // 8) * 8 + 1)


@pytest.mark.parametrize("kind", ["idefics3", "smolvlm"])
def test_unsplit_image_is_the_global_view_only(kind):
    fn = idefics3_layout if kind == "idefics3" else smolvlm_layout
    model, ids, rows, cols, emb = run(kind, [(64, 96)], split=False)
    assert (rows, cols) == ([0], [0])
    lay = fn(model.config, ids, rows, cols)
    assert np.array_equal(lay.positions, np.nonzero(emb[:, 0])[0]) and lay.positions.size == G * G
    assert [t.name for t in lay.tiles] == ["global"] and "not split (global view only)" in lay.description
    sub = shuffle_patches(model.config)
    e = emb[lay.positions]
    assert np.all(np.abs(e[:, 1:5] - sub[lay.rows * G + lay.cols, :, 0] * PATCH * 2) <= PATCH * 2)


def test_bad_inputs_raise():
    model = make("smolvlm")
    with pytest.raises(ArgumentError, match="image tokens"):
        smolvlm_layout(model.config, np.full(10, IMG), 1, 1)
    with pytest.raises(ArgumentError, match="rows/cols"):
        smolvlm_layout(model.config, np.full(16, IMG), [0], [2])
    with pytest.raises(ArgumentError, match="image_index"):
        smolvlm_layout(model.config, np.full(16, IMG), 0, 0, image_index=1)


@pytest.mark.parametrize(("kind", "anat"), [("idefics3", IDEFICS3_ANATOMY), ("smolvlm", SMOLVLM_ANATOMY)])
def test_anatomy_paths_resolve(kind, anat):
    model = make(kind)
    assert type(model).__name__ == anat.model_class
    assert len(model.get_submodule(anat.vision_blocks)) == 3
    assert len(model.get_submodule(anat.lm_layers)) == 2
    model.get_submodule(anat.projector)
    assert getattr(model.config, anat.image_token_key) == IMG
