"""``target="prob"`` / ``"logprob"`` on a VLM answer trace are the LM's softmax over its whole vocabulary at the
answer token's position (issue 55): the Grad-CAM maps of those targets equal hand-written references built from
``torch.log_softmax`` over the vocabulary with hooks and ``torch.autograd``; the checklist says so; ranked classes
and the logsumexp entries are refused by name. Also: the zero-gradient verdict of a tower layer the LM never reads
says that cause (not CLS pooling), and ``targets="top5"`` on a VLM is refused pointing to ``vc.targets.answer``."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from test_vlm_llava import ANSWER, GRID, PROMPT, make_llava, make_x
from vitcam_testing import assert_rel_close

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")
POS = np.arange(3, 3 + GRID * GRID)  # the image-token positions of PROMPT


@pytest.fixture(scope="module")
def llava():
    return make_llava()


@pytest.fixture(scope="module")
def trace(llava):
    return vc.trace(llava, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=["F1", "lm_resid"])


def vocab_grads(model, token: int, prob: bool) -> dict:
    """(activation, gradient) of the tower's layer-1 F1 and LM layer 1's input residual stream, for log p (or p)
    of answer ``token`` by torch.log_softmax over the whole vocabulary at the position predicting it."""
    ref = copy.deepcopy(model)
    kept = {}
    h1 = ref.model.vision_tower.encoder.layers[1].layer_norm1.register_forward_hook(
        lambda _m, _i, o: kept.__setitem__("F1", o))
    h2 = ref.model.language_model.layers[1].register_forward_pre_hook(
        lambda _m, a, kw: kept.__setitem__("lm_resid", a[0] if a else kw["hidden_states"]), with_kwargs=True)
    logits = ref(input_ids=torch.tensor([PROMPT + ANSWER]), pixel_values=make_x(), use_cache=False).logits[0]
    h1.remove(), h2.remove()
    logp = torch.log_softmax(logits[len(PROMPT) - 1 + token], dim=-1)[ANSWER[token]]
    out = logp.exp() if prob else logp
    g = torch.autograd.grad(out, [kept["F1"], kept["lm_resid"]])
    return {"F1": (kept["F1"][0].detach().numpy(), g[0][0].numpy()),
            "lm_resid": (kept["lm_resid"][0].detach().numpy(), g[1][0].numpy()), "logp": float(logp.detach())}


def gradcam(A: np.ndarray, G: np.ndarray) -> np.ndarray:
    m = np.maximum(A @ G.mean(axis=0), 0).reshape(GRID, GRID)
    return (m - m.min()) / (m.max() - m.min())


def test_trace_stores_each_answer_positions_vocabulary_logsumexp(llava, trace):
    logits = llava(input_ids=torch.tensor([PROMPT + ANSWER]), pixel_values=make_x(), use_cache=False).logits[0]
    rows = logits[len(PROMPT) - 1:len(PROMPT) - 1 + len(ANSWER)].detach()
    n = len(ANSWER)
    np.testing.assert_allclose(trace["logits"].values[n + 1:], torch.logsumexp(rows, -1).numpy(), rtol=1e-5)
    # the sequence entry is still sum_k log softmax over the vocabulary
    lp = torch.log_softmax(rows, -1)[torch.arange(n), torch.tensor(ANSWER)]
    np.testing.assert_allclose(trace["logits"].values[n], float(lp.sum()), rtol=1e-5)


@pytest.mark.parametrize("target", ["logprob", "prob"])
@pytest.mark.parametrize("token", [0, 2])
def test_prob_and_logprob_maps_are_the_vocabulary_softmax(llava, trace, target, token):
    ref = vocab_grads(llava, token, prob=target == "prob")
    A, G = ref["F1"]
    m = vc.cam(trace, vc.Recipe(site="F1", layer=1, class_=token, target=target, upsample="none"))
    assert_rel_close(m.values, gradcam(A[1:], G[1:]), f"tower {target} map of answer token {token}")
    A, G = ref["lm_resid"]
    m = vc.cam(trace, vc.Recipe(site="lm_resid", layer=1, class_=token, target=target, upsample="none"))
    assert_rel_close(m.values, gradcam(A[POS], G[POS]), f"lm_resid {target} map of answer token {token}")
    item = json.loads(m.attrs["checklist"])["gradient target"]
    text = json.dumps(item)
    assert "whole vocabulary" in text and "lse" in text, text


def test_the_classifier_rule_over_the_traced_entries_would_differ(llava, trace):
    """The softmax over the traced entries (the old rule) gives another gradient: the test above can fail."""
    ref = vocab_grads(llava, 0, prob=False)
    g = trace["grad"].values[:, 1, list(trace["site"].values).index("F1")]
    z = trace["logits"].values.astype(np.float64)
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    old = g[0] - g[-1]  # dz - dE over the traced entries (E = sum p_j z_j, the last traced gradient)
    assert np.abs(old - ref["F1"][1]).max() > 1e-3 * np.abs(ref["F1"][1]).max() and p[0] < 1


def test_sequence_entry_logprob_is_itself_and_prob_its_exponential(trace):
    n = len(ANSWER)
    a = vc.cam(trace, vc.Recipe(site="lm_resid", layer=1, class_=n, relu="none", upsample="none"))
    b = vc.cam(trace, vc.Recipe(site="lm_resid", layer=1, class_=n, target="logprob", relu="none", upsample="none"))
    np.testing.assert_array_equal(a.values, b.values)
    c = vc.cam(trace, vc.Recipe(site="lm_resid", layer=1, class_=n, target="prob", relu="none", upsample="none"))
    # exp(s) > 0 scales the gradient, and the map is min-max normalised: the same map up to rounding
    np.testing.assert_allclose(c.values, a.values, atol=1e-5)
    assert "sequence probability" in json.dumps(json.loads(c.attrs["checklist"])["gradient target"])


@pytest.mark.parametrize("class_,match", [("top4", "ranks the 3 answer tokens"),
                                          (len(ANSWER) + 1, "vocabulary logsumexp")])
def test_ranked_classes_and_logsumexp_entries_are_refused(trace, class_, match):
    with pytest.raises(vc.RecipeError, match=match):
        vc.cam(trace, vc.Recipe(site="lm_resid", layer=1, class_=class_))


def test_ranked_class_ranks_the_answer_tokens_only(trace):
    z = trace["logits"].values[:len(ANSWER)]
    for rank in (1, 3):
        want = int(np.argsort(-z, kind="stable")[rank - 1])
        a = vc.cam(trace, vc.Recipe(site="lm_resid", layer=1, class_=f"top{rank}", relu="none", upsample="none"))
        b = vc.cam(trace, vc.Recipe(site="lm_resid", layer=1, class_=want, relu="none", upsample="none"))
        np.testing.assert_array_equal(a.values, b.values)


def test_unused_tower_layer_reason_names_the_layer_the_lm_reads(llava):
    t = vc.trace(llava, make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER), sites=["F1"])
    with pytest.warns(vc.DegenerateMapWarning, match="zero gradient"):
        m = vc.cam(t, vc.Recipe(site="F1", layer=-1, class_=0))
    assert "CLS pooling" not in m.attrs["degenerate"]
    assert "vision_feature_layer=-2" in m.attrs["degenerate"] and "never reads" in m.attrs["degenerate"]


def test_ranked_targets_on_a_vlm_are_refused_pointing_to_answer(llava):
    with pytest.raises(vc.TraceError, match=r"generative VLM .*targets=vitcam_nb\.targets\.answer"):
        vc.trace(llava, make_x(), targets="top5")


def test_an_answer_trace_without_the_logsumexps_refuses_prob_but_keeps_logit(trace):
    """A trace made before the logsumexps were traced (its entries: the tokens, the sequence, E) has no
    vocabulary softmax to derive: prob/logprob are refused by name, logit maps are unchanged."""
    old = trace.isel({"class": slice(0, len(ANSWER) + 1), "target": [0, 1, 2, 3, -1]})
    assert old["target_class"].values.tolist() == [0, 1, 2, 3, -1]
    for target in ("prob", "logprob"):
        with pytest.raises(vc.RecipeError, match="needs the vocabulary logsumexp"):
            vc.cam(old, vc.Recipe(site="lm_resid", layer=1, class_=0, target=target))
    r = vc.Recipe(site="lm_resid", layer=1, class_=1, upsample="none")
    np.testing.assert_array_equal(vc.cam(old, r).values, vc.cam(trace, r).values)
