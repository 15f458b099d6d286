"""Qwen2-VL / Qwen2.5-VL layouts against the models' own path: the real image processor patchifies images whose
pixels hold their patch's (row, col, image); the tower's patch embedding reads that mark, its blocks are made
identities (so the window permutation of 2.5-VL is all that moves tokens), the merger concatenates each merge
block's marks, and the LM's ``inputs_embeds`` are read back."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch import nn  # noqa: E402
from vlm_marks import Marker, lm_inputs, zero_text  # noqa: E402
from vlm_qwen_tiny import END, IMG, PATCH, START, W  # noqa: E402
from vlm_qwen_tiny import make_model as make  # noqa: E402

from vitcam_nb.adapters.vlm_layouts.qwen import (  # noqa: E402
    QWEN2_5_VL_ANATOMY,
    QWEN2_VL_ANATOMY,
    qwen2_5_vl_layout,
    qwen2_vl_layout,
    qwen_tower_cells,
)
from vitcam_nb.core.errors import ArgumentError  # noqa: E402

CH = 2 * PATCH * PATCH  # one channel's share of a flattened patch (temporal_patch_size 2)


class Ident(nn.Module):
    def forward(self, hidden_states, **_kw):
        return hidden_states


class PatchMark(nn.Module):
    """The patch embedding, replaced: [1, row, col, image] read off the marked pixels."""

    def __init__(self):
        super().__init__()
        self.keep = nn.Parameter(torch.zeros(1))  # the tower reads its dtype off its first parameter

    def forward(self, x):
        out = torch.zeros(x.shape[0], W, dtype=x.dtype)
        out[:, 0], out[:, 1], out[:, 2], out[:, 3] = 1.0, x[:, 0], x[:, CH], x[:, 2 * CH]
        return out


def merge_marks(x):
    """The merger, replaced: each merged token carries its 4 patches' rows, cols and the image index."""
    x4 = x.reshape(-1, 4, W)
    out = torch.zeros(x4.shape[0], W, dtype=x.dtype)
    out[:, 0] = 1.0
    out[:, 1:5], out[:, 5:9], out[:, 9] = x4[:, :, 1], x4[:, :, 2], x4[:, 0, 3]
    return out


def marked_image(h_px: int, w_px: int, index: int) -> torch.Tensor:
    r = torch.arange(h_px)[:, None].expand(h_px, w_px) // PATCH
    c = torch.arange(w_px)[None, :].expand(h_px, w_px) // PATCH
    return torch.stack([r, c, torch.full_like(r, index)]).float()


def run(kind: str, sizes):
    from transformers import Qwen2VLImageProcessor

    model = make(kind)
    vis = model.model.visual
    vis.patch_embed = PatchMark()
    vis.blocks = nn.ModuleList([Ident() for _ in vis.blocks])
    vis.merger = Marker(W, merge_marks)
    zero_text(model)
    seen = {}

    def grab(_mod, args, kwargs):
        seen["tower"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

    vis.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    proc = Qwen2VLImageProcessor(do_resize=False, do_rescale=False, do_normalize=False)
    inputs = proc(images=[marked_image(h, w, k) for k, (h, w) in enumerate(sizes)], return_tensors="pt")
    thw = inputs["image_grid_thw"]
    ids = [1]
    for t, h, w in thw.tolist():
        ids += [START] + [IMG] * (t * h * w // 4) + [END, 2]
    ids = np.asarray(ids)
    types = torch.from_numpy((ids == IMG).astype(np.int64))[None]  # M-RoPE's modality ids: 1 image, 0 text
    emb = lm_inputs(model, model.model.language_model, input_ids=torch.from_numpy(ids)[None],
                    mm_token_type_ids=types, **inputs).numpy()
    return model, ids, thw, emb, seen["tower"].numpy()


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5"])
def test_merged_tokens_land_where_the_layout_says(kind):
    fn = qwen2_vl_layout if kind == "qwen2" else qwen2_5_vl_layout
    model, ids, thw, emb, tower = run(kind, [(84, 140), (56, 56)])
    assert thw.tolist() == [[1, 6, 10], [1, 4, 4]]
    flagged = np.nonzero(emb[:, 0] == 1)[0]
    got = [fn(model.config, ids, thw, image_index=k) for k in range(2)]
    assert np.array_equal(np.concatenate([g.positions for g in got]), flagged)
    for k, lay in enumerate(got):
        e = emb[lay.positions]
        assert np.all(e[:, 9] == k)
        # merged token (r, c) holds patches (2r, 2c), (2r, 2c+1), (2r+1, 2c), (2r+1, 2c+1), in that order
        assert np.array_equal(e[:, 1:5], (2 * lay.rows[:, None] + [0, 0, 1, 1]).astype(float))
        assert np.array_equal(e[:, 5:9], (2 * lay.cols[:, None] + [0, 1, 0, 1]).astype(float))
        assert lay.tiles[0].grid == (thw[k, 1] // 2, thw[k, 2] // 2)
    assert got[0].description.startswith("Qwen2" + ("-VL" if kind == "qwen2" else ".5-VL") + ": 6x10 patches")
    assert "merged 2x2 into 3x5 tokens in raster order" in got[0].description
    # the tower's own order, as its first block sees it (both images, one after the other)
    vc = model.config.vision_config
    kw = {} if kind == "qwen2" else {"window_size": vc.window_size, "patch_size": vc.patch_size}
    cells = [qwen_tower_cells(g, 2, **kw) for g in thw.tolist()]
    assert np.array_equal(tower[:, 1], np.concatenate([c[1] for c in cells]))
    assert np.array_equal(tower[:, 2], np.concatenate([c[2] for c in cells]))


def test_window_order_differs_from_raster():
    # 3x5 merged tokens, windows of 2x2 tokens: window (0,0) holds blocks 0,1,5,6 -> patches of rows 0-3, cols 0-3
    _, rows, cols = qwen_tower_cells((1, 6, 10), 2, window_size=56, patch_size=14)
    assert rows[:16].tolist() == [0, 0, 1, 1] * 2 + [2, 2, 3, 3] * 2
    assert cols[:16].tolist() == [0, 1, 0, 1, 2, 3, 2, 3] * 2
    _, r2, c2 = qwen_tower_cells((1, 6, 10), 2)
    assert r2[:8].tolist() == [0, 0, 1, 1, 0, 0, 1, 1] and c2[:8].tolist() == [0, 1, 0, 1, 2, 3, 2, 3]


def test_bad_inputs_raise():
    model = make("qwen2")
    with pytest.raises(ArgumentError, match="image tokens"):
        qwen2_vl_layout(model.config, np.array([1, IMG, 2]), [[1, 4, 4]])
    with pytest.raises(ArgumentError, match="image_index"):
        qwen2_vl_layout(model.config, np.full(4, IMG), [[1, 4, 4]], image_index=1)


@pytest.mark.parametrize(("kind", "anat"), [("qwen2", QWEN2_VL_ANATOMY), ("qwen2_5", QWEN2_5_VL_ANATOMY)])
def test_anatomy_paths_resolve(kind, anat):
    model = make(kind)
    assert type(model).__name__ == anat.model_class
    assert len(model.get_submodule(anat.vision_blocks)) == 3
    assert len(model.get_submodule(anat.lm_layers)) == 2
    model.get_submodule(anat.projector)
    assert getattr(model.config, anat.image_token_key) == IMG
