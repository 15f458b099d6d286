"""The generative-VLM presets (issue 55, item 5) on the tiny LLaVA built in code: Grad-CAM on the tower block
LLaVA reads, and Chefer, Gur & Wolf 2021's self-attention rule over the image tokens, each against a hand-written
hook-and-autograd reference (the whole attention matrices, every token) of tests/unit/model/test_vlm_llava.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from vitcam_testing import assert_rel_close

import vitcam_nb as vc
from vitcam_nb.core.presets_vlm import tower_layer

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_vlm_llava import ANSWER, GRID, PROMPT, make_llava, make_x, reference  # noqa: E402

POS = np.arange(3, 3 + GRID * GRID)  # the image tokens' sequence positions


@pytest.fixture(scope="module")
def llava():
    return make_llava()


@pytest.fixture(scope="module")
def trace(llava):
    return vc.trace(llava, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=["F1", "F6", "lm_attn"])


@pytest.fixture(scope="module")
def refs(llava):
    return reference(llava, make_x())


def _minmax(m: np.ndarray) -> np.ndarray:
    return (m - m.min()) / (m.max() - m.min())


def test_tower_layer_is_the_block_the_projector_reads(llava):
    n = len(llava.model.vision_tower.encoder.layers)
    # LLaVA's own forward: hidden_states[vision_feature_layer] is the projector's input
    x = make_x()
    out = llava.model.vision_tower(x, output_hidden_states=True)
    kept = {}
    hook = llava.model.vision_tower.encoder.layers[tower_layer(-2, n)].register_forward_hook(
        lambda _m, _i, o: kept.__setitem__("o", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        llava.model.vision_tower(x, output_hidden_states=True)
    hook.remove()
    torch.testing.assert_close(kept["o"], out.hidden_states[-2], rtol=0, atol=0)
    assert tower_layer(-2, n) == n - 2 and tower_layer(2, n) == 1
    with pytest.raises(vc.ArgumentError, match="vision_feature_layer: 0"):
        tower_layer(0, n)


@pytest.mark.parametrize("token", [0, 1])
def test_tower_gradcam_preset_equals_reference(trace, refs, token):
    acts, grads, _ = refs
    recipe = vc.presets.vlm_tower_gradcam(token=token).replace(upsample="none")
    A, G = acts[(1, "F6")][1:], grads[(1, "F6")][token, 1:]  # block -2 = 1 of 3; class token dropped
    expected = _minmax(np.maximum(A @ G.mean(0), 0).reshape(GRID, GRID))
    got = vc.cam(trace, recipe)
    assert got.attrs["degenerate"] == ""
    assert_rel_close(got.values, expected, f"tower Grad-CAM of answer token {token}")
    # the checklist names the preset
    assert "vlm_tower_gradcam" in vc.cam(trace, vc.presets.vlm_tower_gradcam()).attrs["checklist"]


def test_tower_gradcam_at_the_unread_last_block_is_degenerate(trace):
    with pytest.warns(vc.DegenerateMapWarning, match="zero gradient"):
        m = vc.cam(trace, vc.presets.vlm_tower_gradcam(layer=-1))
    assert m.attrs["degenerate_cause"] == "zero gradient"


def _abar(acts: dict, grads: dict, layer: int, k: int) -> np.ndarray:
    """Chefer 2021b's Abar = mean_h (grad A * A)^+ over the whole sequence (L, L) for output k."""
    A, G = acts[(layer, "lm_attn")], grads[(layer, "lm_attn")][k]
    return np.maximum(A * G, 0).mean(0)


def _chefer_full(acts: dict, grads: dict, k: int, layers: list[int]) -> np.ndarray:
    """The paper's rule over all tokens: R = I, then R <- R + Abar_l R for each layer, first to last."""
    n = acts[(0, "lm_attn")].shape[-1]
    R = np.eye(n)
    for layer in layers:
        R = R + _abar(acts, grads, layer, k) @ R
    return R


@pytest.mark.parametrize("token", [0, 2])
def test_generic_attention_on_one_layer_equals_the_full_rule(trace, refs, token):
    acts, grads, _ = refs
    row = len(PROMPT) + token - 1  # the position predicting answer token `token`
    R = _chefer_full(acts, grads, token, [1])
    expected = R[row, POS].reshape(GRID, GRID)
    got = vc.cam(trace, vc.presets.vlm_generic_attention(layer=-1, token=token).replace(upsample="none"))
    assert got.attrs["degenerate"] == ""
    np.testing.assert_allclose(got.values, expected, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("token", [0, 1])
def test_generic_attention_over_all_layers_is_the_full_rule_less_its_cross_term(trace, refs, token):
    acts, grads, _ = refs
    row = len(PROMPT) + token - 1
    full = _chefer_full(acts, grads, token, [0, 1])
    # R = (I + Abar_1)(I + Abar_0) = I + Abar_0 + Abar_1 + Abar_1 Abar_0: the preset leaves out the last term
    cross = _abar(acts, grads, 1, token) @ _abar(acts, grads, 0, token)
    expected = (full - cross)[row, POS].reshape(GRID, GRID)
    got = vc.cam(trace, vc.presets.vlm_generic_attention(token=token).replace(upsample="none"))
    np.testing.assert_allclose(got.values, expected, rtol=1e-4, atol=1e-9)
    # the left-out term is real here (so the documented difference is measured, not assumed zero)
    assert np.abs(cross[row, POS]).max() > 0


def test_presets_are_in_the_taxonomy_with_citations(trace):
    from vitcam_nb.core.preset_taxonomy import TAXONOMY

    for name in ("vlm_tower_gradcam", "vlm_generic_attention"):
        assert name in vc.presets.names() and name in TAXONOMY
        assert vc.presets.citation(vc.presets.get(name)) == vc.presets.CITATIONS[name]
    assert vc.presets.CITATIONS["vlm_generic_attention"].startswith("Chefer, Gur & Wolf 2021")
    assert "vlm_generic_attention" in vc.cam(trace, vc.presets.vlm_generic_attention()).attrs["checklist"]


def test_the_preset_menu_keeps_the_taxonomy_order_when_the_vlm_presets_register_first():
    """A process that imports this module before the other preset modules (as this test file does) registers the
    VLM presets before them; the Explorer's menu still lists the taxonomy's order (it followed the registry's)."""
    import json
    import subprocess

    code = ("import vitcam_nb.core.presets_vlm, json, numpy as np, timm, vitcam_nb as vc\n"
            "from vitcam_nb.widgets.controls import preset_menu\nfrom vitcam_nb.widgets.facts import TraceFacts\n"
            "m = timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32, patch_size=8, depth=1)\n"
            "f = TraceFacts.of(vc.trace(m, np.zeros((32, 32, 3), np.uint8), targets='top1'))\n"
            "print(json.dumps([[r[0] for r in preset_menu(f)], sorted(f.sites), vc.presets.names()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    menu, sites, names = json.loads(out.stdout.strip().splitlines()[-1])
    assert menu == [n for n in names if vc.presets.get(n).site in sites]
    assert menu.index("vlm_tower_gradcam") > menu.index("tokentm")
