"""The token activation map (TAM; Li et al., ICCV 2025; issue 55 item 5) on the tiny LLaVA built in code: the
``lm_logit`` site equals the model's own logits at the image tokens and the context slots, and ``vc.presets.tam``
equals a reference written here from the method's equations (estimated causal inference by least squares, joint
min-max with the context's text scores, rank Gaussian filter by explicit loops) on the model's own forward; the
filter and the least-squares scale against direct computations on known arrays; bad input refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import vitcam_nb as vc
from vitcam_nb.compute.tam_formula import eci_scale, rank_gaussian_filter, tam_scores

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_vlm_llava import GRID, IMAGE_ID, PROMPT, make_llava, make_x  # noqa: E402

# Answer tokens repeating a prompt token (7) and an earlier answer token (9): both left out of the interference.
ANSWER = [9, 7, 12, 9, 10]
SEQ = PROMPT + ANSWER
IMAGE_POS = np.flatnonzero(np.array(SEQ) == IMAGE_ID)


@pytest.fixture(scope="module")
def llava():
    return make_llava()


@pytest.fixture(scope="module")
def trace(llava):
    return vc.trace(llava, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=["lm_logit"])


@pytest.fixture(scope="module")
def logits(llava):
    """The model's own logits at every position of prompt + answer (one forward, no hook)."""
    with torch.no_grad():
        out = llava(input_ids=torch.tensor([SEQ]), pixel_values=make_x())
    return out.logits[0].double().numpy()


# --------------------------------------------------------------------------------------------------
# references written from the equations


def filter_reference(img: np.ndarray, size: int = 3) -> np.ndarray:
    """Rank Gaussian filter by explicit loops: per pixel, the reflected window sorted, Gaussian weights over the
    rank offsets with sigma = std / mean (coefficient of variation); 0 where the mean is not positive; a constant
    positive window (sigma 0) keeps its value (the weights' limit: all on the middle rank)."""
    half, n = size // 2, size * size
    pad = np.pad(img.astype(np.float64), half, mode="reflect")
    offsets = np.arange(n) - n // 2
    out = np.zeros(img.shape)
    for i in range(img.shape[0]):
        for j in range(img.shape[1]):
            values = sorted(pad[i:i + size, j:j + size].ravel().tolist())
            mean = sum(values) / n
            if mean <= 0:
                continue
            sigma = (sum((v - mean) ** 2 for v in values) / n) ** 0.5 / mean
            if sigma == 0:
                out[i, j] = values[n // 2]
                continue
            weights = [np.exp(-(o * o) / (2 * sigma * sigma)) for o in offsets]
            out[i, j] = sum(v * w for v, w in zip(values, weights)) / sum(weights)
    return out


def tam_reference(logits: np.ndarray, token: int) -> np.ndarray:
    """TAM of answer token ``token`` on the 4x4 grid, from the full logits (position, vocabulary)."""
    return filter_reference(scores_reference(logits, token).reshape(GRID, GRID))


def scores_reference(logits: np.ndarray, token: int) -> np.ndarray:
    """Steps 1-3 (before the filter) of answer token ``token`` per image token, from the full logits."""
    n_prompt_seq = len(PROMPT)
    answer_pos = np.arange(n_prompt_seq, len(SEQ))
    # context slots: prompt text after the image but its last token (own id, read at its position), then each
    # answer token at its predicting position
    slots = [(p, SEQ[p]) for p in range(IMAGE_POS[-1] + 1, n_prompt_seq - 1)]
    slots += [(p - 1, SEQ[p]) for p in answer_pos]
    own = len(slots) - len(ANSWER) + token
    cls = SEQ[answer_pos[token]]
    relu = lambda a: np.maximum(a, 0)  # noqa: E731
    maps = [relu(logits[IMAGE_POS, c]) for _, c in slots]
    text = [relu(logits[p, cls]) for p, _ in slots[:own + 1]]
    m = maps[own]
    keep = [s for s in range(own) if slots[s][1] != cls]
    if keep:
        w = np.array([text[s] for s in keep])
        w = w / (w.sum() + 1e-8)
        interference = sum(wi * maps[s] for wi, s in zip(w, keep))
        lam = np.linalg.lstsq(interference[:, None], m, rcond=None)[0][0]
        m = relu(m - lam * interference)
    joint = np.concatenate([m, text[:own]])
    return (m - joint.min()) / (joint.max() - joint.min())


# --------------------------------------------------------------------------------------------------


def test_the_site_holds_the_models_own_logits_at_the_image_tokens_and_the_slots(trace, logits):
    pos, cls = trace["lm_slot_pos"].values, trace["lm_slot_class"].values
    first_answer = len(PROMPT)
    assert pos.tolist() == [first_answer - 2, *range(first_answer - 1, len(SEQ) - 1)]  # token 7, then P_m - 1
    assert cls.tolist() == [7, *ANSWER]
    assert trace["lm_slot_kind"].values.tolist() == ["prompt"] + ["answer"] * len(ANSWER)
    np.testing.assert_allclose(trace["lm_logit"].values, logits[IMAGE_POS][:, cls].T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trace["lm_logit_text"].values, logits[pos][:, ANSWER].T, rtol=1e-5, atol=1e-6)
    assert trace["lm_logit"].attrs["hook"] == "model.language_model.norm:output"
    assert trace["lm_logit"].attrs["head"] == "lm_head"
    assert "lm_logit_grad" not in trace.variables  # TAM reads no gradient


@pytest.mark.parametrize("token", range(len(ANSWER)))
def test_tam_preset_equals_the_reference_from_the_equations(trace, logits, token):
    got = vc.cam(trace, vc.presets.tam(token=token).replace(upsample="none"))
    expected = tam_reference(logits, token)
    assert np.ptp(expected) > 0.01  # a real map, not a constant (the joint min-max with the text sets its scale)
    np.testing.assert_allclose(got.values, expected, rtol=0, atol=2e-5)
    assert got.attrs["degenerate"] == ""


def test_the_interference_is_removed_and_repeats_are_left_out(trace):
    from vitcam_nb.compute.tam import tam_grid

    info = {k: tam_grid(trace, vc.presets.tam(token=k))[1] for k in range(len(ANSWER))}
    assert info[1]["repeats"] == 1 and info[1]["weighed"] == 1  # token 7 repeats the prompt's 7
    assert info[3]["repeats"] == 1 and info[3]["weighed"] == 3  # the second 9 repeats answer token 0
    assert info[4]["repeats"] == 0 and info[4]["lambda"] > 0
    # upsampled: the kit's bilinear resize of the grid map to the input, no further normalisation
    full = vc.cam(trace, vc.presets.tam(token=4))
    grid = vc.cam(trace, vc.presets.tam(token=4).replace(upsample="none"))
    assert full.shape == (32, 32) and 0 <= float(full.min()) and float(full.max()) <= float(grid.max()) + 1e-6


def test_the_checklist_names_the_method_its_source_and_its_differences(trace):
    m = vc.cam(trace, vc.presets.tam(token=2))
    checklist = json.loads(m.attrs["checklist"])
    assert "tam" in json.loads(vc.cam(trace, vc.presets.tam()).attrs["checklist"])["recipe"]["preset"]
    method = checklist["recipe"]["method"]
    assert "Li, Wang, Ding, Wang & Li 2025" in method and "xmed-lab/TAM" in method
    for difference in ("teacher-forced", "special ids", "off-by-one", "minimize_scalar", "NaN", "uint8"):
        assert difference in method, difference
    assert "lambda = " in checklist["token handling"]["weight tokens"]
    assert "Token activation map" in m.attrs["methods"]
    # a report without a trace goes to the same form
    assert "tam" in vc.presets.tam().checklist()["aggregation"]["weighting"]


def test_default_sites_leave_the_logit_lens_out(llava):
    tr = vc.trace(llava, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER[:1]),
                  sites=None, layers=[0])
    assert "lm_logit" not in tr.variables and "lm_attn" in tr.variables


# --------------------------------------------------------------------------------------------------
# the two steps against direct computations


def test_rank_gaussian_filter_equals_the_loops_on_a_known_array():
    known = np.array([[0.0, 0.2, 0.9, 0.4, 0.1],
                      [0.3, 1.0, 0.8, 0.0, 0.0],
                      [0.5, 0.5, 0.5, 0.7, 0.2],
                      [0.0, 0.0, 0.1, 0.6, 0.3]])
    np.testing.assert_allclose(rank_gaussian_filter(known), filter_reference(known), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(rank_gaussian_filter(known, 5), filter_reference(known, 5), rtol=1e-12)
    rng = np.random.default_rng(0)
    signed = rng.normal(size=(6, 7))  # windows with a negative mean give 0
    np.testing.assert_allclose(rank_gaussian_filter(signed), filter_reference(signed), rtol=1e-12, atol=1e-15)
    assert (rank_gaussian_filter(signed)[filter_reference(signed) == 0] == 0).all()
    const = np.full((3, 4), 0.25)
    np.testing.assert_array_equal(rank_gaussian_filter(const), const)  # sigma = 0: the value itself
    # one window by hand: the centre of [[0, 1, 0], [0, 2, 0], [0, 1, 0]] sorts to 0 x6, 1, 1, 2
    hand = np.array([[0.0, 1.0, 0.0], [0.0, 2.0, 0.0], [0.0, 1.0, 0.0]])
    sigma = np.std([0] * 6 + [1, 1, 2]) / (4 / 9)
    w = np.exp(-(np.arange(9) - 4.0) ** 2 / (2 * sigma ** 2))
    assert rank_gaussian_filter(hand)[1, 1] == pytest.approx((w[6] + w[7] + 2 * w[8]) / w.sum(), rel=1e-12)


def test_the_least_squares_scale_is_the_brute_force_minimum():
    rng = np.random.default_rng(1)
    m, interference = rng.random(16), rng.random(16)
    lam = eci_scale(m, interference)
    grid = np.linspace(lam - 1, lam + 1, 200001)
    brute = grid[np.argmin(((m[None] - grid[:, None] * interference[None]) ** 2).sum(1))]
    assert abs(lam - brute) <= 1e-5
    assert lam == pytest.approx(np.linalg.lstsq(interference[:, None], m, rcond=None)[0][0], rel=1e-12)
    assert eci_scale(m, np.zeros(16)) == 0.0


# --------------------------------------------------------------------------------------------------
# refusals, by name, before any work


@pytest.mark.parametrize("recipe, match", [
    (vc.Recipe(site="lm_logit"), "weighting"),
    (vc.presets.tam().replace(class_="top1"), "class_"),
    (vc.presets.tam(token=len(ANSWER)), "class_"),
    (vc.presets.tam(token=len(ANSWER) + 1), "class_"),
    (vc.presets.tam().replace(target="prob"), "target"),
    (vc.presets.tam().replace(layer=1), "layer"),
])
def test_bad_recipes_are_refused_by_name(trace, recipe, match):
    with pytest.raises(vc.RecipeError, match=match):
        vc.cam(trace, recipe)


def test_a_trace_without_the_site_and_bad_arrays_are_refused_by_name(llava):
    tr = vc.trace(llava, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER[:1]),
                  sites=["lm_attn"], layers=[0])
    with pytest.raises(vc.RecipeError, match="site: 'lm_logit' is not in this trace"):
        vc.cam(tr, vc.presets.tam())
    with pytest.raises(vc.ArgumentTypeError, match="grid"):
        rank_gaussian_filter(np.zeros(4))
    with pytest.raises(vc.ArgumentError, match="size"):
        rank_gaussian_filter(np.zeros((4, 4)), 2)
    with pytest.raises(vc.ArgumentError, match="grid"):
        rank_gaussian_filter(np.zeros((1, 4)))
    with pytest.raises(vc.ArgumentError, match="grid"):
        rank_gaussian_filter(np.array([[np.nan, 0.0], [0.0, 0.0]]))
    with pytest.raises(vc.ArgumentError, match="token"):
        tam_scores(np.zeros((2, 3)), np.zeros((1, 2)), np.array([1, 2]), 1, 1)
    with pytest.raises(vc.ArgumentError, match="shapes"):
        tam_scores(np.zeros((2, 3)), np.zeros((1, 3)), np.array([1, 2]), 1, 0)


# --------------------------------------------------------------------------------------------------
# other families, storage dtype, a degenerate map


@pytest.mark.parametrize("family", ["paligemma", "gemma3"])
def test_the_site_holds_the_models_own_logits_on_the_gemma_families(family):
    from test_vlm_gemma_families import ANSWER as ANS
    from test_vlm_gemma_families import IMG, SETUP, make, token_types
    from test_vlm_gemma_families import make_x as family_x

    model, prompt = make(family), SETUP[family][2]
    tr = vc.trace(model, family_x(family), targets=vc.targets.answer(input_ids=prompt, answer_ids=ANS),
                  sites=["lm_logit"])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt + ANS]), pixel_values=family_x(family),
                    token_type_ids=token_types(family))
    full = out.logits[0].double().numpy()
    assert getattr(model.config.text_config, "final_logit_softcapping", None) is None  # the head's logits
    seq = np.array(prompt + ANS)
    pos, cls = tr["lm_slot_pos"].values, tr["lm_slot_class"].values
    # the prompt slots: every text token after the last image token but the prompt's last
    last_image = int(np.flatnonzero(seq == IMG).max())
    assert pos.tolist() == list(range(last_image + 1, len(prompt) - 1)) + list(range(len(prompt) - 1, len(seq) - 1))
    np.testing.assert_allclose(tr["lm_logit"].values, full[seq == IMG][:, cls].T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tr["lm_logit_text"].values, full[pos][:, ANS].T, rtol=1e-5, atol=1e-6)
    assert vc.cam(tr, vc.presets.tam(token=2)).attrs["degenerate"] == ""


def test_a_float16_trace_stores_the_site_in_float16_and_gives_the_map_to_its_rounding(llava, trace):
    tr16 = vc.trace(llava, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=["lm_logit"], dtype="float16")
    assert tr16["lm_logit"].dtype == np.float16 and tr16["lm_logit_text"].dtype == np.float16
    for k in range(len(ANSWER)):
        a = vc.cam(tr16, vc.presets.tam(token=k)).values
        b = vc.cam(trace, vc.presets.tam(token=k)).values
        assert np.abs(a - b).max() <= 5e-3, k


def test_a_token_activated_nowhere_gives_the_degenerate_verdict(trace):
    dead = trace.copy()
    dead["lm_logit"] = -abs(trace["lm_logit"])  # every image activation and every context score negative
    dead["lm_logit_text"] = -abs(trace["lm_logit_text"])
    with pytest.warns(vc.DegenerateMapWarning, match="constant"):
        m = vc.cam(dead, vc.presets.tam(token=1))
    assert not m.values.any() and m.attrs["degenerate_cause"]
    scores, info = tam_scores(-np.ones((2, 3)), -np.ones((1, 2)), np.array([1, 2]), 1, 0)
    assert info["constant"] and not scores.any()
