"""``vc.ambiguity(trace, mask=...)`` on answer traces compared per tile group (issue 55): the mask is the object on
the original image; each consistent map is placed on it per view (a tower map on crops: each crop's cells in its
box; a multi-tile LM map: each tile's cells in its box) and the pointing game is scored per view, a recipe
localising when it points at the object in every view. Checked against a reference written here with NumPy from
the trace's stored arrays (Grad-CAM, nearest-cell placement by loops, the tolerance 15 px at 224 px, distances by
brute force) on a tiny LLaVA-NeXT (60x70 image, base view + 2x2 crops) and a tiny Idefics3 (2x2 tiles + global)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import vitcam_nb as vc

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
import test_vlm_idefics as idefics  # noqa: E402
from anyres_cases import SIZE, pixels, target  # noqa: E402
from anyres_cases import make as make_anyres  # noqa: E402
from test_vlm_llava import ANSWER, GRID, PROMPT, make_llava, make_x  # noqa: E402
from vlm_reference import gradcam, lm_views, tower_views  # noqa: E402

FIXED = dict(target="logit", weighting="gradcam", weight_tokens="patch", relu="after", normalize="minmax",
             heads="channels", attn_rows="cls")

def pointing(view, mask):
    """The share of the view's peak pixels within 15 px at 224 px (scaled) of the mask; a constant view misses."""
    held = ~np.isnan(view)
    if np.ptp(view[held]) == 0:
        return 0.0
    tol = 15.0 * np.sqrt(mask.size) / 224.0
    yy, xx = np.nonzero(mask)
    peaks = np.argwhere(held & (view == view[held].max()))
    near = [np.min((yy - py) ** 2 + (xx - px) ** 2) <= tol ** 2 for py, px in peaks]
    return float(np.mean(near))


def reference(tr, recipes, mask):
    table = []
    for r in recipes:
        views = (tower_views if r.site == "F1" else lm_views)(tr, r.layer, r.class_, mask.shape)
        table.append({g: pointing(v, mask) for g, v in views.items()})
    groups = list(table[0])
    shares = np.array([[t[g] for g in groups] for t in table])
    return float(shares.prod(axis=1).mean()), dict(zip(groups, shares.mean(axis=0).tolist())), shares


def masks(size):
    """An object in each quadrant of the image and one at its centre."""
    h, w = size
    out = []
    for top, left in ((0, 0), (0, w // 2), (h // 2, 0), (h // 2, w // 2), (h // 3, w // 3)):
        m = np.zeros(size, bool)
        m[top:top + h // 3, left:left + w // 3] = True
        out.append(m)
    return out


@pytest.fixture(scope="module")
def next_trace():
    return vc.trace(make_anyres("next"), pixels(), targets=target("next"), sites=["F1", "lm_resid"])


@pytest.fixture(scope="module")
def idefics_trace():
    return vc.trace(idefics.make("idefics3"), idefics.make_x(), sites=["F1", "lm_resid"],
                    targets=vc.targets.answer(input_ids=idefics.PROMPT, answer_ids=idefics.ANSWER))


@pytest.mark.parametrize("upsample", ["none", "nearest"])
def test_llava_next_pointing_per_view_equals_numpy(next_trace, upsample):
    seen = set()
    for mask in masks(SIZE):
        amb = vc.ambiguity(next_trace, reported={**FIXED, "upsample": upsample}, space={"class_": [0, 2]},
                           mask=mask)
        assert {r.site for r in amb.recipes} == {"F1", "lm_resid"} and len(amb.recipes) == 10
        want, views, shares = reference(next_trace, amb.recipes, mask)
        assert list(amb.localises_views) == ["base", "tiles"] == list(views)
        assert amb.localises == pytest.approx(want, abs=1e-12)
        for g in views:
            assert amb.localises_views[g] == pytest.approx(views[g], abs=1e-12)
        seen.add(tuple(np.round(shares.ravel(), 6)))
        assert "in every view (base " in amb.report() and amb.to_dict()["localises_views"] == amb.localises_views
        assert "pointing game on the 60x70 original image" in amb.maps.attrs["comparison"]
    assert len(seen) == 5  # each object place gives its own hits: the masks are read where they lie


def test_idefics3_pointing_on_any_image_size_equals_numpy(idefics_trace):
    size = (48, 40)  # no stated size: the boxes are fractions of the image
    hits = []
    for mask in masks(size):
        amb = vc.ambiguity(idefics_trace, reported={**FIXED, "upsample": "none"}, space={"class_": [1]}, mask=mask)
        want, views, _ = reference(idefics_trace, amb.recipes, mask)
        assert set(amb.localises_views) == {"tiles", "global"} == set(views)
        assert amb.localises == pytest.approx(want, abs=1e-12)
        for g in views:
            assert amb.localises_views[g] == pytest.approx(views[g], abs=1e-12)
        hits.append(amb.localises_views["tiles"])
    assert len(set(hits)) > 1


def test_views_are_never_averaged(next_trace):
    """A recipe hits in one view only: it counts as a miss in ``localises`` while each view's share says where."""
    amb = vc.ambiguity(next_trace, reported={**FIXED, "upsample": "none", "site": "lm_resid", "layer": 1,
                                             "class_": 0}, mask=masks(SIZE)[0])
    _, views, shares = reference(next_trace, amb.recipes, masks(SIZE)[0])
    assert amb.localises == pytest.approx(float(np.prod(shares[0])))
    assert amb.localises_views == pytest.approx(views)


def test_a_mask_of_the_wrong_image_is_refused_before_any_map(next_trace, monkeypatch):
    vlm_maps = sys.modules["vitcam_nb.evaluate.ambiguity.vlm_maps"]
    monkeypatch.setattr(vlm_maps, "_groups", lambda *a: pytest.fail("a map was computed"))
    with pytest.raises(vc.ArgumentError, match=r"mask: shape \(32, 32\) is not the original image's"):
        vc.ambiguity(next_trace, reported={**FIXED, "upsample": "none"}, mask=np.ones((32, 32), bool))
    with pytest.raises(vc.ArgumentError, match="mask"):
        vc.ambiguity(next_trace, reported={**FIXED, "upsample": "none"}, mask=np.zeros(SIZE, bool))


def test_the_plot_outlines_the_mask_on_each_compared_view(next_trace):
    mask = masks(SIZE)[1]
    amb = vc.ambiguity(next_trace, reported={**FIXED, "upsample": "none", "class_": 0}, mask=mask)
    assert amb.mask.shape == amb.maps.shape[1:] == (64, 32)
    # the mask read at the 32x32 canvas's pixel centres, once per view (base, tiles)
    ys, xs = ((np.arange(32) + 0.5) * 60 / 32).astype(int), ((np.arange(32) + 0.5) * 70 / 32).astype(int)
    np.testing.assert_array_equal(amb.mask, np.concatenate([mask[np.ix_(ys, xs)]] * 2))
    assert len(amb.plot().axes) == 10


def test_an_lm_only_trace_scores_its_one_view_on_the_traced_image():
    """LLaVA with no tower site: one grid on the 32x32 image the tower saw, one view ("image")."""
    tr = vc.trace(make_llava(), make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                  sites=["lm_resid"])
    block = 32 // GRID
    for mask in masks((32, 32)):
        amb = vc.ambiguity(tr, reported={**FIXED, "upsample": "none", "site": "lm_resid"}, mask=mask)
        got = []
        for r in amb.recipes:
            cells = gradcam(tr["lm_resid"].values[r.layer], tr["lm_resid_grad"].values[r.class_, r.layer])
            got.append(pointing(np.kron(cells.reshape(GRID, GRID), np.ones((block, block))), mask))
        assert list(amb.localises_views) == ["image"]
        assert amb.localises == pytest.approx(np.mean(got), abs=1e-12) == amb.localises_views["image"]
    with pytest.raises(vc.ArgumentError, match=r"mask: shape \(60, 70\) is not the traced image's \(32, 32\)"):
        vc.ambiguity(tr, reported=FIXED, mask=np.ones(SIZE, bool))


@pytest.mark.parametrize("upsample", ["nearest", "bilinear"])
def test_placing_on_the_canvas_size_gives_back_vc_cam(next_trace, upsample):
    """The per-token values the pointing game re-places (read off the "none" map) are vc.cam's: placed at the canvas
    size they give its (view, y, x) maps bitwise."""
    from vitcam_nb.evaluate.ambiguity.vlm_pointing import on_mask

    recipe = vc.Recipe(site="lm_resid", layer=1, class_=2, upsample=upsample)
    m = vc.cam(next_trace, recipe)
    placed = on_mask(next_trace, recipe, m, (32, 32))
    assert list(placed) == [str(v) for v in m["view"].values]
    for k, g in enumerate(placed):
        np.testing.assert_array_equal(placed[g], m.values[k])
