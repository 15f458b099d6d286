"""PaliGemma / Gemma 3 layouts against the models' own path: the SigLIP tower's output is replaced (forward hook)
by marks holding each patch's (row, col); PaliGemma's projector is made an identity, Gemma 3's keeps its own
average pooling with its norm and matmul made identities, and the LM's ``inputs_embeds`` are read back."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch import nn  # noqa: E402
from vlm_marks import lm_inputs, zero_text  # noqa: E402

from vitcam_nb.adapters.vlm_layouts.gemma import (  # noqa: E402
    GEMMA3_ANATOMY,
    PALIGEMMA_ANATOMY,
    gemma3_layout,
    gemma3_patch_token,
    paligemma_layout,
)
from vitcam_nb.core.errors import ArgumentError  # noqa: E402

IMG, BOI, EOI, W, PX, PATCH = 5, 3, 4, 32, 48, 8
SIDE = PX // PATCH  # 6x6 patches


def siglip():
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(hidden_size=W, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=PX, patch_size=PATCH)


def make(kind: str):
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
    )

    torch.manual_seed(0)
    if kind == "pali":
        text = GemmaConfig(vocab_size=64, hidden_size=W, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        cfg = PaliGemmaConfig(vision_config=siglip(), text_config=text, image_token_index=IMG, projection_dim=W)
        model = PaliGemmaForConditionalGeneration(cfg).eval()
        model.model.multi_modal_projector = nn.Identity()
    else:  # 6x6 patches pooled 2x2 into 3x3 = 9 tokens
        text = Gemma3TextConfig(vocab_size=64, hidden_size=W, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        cfg = Gemma3Config(vision_config=siglip(), text_config=text, image_token_index=IMG, boi_token_index=BOI,
                           eoi_token_index=EOI, mm_tokens_per_image=9)
        model = Gemma3ForConditionalGeneration(cfg).eval()
        proj = model.model.multi_modal_projector
        proj.mm_soft_emb_norm = nn.Identity()
        with torch.no_grad():
            proj.mm_input_projection_weight.copy_(torch.eye(W))
    zero_text(model)

    def mark(_mod, args, out):  # per image: [1, row, col, image index] for each of its SIDE*SIDE patches
        b = out.last_hidden_state.shape[0]
        r, c = np.divmod(np.arange(SIDE * SIDE), SIDE)
        m = torch.zeros(b, SIDE * SIDE, W)
        m[..., 0], m[..., 1], m[..., 2] = 1.0, torch.tensor(r).float(), torch.tensor(c).float()
        m[..., 3] = torch.arange(b).float()[:, None]
        out.last_hidden_state = m
        return out

    model.model.vision_tower.register_forward_hook(mark)
    return model


def run(model, ids, n_images):
    emb = lm_inputs(model, model.model.language_model, input_ids=torch.from_numpy(ids)[None],
                    pixel_values=torch.randn(n_images, 3, PX, PX))
    return emb.numpy()


def test_paligemma_image_tokens_come_first_in_raster_order():
    model = make("pali")
    ids = np.concatenate([np.full(2 * SIDE * SIDE, IMG), [2, 9, 10, 11, 1]])
    emb = run(model, ids, 2)
    got = [paligemma_layout(model.config, ids, image_index=k) for k in range(2)]
    assert np.array_equal(np.concatenate([g.positions for g in got]), np.nonzero(emb[:, 0])[0])
    assert got[0].positions[0] == 0 and "before the prompt" in got[0].description
    for k, lay in enumerate(got):
        e = emb[lay.positions]
        assert np.all(e[:, 3] == k)
        assert np.array_equal(e[:, 1], lay.rows) and np.array_equal(e[:, 2], lay.cols)
    assert got[1].description.startswith("PaliGemma: 6x6 SigLIP patches of 8 px, one token each, raster order")


def test_gemma3_pooled_tokens_between_boi_and_eoi():
    model = make("gemma3")
    ids = np.array([2, 9, BOI, *[IMG] * 9, EOI, 10, BOI, *[IMG] * 9, EOI, 11])
    emb = run(model, ids, 2)
    got = [gemma3_layout(model.config, ids, image_index=k) for k in range(2)]
    assert np.array_equal(np.concatenate([g.positions for g in got]), np.nonzero(emb[:, 0])[0])
    for k, lay in enumerate(got):
        e = emb[lay.positions]
        assert np.allclose(e[:, 0], 1.0) and np.allclose(e[:, 3], k)
        # the mean of a 2x2 block of patch rows/cols is the block's centre: 2*r + 0.5
        assert np.allclose(e[:, 1], 2 * lay.rows + 0.5) and np.allclose(e[:, 2], 2 * lay.cols + 0.5)
    assert "6x6 SigLIP patches average-pooled 2x2 into 3x3 tokens" in got[0].description
    assert "between begin/end-of-image tokens" in got[0].description
    # every patch feeds the token whose 2x2 block holds it
    tok = gemma3_patch_token(model.config)
    r, c = np.divmod(np.arange(36), 6)
    assert np.array_equal(tok, (r // 2) * 3 + c // 2)


def test_bad_inputs_raise():
    model = make("gemma3")
    with pytest.raises(ArgumentError, match="whole number"):
        gemma3_layout(model.config, np.array([IMG] * 8))
    with pytest.raises(ArgumentError, match="image_index"):
        gemma3_layout(model.config, np.array([IMG] * 9), image_index=1)


@pytest.mark.parametrize(("kind", "anat"), [("pali", PALIGEMMA_ANATOMY), ("gemma3", GEMMA3_ANATOMY)])
def test_anatomy_paths_resolve(kind, anat):
    model = make(kind)
    assert type(model).__name__ == anat.model_class
    assert len(model.get_submodule(anat.vision_blocks)) == 3
    assert len(model.get_submodule(anat.lm_layers)) == 2
    model.get_submodule(anat.projector)
    assert getattr(model.config, anat.image_token_key) == IMG
