"""``vc.ambiguity`` on answer traces beyond LLaVA's one grid (issue 55, item 5): an LM-only trace (no tower site)
opens its LM sites, TAM's ``lm_logit``, the LM layers and answer tokens instead of refusing; a LLaVA-NeXT trace
(tower on 5 crops, image tokens over 5 tiles) opens tower vs LM sites, compared on the image per tile group. Each
compared map equals one written here from the stored arrays: Grad-CAM by NumPy, each crop or tile placed by
nearest cell in its box by loops, the groups (base, tiles) stacked top to bottom; TAM from the model's logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import vitcam_nb as vc

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compute"))
from anyres_cases import make as make_anyres  # noqa: E402
from anyres_cases import pixels, target  # noqa: E402
from test_tam import ANSWER, SEQ, tam_reference  # noqa: E402
from test_vlm_llava import GRID, PROMPT, make_llava, make_x  # noqa: E402
from vlm_reference import gradcam, lm_views, minmax, tower_views  # noqa: E402

FIXED = dict(target="logit", weighting="gradcam", weight_tokens="patch", relu="after", normalize="minmax",
             upsample="none", heads="channels", attn_rows="cls")


@pytest.fixture(scope="module")
def llava():
    return make_llava()


@pytest.fixture(scope="module")
def lm_only(llava):
    return vc.trace(llava, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=["lm_resid", "lm_logit"])


def test_an_lm_only_trace_opens_its_lm_sites_and_tam(llava, lm_only):
    amb = vc.ambiguity(lm_only, reported={k: v for k, v in FIXED.items() if k not in ("weighting", "target")})
    assert amb.space["site"] == ("lm_resid", "lm_logit") and amb.space["layer"] == (0, 1)
    assert amb.space["class_"] == tuple(range(len(ANSWER) + 1))  # the answer tokens, then the sequence score
    got = {(r.site, r.layer, r.class_, r.weighting, r.target) for r in amb.recipes}
    tam = {(r.site, r.class_) for r in amb.recipes if r.weighting == "tam"}
    assert tam == {("lm_logit", k) for k in range(len(ANSWER))}  # no TAM of the sequence score: skipped
    assert all(t == "logit" and w == "tam" and layer == -1 for s, layer, _, w, t in got if s == "lm_logit")
    with torch.no_grad():
        logits = llava(input_ids=torch.tensor([SEQ]), pixel_values=make_x()).logits[0].double().numpy()
    blocks = 32 // GRID
    for recipe, values in zip(amb.recipes, amb.maps.values):
        if recipe.site == "lm_logit":
            ref = minmax(tam_reference(logits, recipe.class_))
            np.testing.assert_allclose(values, np.kron(ref, np.ones((blocks, blocks))), atol=5e-5, err_msg=recipe.id)
        elif recipe.weighting == "gradcam" and recipe.target == "logit":
            k = recipe.class_  # target logit: the traced entry of the class (the last: the sequence log-prob)
            ref = gradcam(lm_only["lm_resid"].values[recipe.layer],
                          lm_only["lm_resid_grad"].values[k, recipe.layer]).reshape(GRID, GRID)
            np.testing.assert_allclose(values, np.kron(ref, np.ones((blocks, blocks))), atol=1e-5, err_msg=recipe.id)
    assert "(image)" in amb.maps.attrs["comparison"] and json.loads(amb.maps.attrs["absent_sites"]) == {}
    # a tower site named in space= is skipped with its reason, not refused
    a = vc.ambiguity(lm_only, reported={**FIXED, "class_": 0}, space={"site": ["F1", "lm_resid"]})
    assert {r.site for r in a.recipes} == {"lm_resid"} and a.skipped > 0
    assert "no tower site" in json.loads(a.maps.attrs["absent_sites"])["F1"]


@pytest.fixture(scope="module")
def anyres():
    return vc.trace(make_anyres("next"), pixels(), targets=target("next"), sites=["F1", "lm_resid", "lm_logit"])


def tower_reference(tr, layer: int, k: int) -> np.ndarray:
    """Grad-CAM of F1 per crop (min-max per crop, as each crop's own map), each crop in its box, groups stacked."""
    groups = tower_views(tr, layer, k, (tr.sizes["y"], tr.sizes["x"]))
    return np.concatenate([groups["base"], groups["tiles"]])


def lm_reference(tr, layer: int, k: int) -> np.ndarray:
    """Grad-CAM of lm_resid over all image tokens, each tile's cells in its box, groups stacked."""
    groups = lm_views(tr, layer, k, (tr.sizes["y"], tr.sizes["x"]))
    return np.concatenate([groups["base"], groups["tiles"]])


def test_a_crops_trace_compares_tower_and_lm_maps_per_tile_group(anyres):
    amb = vc.ambiguity(anyres, reported=FIXED, space={"class_": [0, 3]})
    assert amb.space["site"] == ("F1", "lm_resid", "lm_logit")
    assert {r.site for r in amb.recipes} == {"F1", "lm_resid"}  # TAM is not Grad-CAM: no recipe at lm_logit
    assert amb.space["layer"] == (0, 1, 2) and amb.open == ["site", "layer", "class_"]
    assert amb.maps.shape[1:] == (64, 32)  # base and tiles stacked on the 32x32 canvas
    assert "(base, tiles)" in amb.maps.attrs["comparison"]
    for recipe, values in zip(amb.recipes, amb.maps.values):
        k = recipe.class_
        if recipe.site == "F1":
            ref = tower_reference(anyres, recipe.layer, k)
        else:
            ref = lm_reference(anyres, recipe.layer, k)
        assert not np.isnan(ref).any()  # both groups cover the canvas: nothing set to 0
        np.testing.assert_allclose(values, ref, atol=1e-5, err_msg=recipe.id)
    assert {(r.site, r.layer) for r in amb.recipes} == {("F1", 0), ("F1", 1), ("F1", 2), ("lm_resid", 0),
                                                         ("lm_resid", 1)}
    assert amb.sensitivity.fields["site"] >= 0 and amb.report().startswith("The description")


def test_tam_joins_on_a_crops_trace_when_the_weighting_is_open(anyres):
    reported = {k: v for k, v in FIXED.items() if k not in ("weighting",)}
    amb = vc.ambiguity(anyres, reported={**reported, "class_": 1, "layer": -1},
                       space={"site": ["lm_resid", "lm_logit"], "weighting": ["gradcam"]})
    assert {(r.site, r.weighting) for r in amb.recipes} == {("lm_resid", "gradcam"), ("lm_logit", "tam")}
    tam = [v for r, v in zip(amb.recipes, amb.maps.values) if r.site == "lm_logit"][0]
    m = vc.cam(anyres, vc.presets.tam(token=1).replace(upsample="nearest", normalize="minmax"))
    np.testing.assert_allclose(tam, np.concatenate([m.sel(view="base").values, m.sel(view="tiles").values]),
                               atol=1e-6)


def test_qwen_lm_maps_of_another_grid_are_compared_on_the_image():
    """Qwen2-VL: 6x10 tower patches, 3x5 merged image tokens; the LM site joins, compared on the 84x140 image at
    its sampling stride (2), where a 3x5 grid drawn as nearest blocks covers 28 px per token."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from vlm_qwen_tiny import tiny_qwen

    model, pv, tgt = tiny_qwen()
    tr = vc.trace(model, pv, targets=tgt, sites=["F1", "lm_resid"])
    amb = vc.ambiguity(tr, reported={**FIXED, "class_": 1})
    assert amb.space["site"] == ("F1", "lm_resid") and amb.maps.attrs["stride"] == 2
    assert {(r.site, r.layer) for r in amb.recipes} == {("F1", 0), ("F1", 1), ("F1", 2), ("lm_resid", 0),
                                                         ("lm_resid", 1)}
    for recipe, values in zip(amb.recipes, amb.maps.values):
        if recipe.site != "lm_resid":
            continue
        v = gradcam(tr["lm_resid"].values[recipe.layer], tr["lm_resid_grad"].values[1, recipe.layer])
        cells = np.zeros((3, 5))
        cells[tr["image_token_row"].values, tr["image_token_col"].values] = v
        ref = np.kron(cells, np.ones((28, 28)))[1::2, 1::2]
        np.testing.assert_allclose(values, ref, atol=1e-5, err_msg=recipe.id)


def test_the_report_states_the_comparison_and_the_skipped_sites(lm_only):
    a = vc.ambiguity(lm_only, reported={**FIXED, "class_": 0}, space={"site": ["F6", "lm_resid"]})
    text = a.report()
    assert "per tile group and compared on the groups every map has (image)" in text
    assert "Site F6 skipped: an LM-only trace (no tower site)" in text
