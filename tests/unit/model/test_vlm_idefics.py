"""Idefics3 and SmolVLM answers on tiny random configs built in code (issue 55): the rows are read, the tile grid is
read off the prompt as the processors write it, the LM-side sites' stored gradients (projector, lm_resid, lm_attn
at the image-token positions) equal torch.autograd's from a hand-written hook-and-autograd reference, and Grad-CAM
of an answer token at lm_resid over the multi-tile layout (2x2 tiles + a global view, each 2x2 tokens) equals a
hand-written reference. The tower's per-crop sites wait for the per-crop capture (skipped until it lands)."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vitcam_testing import assert_rel_close
from vlm_marks import answer_gradients

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")

from vitcam_nb.adapters.hf_vlm import NOT_YET_SUPPORTED, HfVlmAdapter, vlm_family_of  # noqa: E402
from vitcam_nb.adapters.hf_vlm_idefics import idefics_crop_tiles, prompt_tiles  # noqa: E402

IMG, FAKE, GLOBAL, NL, NL2 = 63, 60, 61, 62, 59  # NL2: a tokenizer that merges "\n\n" into one token
TILE, PATCH, S = 32, 8, 2
G = TILE // PATCH // S  # 2x2 tokens per crop
ANSWER = [9, 10, 11]
LM = ("projector", "lm_resid", "lm_attn")
KINDS = ("idefics3", "smolvlm")


def make(kind: str, seed: int = 0) -> torch.nn.Module:
    """SigLIP-like tower 2 layers width 32 on 32 px tiles (patch 8), pixel shuffle 2, Llama 2 layers width 32."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        LlamaConfig,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    cfg_cls, cls = ((Idefics3Config, Idefics3ForConditionalGeneration) if kind == "idefics3" else
                    (SmolVLMConfig, SmolVLMForConditionalGeneration))
    t = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64, max_position_embeddings=256)
    cfg = cfg_cls(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     image_size=TILE, patch_size=PATCH), text_config=t.to_dict(),
                  image_token_id=IMG, scale_factor=S)
    torch.manual_seed(seed)
    return cls(cfg).eval()


def prompt(kind: str, grids: list[tuple[int, int]], merge_newlines: bool = False) -> list[int]:
    """The prompt's ids from the family's own template (its processor's ``replace_image_token``), one id per special
    token or character (``<row_r_col_c>`` ids from 20 on; other text 5)."""
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
    from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor

    me = SimpleNamespace(fake_image_token="<fake_token_around_image>", global_image_tag="<global-img>",
                         global_image_token="<global-img>", image_token="<image>", image_seq_len=G * G)
    fn = (Idefics3Processor if kind == "idefics3" else SmolVLMProcessor).replace_image_token
    info = {"rows": [[r for r, _ in grids]], "cols": [[c for _, c in grids]]}
    text = "Q:" + " and ".join(fn(me, info, k) for k in range(len(grids))) + "?"
    vocab = {"<image>": IMG, "<fake_token_around_image>": FAKE, "<global-img>": GLOBAL, "\n": NL, "\n\n": NL2}
    ids = []
    for tok in re.findall(r"<[^>]+>|\n\n|.", text, flags=re.S) if merge_newlines else \
            re.findall(r"<[^>]+>|.", text, flags=re.S):
        m = re.fullmatch(r"<row_(\d)_col_(\d)>", tok)
        ids.append(vocab.get(tok, 20 + 4 * int(m[1]) + int(m[2]) if m else 5))
    return ids


PROMPT = prompt("idefics3", [(2, 2)])


def make_x(crops: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, crops, 3, TILE, TILE, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    return make(request.param)


@pytest.fixture(scope="module")
def trace(model):
    return vc.trace(model, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=list(LM))


# --------------------------------------------------------------------------------------------------
# the hand-written reference: hooks on an eager copy of the model, torch.autograd per output


def reference(model: torch.nn.Module, x: torch.Tensor, ids: list[int]) -> tuple[dict, dict, torch.Tensor]:
    """Activations and gradients of the LM-side sites ((layer, site) keys; the projector's crops flattened in the
    order the LM reads them, the LM sites over the whole sequence) for every output the trace differentiates."""
    ref = copy.deepcopy(model)
    ref.model.text_model.config._attn_implementation = "eager"
    ref.model.vision_model.config._attn_implementation = "eager"
    kept, handles = {}, []

    def flat(_m, _i, o):  # (crops, tokens, d) -> one row of every crop's tokens, kept on the model's path
        kept[(0, "projector")] = o.reshape(1, -1, o.shape[-1])
        return kept[(0, "projector")].reshape(o.shape)

    handles.append(ref.model.connector.register_forward_hook(flat))
    for i, layer in enumerate(ref.model.text_model.layers):
        handles.append(layer.register_forward_pre_hook(
            lambda _m, args, kwargs, k=(i, "lm_resid"): kept.__setitem__(k, args[0] if args else
                                                                         kwargs["hidden_states"]),
            with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(
            lambda _m, _i, o, k=(i, "lm_attn"): kept.__setitem__(k, o[1])))
    logits = ref(input_ids=torch.tensor([ids + ANSWER]), pixel_values=x, use_cache=False).logits[0]
    for h in handles:
        h.remove()
    return answer_gradients(logits, len(ids), ANSWER, kept)


@pytest.fixture(scope="module")
def refs(model):
    return reference(model, make_x(), PROMPT)


def image_positions(ids: list[int]) -> np.ndarray:
    return np.flatnonzero(np.asarray(ids) == IMG)


# --------------------------------------------------------------------------------------------------
# the rows and the layout read off the prompt


@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_registered_with_crops(kind):
    m = make(kind)
    fam = vlm_family_of(m)
    assert fam.name == kind and fam.crops and fam.tower == "model.vision_model"
    assert type(m).__name__ not in NOT_YET_SUPPORTED and type(m).__name__ in HfVlmAdapter.classes
    assert fam.projector == "model.connector" and fam.lm_layers == "model.text_model.layers"


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("grids", [[(2, 2)], [(0, 0)], [(3, 1)], [(1, 3)], [(2, 3), (0, 0), (3, 1)],
                                   [(0, 0), (1, 2)], [(3, 1), (3, 1)]])
@pytest.mark.parametrize("kind", KINDS)
def test_tile_grid_is_read_off_the_processors_template(kind, grids, merge):
    ids = prompt(kind, grids, merge)
    assert prompt_tiles(ids, image_id=IMG, per_crop=G * G) == ([r for r, _ in grids], [c for _, c in grids])


def test_layout_and_crop_tiles_of_a_tiled_prompt():
    m = make("idefics3")
    ids = prompt("idefics3", [(1, 2), (2, 3)])
    lay = HfVlmAdapter().layout(m, np.asarray(ids))
    # the last image is mapped: its global view is the last crop, the one the trace shows
    assert [t.name for t in lay.tiles] == [f"tile_r{r}_c{c}" for r in range(2) for c in range(3)] + ["global"]
    np.testing.assert_array_equal(lay.positions, image_positions(ids)[3 * G * G:])
    # the tower runs the first image's 2 tiles and global view, then the second image's 6 tiles and global view
    assert idefics_crop_tiles(m, np.asarray(ids)) == ("", "", "", *(t.name for t in lay.tiles))
    assert lay.description.startswith("Idefics3: image split into 2x3 tiles + a global view")
    assert lay.description.endswith("image 2 of 2")


def test_prompt_off_the_template_is_refused_before_the_forward():
    m = make("idefics3")
    bad = PROMPT[:6] + PROMPT[7:]  # one image token short in the first tile
    with pytest.raises(vc.TraceError, match="image-token runs of lengths"):
        vc.trace(m, make_x(), targets=vc.targets.answer(input_ids=bad, answer_ids=ANSWER), sites=list(LM))
    with pytest.raises(vc.TraceError, match=r"image: crops of 16x16 px, but the tower takes 32x32"):
        vc.trace(m, torch.zeros(1, 5, 3, 16, 16), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                 sites=list(LM))


# --------------------------------------------------------------------------------------------------
# (a) every LM-side site's stored gradient is torch.autograd's


def test_scores_are_teacher_forced_logits(trace, refs):
    np.testing.assert_allclose(trace["logits"].values, refs[2].numpy(), rtol=1e-5, atol=1e-6)
    assert trace.attrs["vlm_family"] in KINDS and trace.sizes["image_token"] == 5 * G * G


def test_lm_site_gradients_equal_autograd_at_the_image_tokens(trace, refs):
    acts, grads, _ = refs
    pos = image_positions(PROMPT)
    np.testing.assert_array_equal(trace["image_token_pos"].values, pos)
    assert_rel_close(trace["projector"].values, acts[(0, "projector")], "projector")
    assert np.abs(grads[(0, "projector")]).max() > 1e-3
    assert_rel_close(trace["projector_grad"].values, grads[(0, "projector")], "projector grad")
    rows = np.arange(len(PROMPT), len(PROMPT) + len(ANSWER)) - 1
    for layer in range(2):
        assert_rel_close(trace["lm_resid"].values[layer], acts[(layer, "lm_resid")][pos], f"lm_resid {layer}")
        g = grads[(layer, "lm_resid")][:, pos]
        assert np.abs(g).max() > 1e-3
        assert_rel_close(trace["lm_resid_grad"].values[:, layer], g, f"lm_resid grad {layer}")
        a = acts[(layer, "lm_attn")][:, rows][:, :, pos]
        assert_rel_close(trace["lm_attn"].values[layer], a, f"lm_attn {layer}")
        g = grads[(layer, "lm_attn")][:, :, rows][:, :, :, pos]
        assert_rel_close(trace["lm_attn_grad"].values[:, layer], g, f"lm_attn grad {layer}")


def test_unsplit_image_is_one_tile(model):
    ids = prompt("idefics3", [(0, 0)])
    x = make_x(crops=1)
    tr = vc.trace(model, x, targets=vc.targets.answer(input_ids=ids, answer_ids=ANSWER), sites=["lm_resid"])
    acts, grads, _ = reference(model, x, ids)
    pos = image_positions(ids)
    assert_rel_close(tr["lm_resid_grad"].values[:, 1], grads[(1, "lm_resid")][:, pos], "lm_resid grad")
    m = vc.cam(tr, vc.Recipe(site="lm_resid", layer=-1, class_=0, upsample="none"))
    assert m.dims == ("patch_row", "patch_col") and m.shape == (G, G)


# --------------------------------------------------------------------------------------------------
# (b) Grad-CAM of an answer token at lm_resid over the tiles, against a hand-written reference


def gradcam_tokens(A: np.ndarray, G_: np.ndarray) -> np.ndarray:
    """Selvaraju et al. over all 20 image tokens (every tile's and the global view's): alpha_k = mean_t G[t, k]."""
    v = np.maximum(A @ G_.mean(axis=0), 0)
    return (v - v.min()) / (v.max() - v.min())


@pytest.mark.parametrize(("layer", "token"), [(-1, 0), (0, 2)])
def test_gradcam_at_lm_resid_equals_reference(trace, refs, layer, token):
    acts, grads, _ = refs
    pos = image_positions(PROMPT)
    v = gradcam_tokens(acts[(layer % 2, "lm_resid")][pos], grads[(layer % 2, "lm_resid")][token, pos])
    cells = v.reshape(5, G, G)  # crop k's tokens in raster order: tiles r0c0, r0c1, r1c0, r1c1, then the global view
    grid = vc.cam(trace, vc.Recipe(site="lm_resid", layer=layer, class_=token, upsample="none"))
    assert grid.dims == ("tile", "patch_row", "patch_col") and grid.attrs["degenerate"] == ""
    assert list(grid["tile"].values) == ["tile_r0_c0", "tile_r0_c1", "tile_r1_c0", "tile_r1_c1", "global"]
    assert_rel_close(grid.values, cells, f"lm_resid Grad-CAM grids at LM layer {layer}")
    # on the image (32 px): the 2x2 tiles stitched (each token 8x8 px), the global view alone (each token 16x16 px)
    stitched = np.block([[cells[0], cells[1]], [cells[2], cells[3]]])
    m = vc.cam(trace, vc.Recipe(site="lm_resid", layer=layer, class_=token, upsample="nearest"))
    assert m.dims == ("view", "y", "x") and list(m["view"].values) == ["tiles", "global"]
    assert_rel_close(m.values[0], np.kron(stitched, np.ones((8, 8))), "tiles stitched")
    assert_rel_close(m.values[1], np.kron(cells[4], np.ones((16, 16))), "global view")


# --------------------------------------------------------------------------------------------------
# (c) the tower's per-crop sites (a leading dim ``crop`` with coords crop and crop_tile on act, grad, attn, image)


def tower_reference(model: torch.nn.Module, x: torch.Tensor) -> tuple[dict, dict]:
    """F1 (layer_norm1's output) of every tower layer for every crop, and its gradients, by hooks and autograd."""
    ref = copy.deepcopy(model)
    ref.model.text_model.config._attn_implementation = "eager"
    ref.model.vision_model.config._attn_implementation = "eager"
    kept = {}

    def one_row(key):  # every crop as one batch row (answer_gradients keeps row 0), kept on the model's path
        def hook(_m, _i, o):
            kept[key] = o.reshape(1, *o.shape)
            return kept[key].reshape(o.shape)
        return hook

    handles = [layer.layer_norm1.register_forward_hook(one_row((i, "F1")))
               for i, layer in enumerate(ref.model.vision_model.encoder.layers)]
    logits = ref(input_ids=torch.tensor([PROMPT + ANSWER]), pixel_values=x, use_cache=False).logits[0]
    for h in handles:
        h.remove()
    acts, grads, _ = answer_gradients(logits, len(PROMPT), ANSWER, kept)
    return acts, grads


def test_tower_gradients_per_crop_equal_autograd(model):
    x = make_x()
    tr = vc.trace(model, x, targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER), sites=["F1", "lm_resid"])
    acts, grads = tower_reference(model, x)
    assert list(tr["crop_tile"].values) == ["tile_r0_c0", "tile_r0_c1", "tile_r1_c0", "tile_r1_c1", "global"]
    assert all(np.abs(grads[(layer, "F1")]).max() > 0 for layer in range(2))  # a real comparison
    for crop in range(5):
        one = tr.isel(crop=crop)
        for layer in range(2):
            assert_rel_close(one["act"].values[layer, 0], acts[(layer, "F1")][crop], f"F1@{layer} crop {crop}")
            assert_rel_close(one["grad"].values[:, layer, 0], grads[(layer, "F1")][:, crop],
                             f"F1 grad @{layer} crop {crop}")


def test_tower_gradcam_per_crop_equals_reference(model):
    x = make_x()
    tr = vc.trace(model, x, targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER), sites=["F1"])
    acts, grads = tower_reference(model, x)
    p = TILE // PATCH
    for crop in range(5):
        A, Gr = acts[(1, "F1")][crop], grads[(1, "F1")][0, crop]
        v = np.maximum(A @ Gr.mean(axis=0), 0).reshape(p, p)
        expected = (v - v.min()) / (v.max() - v.min())
        m = vc.cam(tr.isel(crop=crop), vc.Recipe(site="F1", layer=1, class_=0, upsample="none"))
        assert_rel_close(m.values, expected, f"tower Grad-CAM crop {crop}")


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_saved_tiled_trace_gives_the_same_maps(trace, tmp_path, suffix):
    back = vc.load(vc.save(trace, tmp_path / f"idefics{suffix}"))
    for r in (vc.Recipe(site="lm_resid", layer=-1, class_=0), vc.Recipe(site="projector", class_=2, upsample="none"),
              vc.Recipe(site="lm_attn", layer=0, class_=1, relu="none", upsample="bilinear")):
        a, b = vc.cam(trace, r), vc.cam(back, r)
        np.testing.assert_array_equal(b.values, a.values, err_msg=r.id)
        assert a.dims == b.dims and a.attrs["checklist"] == b.attrs["checklist"]


def test_two_image_prompt_maps_the_last_image(model):
    """The projector's rows of the first image's 3 crops are skipped; the last image's 5 crops are stored."""
    ids = prompt("idefics3", [(1, 2), (2, 2)])
    x = make_x(crops=8)
    tr = vc.trace(model, x, targets=vc.targets.answer(input_ids=ids, answer_ids=ANSWER),
                  sites=["projector", "lm_resid"])
    acts, grads, _ = reference(model, x, ids)
    pos = image_positions(ids)[3 * G * G:]
    np.testing.assert_array_equal(tr["image_token_pos"].values, pos)
    assert_rel_close(tr["projector"].values, acts[(0, "projector")][3 * G * G:], "projector of the last image")
    assert_rel_close(tr["projector_grad"].values, grads[(0, "projector")][:, 3 * G * G:], "its gradients")
    assert_rel_close(tr["lm_resid_grad"].values[:, 0], grads[(0, "lm_resid")][:, pos], "lm_resid grad")
    m = vc.cam(tr, vc.Recipe(site="lm_resid", layer=0, class_=0))
    assert m.dims == ("view", "y", "x") and list(m["view"].values) == ["tiles", "global"]
