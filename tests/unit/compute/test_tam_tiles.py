"""TAM on a multi-tile image-token layout (issue 55, item 5): the tiny LLaVA's ``lm_logit`` trace with its 16 image
tokens re-laid as the synthetic any-resolution layout of test_vlm_multitile (a 2x4 base view over the image, two
2x2 crops side by side, tokens out of raster order). Against a reference written here: steps 1-3 from the model's
own logits over all 16 tokens (test_tam's), then the rank Gaussian filter by explicit loops on each tile's grid
alone (never across a seam), min-max over all tokens, each tile placed in its box (test_vlm_multitile's nearest /
bilinear placement), one map per tile group."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import vitcam_nb as vc
from vitcam_nb.compute.tam_tiles import filter_tiles

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_tam import ANSWER, SEQ, filter_reference, scores_reference  # noqa: E402
from test_vlm_llava import PROMPT, make_llava, make_x  # noqa: E402
from test_vlm_multitile import CELLS, TILES, bilinear, grids, nearest  # noqa: E402


def relaid(trace, cells, tiles):
    tr = trace.assign_coords(image_token_tile=("image_token", cells[:, 0]),
                             image_token_row=("image_token", cells[:, 1]),
                             image_token_col=("image_token", cells[:, 2]))
    boxes = json.dumps([{"name": n, "grid": list(g), "box": list(b), "group": grp} for n, g, b, grp in tiles])
    for name in ("lm_logit", "lm_logit_text"):
        tr[name].attrs["layout_tile_boxes"] = boxes
    return tr


@pytest.fixture(scope="module")
def llava():
    return make_llava()


@pytest.fixture(scope="module")
def tiled(llava):
    tr = vc.trace(llava, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                  sites=["lm_logit"])
    return relaid(tr, CELLS, TILES)


@pytest.fixture(scope="module")
def logits(llava):
    with torch.no_grad():
        return llava(input_ids=torch.tensor([SEQ]), pixel_values=make_x()).logits[0].double().numpy()


def per_tile_reference_raw(scores: np.ndarray) -> np.ndarray:
    """Each tile's grid (its cells of the 16 tokens) filtered alone by the loops, read back per token."""
    out = np.empty_like(scores)
    for t, (_, (gh, gw), _, _) in enumerate(TILES):
        sel = CELLS[:, 0] == t
        grid = np.full((gh, gw), np.nan)
        grid[CELLS[sel, 1], CELLS[sel, 2]] = scores[sel]
        out[sel] = filter_reference(grid)[CELLS[sel, 1], CELLS[sel, 2]]
    return out


def per_tile_reference(scores: np.ndarray) -> np.ndarray:
    """The per-tile filtered values min-maxed over all tokens as one set."""
    out = per_tile_reference_raw(scores)
    return (out - out.min()) / (out.max() - out.min())


@pytest.mark.parametrize("token", [0, 2, 4])
@pytest.mark.parametrize("upsample", ["none", "nearest", "bilinear"])
def test_tam_is_filtered_per_tile_then_placed_per_group(tiled, logits, token, upsample):
    v = per_tile_reference(scores_reference(logits, token))
    recipe = vc.presets.tam(token=token).replace(upsample=upsample, normalize="minmax")
    m = vc.cam(tiled, recipe)
    assert m.attrs["degenerate"] == ""
    if upsample == "none":
        assert m.dims == ("tile", "patch_row", "patch_col") and list(m["tile"].values) == ["base", "left", "right"]
        ref = grids(v)
        for k, name in enumerate(["base", "left", "right"]):
            gh, gw = ref[name].shape
            np.testing.assert_allclose(m.values[k, :gh, :gw], ref[name], rtol=0, atol=2e-5, err_msg=name)
        return
    ref = (nearest if upsample == "nearest" else bilinear)(v)
    assert m.dims == ("view", "y", "x") and list(m["view"].values) == ["base", "crops"]
    for k, grp in enumerate(["base", "crops"]):
        np.testing.assert_allclose(m.values[k], ref[grp], rtol=0, atol=2e-5, err_msg=grp)
    # compute() (vc.map_many's path) gives the same stacked maps
    from vitcam_nb.compute.tam import TAM_FORM
    np.testing.assert_allclose(TAM_FORM.compute(tiled, recipe)[0], m.values, rtol=0, atol=0)


def test_the_filter_does_not_cross_a_seam(tiled, logits):
    """Filtering the two crops as one 2x4 grid (the seam crossed) gives other values: per tile is what ran."""
    s = scores_reference(logits, 1)
    crops = CELLS[:, 0] > 0
    joint = np.full((2, 4), np.nan)
    joint[CELLS[crops, 1], CELLS[crops, 2] + 2 * (CELLS[crops, 0] - 1)] = s[crops]
    across = filter_reference(joint)[CELLS[crops, 1], CELLS[crops, 2] + 2 * (CELLS[crops, 0] - 1)]
    from vitcam_nb.compute.tam import tam_tokens
    got = tam_tokens(tiled, vc.presets.tam(token=1))[0]
    np.testing.assert_allclose(got, per_tile_reference_raw(s), rtol=0, atol=2e-5)
    assert np.abs(got[crops] - across).max() > 1e-3


def test_the_checklist_states_the_per_tile_filter_and_a_thin_tile_is_left_unfiltered(tiled, llava, logits):
    m = vc.cam(tiled, vc.presets.tam(token=2))
    sr = json.loads(m.attrs["checklist"])["spatial reconstruction"]
    assert "never across a tile seam" in sr["raster order"] and "one map per tile group" in sr["raster order"]
    # a 3x4 base and two 1x2 strips: the strips have no 3x3 window; they keep their scores, and the checklist says so
    tiles = [("base", (3, 4), (0.0, 0.0, 1.0, 1.0), "base"), ("a", (1, 2), (0.0, 0.0, 1.0, 0.5), "strip"),
             ("b", (1, 2), (0.0, 0.5, 1.0, 1.0), "strip")]
    cells = np.array([(0, r, c) for r in range(3) for c in range(4)] + [(1, 0, 0), (1, 0, 1), (2, 0, 0), (2, 0, 1)])
    thin = relaid(tiled, cells, tiles)
    from vitcam_nb.compute.tam import tam_tokens
    got, info = tam_tokens(thin, vc.presets.tam(token=2))
    s = scores_reference(logits, 2)
    np.testing.assert_allclose(got[12:], s[12:], rtol=0, atol=2e-5)
    np.testing.assert_allclose(got[:12], filter_reference(s[:12].reshape(3, 4)).ravel(), rtol=0, atol=2e-5)
    assert [n.split(":")[0] for n in info["tiles"]] == ["tile a", "tile b"]
    text = json.loads(vc.cam(thin, vc.presets.tam(token=2)).attrs["checklist"])["spatial reconstruction"]
    assert "tile a: its tokens hold 1x2 cells" in text["raster order"]


def test_a_tile_with_a_hole_is_refused_by_name(tiled):
    cells = CELLS.copy()
    cells[CELLS[:, 0] == 1] = [(1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 0, 0)]  # a repeated cell, one left empty
    with pytest.raises(vc.TraceError, match="tile 'left'"):
        vc.cam(relaid(tiled, cells, TILES), vc.presets.tam(token=0))
    assert filter_tiles  # imported for its doctest's sake: the module is the one under test


def test_llava_next_tam_filters_each_unpadded_tile_alone():
    """A real any-resolution layout (base 4x4, four crops unpadded to 6x8 cells in all): each crop holds a 3x4
    rectangle of its 4x4 grid; the filter runs on that rectangle alone (loops here), after steps 1-3 over all 64
    tokens (the kit's tam_scores, tested against the equations in test_tam)."""
    from anyres_cases import make as make_anyres
    from anyres_cases import pixels, target

    from vitcam_nb.compute.tam import tam_tokens
    from vitcam_nb.compute.tam_formula import tam_scores

    tr = vc.trace(make_anyres("next"), pixels(), targets=target("next"), sites=["lm_logit"])
    tiles = json.loads(tr["lm_logit"].attrs["layout_tile_boxes"])
    assert len(tiles) == 5
    scores = tam_scores(tr["lm_logit"].values, tr["lm_logit_text"].values, tr["lm_slot_class"].values,
                        int((tr["lm_slot_kind"].values == "prompt").sum()), 1)[0]
    tile_of, rows, cols = (tr[f"image_token_{k}"].values for k in ("tile", "row", "col"))
    expected = np.empty_like(scores)
    shapes = []
    for t in range(len(tiles)):
        sel = tile_of == t
        r0, c0 = rows[sel].min(), cols[sel].min()
        h, w = rows[sel].max() - r0 + 1, cols[sel].max() - c0 + 1
        shapes.append((int(h), int(w)))
        grid = np.full((h, w), np.nan)
        grid[rows[sel] - r0, cols[sel] - c0] = scores[sel]
        assert not np.isnan(grid).any()
        expected[sel] = filter_reference(grid)[rows[sel] - r0, cols[sel] - c0]
    assert shapes == [(4, 4), (3, 4), (3, 4), (3, 4), (3, 4)]
    got, info = tam_tokens(tr, vc.presets.tam(token=1))
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert info["tiles"] == []
    m = vc.cam(tr, vc.presets.tam(token=1))
    assert m.dims == ("view", "y", "x") and list(m["view"].values) == ["base", "tiles"]
