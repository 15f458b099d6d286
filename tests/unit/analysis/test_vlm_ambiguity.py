"""``vc.ambiguity`` on a generative VLM's answer trace (issue 55, item 5): the default space opens the tower vs
projector vs LM sites, every tower block and LM layer, and each answer token and the sequence score; each map is
vc.cam's, and the LM maps equal a Grad-CAM written here from the trace's stored arrays. Tiny LLaVA built in code."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import vitcam_nb as vc

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_vlm_llava import ANSWER, GRID, PROMPT, make_llava, make_x  # noqa: E402

REPORTED = dict(target="logit", weighting="gradcam", weight_tokens="patch", relu="after", normalize="minmax",
                upsample="none", heads="channels", attn_rows="cls")


@pytest.fixture(scope="module")
def trace():
    return vc.trace(make_llava(), make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=["F1", "F6", "projector", "lm_resid", "lm_attn"])


@pytest.fixture(scope="module")
def amb(trace):
    return vc.ambiguity(trace, reported=REPORTED)


def _gradcam(A: np.ndarray, G: np.ndarray) -> np.ndarray:
    m = np.maximum(A @ G.mean(0), 0).reshape(GRID, GRID)
    return (m - m.min()) / (m.max() - m.min())


def test_the_default_space_opens_sites_layers_and_answer_tokens(amb):
    assert amb.open == ["site", "layer", "class_"]
    assert amb.space["site"] == ("F1", "F6", "projector", "lm_resid", "lm_attn")
    assert amb.space["layer"] == (0, 1, 2) and amb.space["class_"] == (0, 1, 2, 3)  # 3: the sequence log-prob
    got = {(r.site, r.layer, r.class_) for r in amb.recipes}
    tower = {(s, layer, k) for s in ("F1", "F6") for layer in range(3) for k in range(4)}
    lm = {(s, layer, k) for s in ("lm_resid", "lm_attn") for layer in range(2) for k in range(4)}
    assert got == tower | lm | {("projector", -1, k) for k in range(4)}
    # the LM has no layer 2: those cells are skipped and counted (2 sites x 4 classes)
    assert amb.skipped == 8
    assert len(amb.recipes) == len(got) == 24 + 16 + 4


def test_each_map_is_vc_cam_and_lm_maps_equal_a_hand_written_gradcam(trace, amb):
    for recipe, values in zip(amb.recipes, amb.maps.values):
        with warnings.catch_warnings():  # the degenerate maps (zeros) are compared too
            warnings.simplefilter("ignore", vc.DegenerateMapWarning)
            expected = vc.cam(trace, recipe).values
        np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-7, err_msg=recipe.id)
    maps = {(r.site, r.layer, r.class_): v for r, v in zip(amb.recipes, amb.maps.values)}
    for k in (0, 3):
        np.testing.assert_allclose(maps[("lm_resid", 1, k)], _gradcam(trace["lm_resid"].values[1],
                                                                      trace["lm_resid_grad"].values[k, 1]),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(maps[("projector", -1, k)], _gradcam(trace["projector"].values,
                                                                        trace["projector_grad"].values[k]),
                                   rtol=1e-5, atol=1e-6)
    # the tower block LLaVA never reads (2) gives zero maps: degenerate, counted
    assert amb.degenerate >= 8
    assert amb.sensitivity.fields["site"] > 0 and "class_" in amb.sensitivity.fields


def test_a_reported_lm_site_opens_the_lm_layers_and_tokens_only(trace):
    a = vc.ambiguity(trace, reported={**REPORTED, "site": "lm_resid"})
    assert a.open == ["layer", "class_"]
    assert {(r.layer, r.class_) for r in a.recipes} == {(layer, k) for layer in range(2) for k in range(4)}



def test_open_upsampling_compares_lm_maps_on_the_image_grid_as_vc_cam_gives_them(trace):
    reported = {k: v for k, v in REPORTED.items() if k != "upsample"}
    a = vc.ambiguity(trace, reported={**reported, "site": "lm_resid", "class_": 0})
    assert a.open == ["layer", "upsample"] and a.maps.attrs["grid"] == "image grid"
    for recipe, values in zip(a.recipes, a.maps.values):
        expected = vc.cam(trace, recipe).values
        if recipe.upsample == "none":  # the token grid shown as blocks: each image token over its 8 px patch
            expected = np.repeat(np.repeat(expected, 8, 0), 8, 1)
        np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-7, err_msg=recipe.id)
