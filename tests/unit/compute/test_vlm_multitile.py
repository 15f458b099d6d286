"""Maps of the generative-VLM sites over a multi-tile image-token layout (issue 55, item 4), against a NumPy
reference computed by hand from the stored arrays: the tiny LLaVA's answer trace with its 16 image tokens re-laid as
a synthetic any-resolution layout (a 2x4 base view over the whole image, then two 2x2 crops side by side, the
tokens out of raster order). Weights, ReLU and normalisation run over all 16 tokens as one set; each tile's cells
then land in its box, one map per tile group (base, crops), never averaged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from vitcam_testing import assert_rel_close

import vitcam_nb as vc

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_vlm_llava import ANSWER, PROMPT, make_llava, make_x  # noqa: E402

H = W = 32  # the trace's image
#: (name, grid, box, group) of the synthetic layout, and each token's (tile, row, col) in sequence order
TILES = [("base", (2, 4), (0.0, 0.0, 1.0, 1.0), "base"), ("left", (2, 2), (0.0, 0.0, 1.0, 0.5), "crops"),
         ("right", (2, 2), (0.0, 0.5, 1.0, 1.0), "crops")]
_CELLS = [(0, r, c) for r in range(2) for c in range(4)] + [(1, r, c) for r in range(2) for c in range(2)] + [
    (2, r, c) for r in range(2) for c in range(2)]
ORDER = np.random.default_rng(3).permutation(16)  # token i covers cell _CELLS[ORDER[i]]
CELLS = np.array([_CELLS[k] for k in ORDER])


@pytest.fixture(scope="module")
def one_tile():
    return vc.trace(make_llava(), make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=["projector", "lm_resid", "lm_attn"])


@pytest.fixture(scope="module")
def tiled(one_tile):
    tr = one_tile.assign_coords(image_token_tile=("image_token", CELLS[:, 0]),
                                image_token_row=("image_token", CELLS[:, 1]),
                                image_token_col=("image_token", CELLS[:, 2]))
    boxes = json.dumps([{"name": n, "grid": list(g), "box": list(b), "group": grp} for n, g, b, grp in TILES])
    for site in ("projector", "lm_resid", "lm_attn"):
        tr[site].attrs["layout_tile_boxes"] = boxes
    return tr


def minmax(v: np.ndarray) -> np.ndarray:
    return (v - v.min()) / (v.max() - v.min())


def gradcam_tokens(A: np.ndarray, G: np.ndarray) -> np.ndarray:
    """Selvaraju et al. over all 16 tokens at once: alpha_k = mean_t G[t, k]; relu(A @ alpha); min-max."""
    return minmax(np.maximum(A @ G.mean(axis=0), 0))


def grids(v: np.ndarray) -> dict[str, np.ndarray]:
    out = {n: np.full(g, np.nan) for n, g, _, _ in TILES}
    for (t, r, c), x in zip(CELLS, v):
        out[TILES[t][0]][r, c] = x
    return out


def nearest(v: np.ndarray) -> dict[str, np.ndarray]:
    """Each pixel takes the cell of its group's tile whose box holds the pixel's centre."""
    g = grids(v)
    out = {"base": np.full((H, W), np.nan), "crops": np.full((H, W), np.nan)}
    for name, (gh, gw), (t, lf, b, r), grp in TILES:
        for y in range(H):
            for x in range(W):
                cy, cx = (y + 0.5) / H, (x + 0.5) / W
                if t <= cy < b and lf <= cx < r:
                    out[grp][y, x] = g[name][int((cy - t) / (b - t) * gh), int((cx - lf) / (r - lf) * gw)]
    return out


def bilinear(v: np.ndarray) -> dict[str, np.ndarray]:
    """Each tile's grid upsampled alone (torch's bilinear, half-pixel centres) over the pixels of its box."""
    g = grids(v)
    out = {"base": np.full((H, W), np.nan), "crops": np.full((H, W), np.nan)}
    for name, _, (t, lf, b, r), grp in TILES:
        ys, xs = slice(round(t * H), round(b * H)), slice(round(lf * W), round(r * W))
        size = (ys.stop - ys.start, xs.stop - xs.start)
        up = torch.nn.functional.interpolate(torch.tensor(g[name])[None, None], size=size, mode="bilinear",
                                             align_corners=False)[0, 0].numpy()
        out[grp][ys, xs] = up
    return out


def test_one_tile_trace_is_not_tiled(one_tile):
    assert np.unique(one_tile["image_token_tile"].values).size == 1
    m = vc.cam(one_tile, vc.Recipe(site="lm_resid", layer=-1, class_=0))
    assert m.dims == ("y", "x")


@pytest.mark.parametrize("upsample", ["none", "nearest", "bilinear"])
@pytest.mark.parametrize(("layer", "token"), [(-1, 0), (0, 2)])
def test_gradcam_at_lm_resid_is_over_all_tiles_then_placed(tiled, upsample, layer, token):
    A = tiled["lm_resid"].values[layer]
    G = tiled["lm_resid_grad"].values[token, layer]
    v = gradcam_tokens(A, G)
    m = vc.cam(tiled, vc.Recipe(site="lm_resid", layer=layer, class_=token, upsample=upsample))
    assert m.attrs["degenerate"] == ""
    if upsample == "none":
        assert m.dims == ("tile", "patch_row", "patch_col")
        assert list(m["tile"].values) == ["base", "left", "right"]
        assert list(m["tile_group"].values) == ["base", "crops", "crops"]
        ref = grids(v)
        for k, name in enumerate(["base", "left", "right"]):
            gh, gw = ref[name].shape
            assert_rel_close(m.values[k, :gh, :gw], ref[name], f"tile {name}")
            assert np.isnan(m.values[k, gh:]).all() and np.isnan(m.values[k, :, gw:]).all()
        return
    ref = (nearest if upsample == "nearest" else bilinear)(v)
    assert m.dims == ("view", "y", "x") and list(m["view"].values) == ["base", "crops"]
    for k, grp in enumerate(["base", "crops"]):
        assert_rel_close(m.values[k], ref[grp], f"{grp} at {upsample}")


def test_weights_come_from_all_tiles_not_per_tile(tiled):
    """The per-tile Grad-CAM (weights from one tile's tokens) differs: the map really is the joint one."""
    A, G = tiled["lm_resid"].values[-1], tiled["lm_resid_grad"].values[0, -1]
    sel = CELLS[:, 0] == 1
    per_tile = minmax(np.maximum(A[sel] @ G[sel].mean(axis=0), 0))
    joint = gradcam_tokens(A, G)[sel]
    assert np.abs(per_tile - minmax(joint)).max() > 1e-2


def test_layer_fusion_and_lm_attn_heads(tiled):
    # two LM layers, each min-maxed over all tokens, averaged, min-maxed again
    per = [gradcam_tokens(tiled["lm_resid"].values[i], tiled["lm_resid_grad"].values[1, i]) for i in range(2)]
    m = vc.cam(tiled, vc.Recipe(site="lm_resid", layer="all", layer_fusion="mean", class_=1, upsample="none"))
    got = np.concatenate([m.values[k][~np.isnan(m.values[k])] for k in range(3)])
    ref = grids(minmax(np.mean(per, axis=0)))
    assert_rel_close(got, np.concatenate([ref[n][~np.isnan(ref[n])] for n in ("base", "left", "right")]), "fused")
    # lm_attn: heads are the channels; Grad-CAM weights each head by its mean gradient over every image token
    A = tiled["lm_attn"].values[1][:, 2]  # (head, token) of the row predicting answer token 2
    G = tiled["lm_attn_grad"].values[2, 1][:, 2]
    v = minmax(np.maximum(G.mean(axis=1) @ A, 0))
    m = vc.cam(tiled, vc.Recipe(site="lm_attn", layer=1, class_=2, weighting="gradcam", upsample="nearest"))
    ref = nearest(v)
    for k, grp in enumerate(["base", "crops"]):
        assert_rel_close(m.values[k], ref[grp], f"lm_attn {grp}")


def test_checklist_says_one_set_and_groups(tiled):
    m = vc.cam(tiled, vc.Recipe(site="projector", class_=0))
    over = json.loads(m.attrs["checklist"])["token handling"]["map over"]
    assert over.startswith("all 16 image tokens of the 3 tiles as one set") and "(base, crops)" in over


def test_trace_without_tile_boxes_is_refused(tiled):
    tr = tiled.copy(deep=True)
    tr["lm_resid"].attrs = {k: v for k, v in tr["lm_resid"].attrs.items() if k != "layout_tile_boxes"}
    with pytest.raises(vc.TraceError, match="stores no tile boxes"):
        vc.cam(tr, vc.Recipe(site="lm_resid", class_=0))
