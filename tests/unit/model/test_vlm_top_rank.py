"""On a VLM answer trace ``class_="topK"`` ranks the answer tokens only (issue 55; found by review): the
sequence log-prob and the vocabulary logsumexps traced after them are no class a rank picks, so the resolved
recipe, its canonical id, the map's title and the ``lm_attn`` rows all name the token ``vc.cam`` explains, the
answer token with the K-th largest logit (computed here from the trace's logits with NumPy)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb.plot_words import class_name

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_vlm_llava import ANSWER, PROMPT, make_llava, make_x  # noqa: E402


@pytest.fixture(scope="module")
def trace():
    return vc.trace(make_llava(), make_x(), targets=vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER),
                    sites=["F6", "lm_resid", "lm_attn"])


def _kth(trace, k: int) -> int:
    z = trace["logits"].values[:len(ANSWER)].astype(np.float64)
    return int(np.argsort(-z, kind="stable")[k - 1])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_top_k_resolves_to_the_answer_token_vc_cam_explains(trace, k):
    # a logsumexp entry is never below its position's logit: ranking every entry would pick one
    assert trace["logits"].values.argmax() >= len(ANSWER)
    token = _kth(trace, k)
    for site, layer in (("lm_resid", -1), ("F6", 0)):
        r = vc.Recipe(site=site, layer=layer, class_=f"top{k}")
        assert r.resolve(trace).class_ == token
        assert r.canonical_id(trace) == r.replace(class_=token).canonical_id(trace)
        np.testing.assert_array_equal(vc.cam(trace, r).values, vc.cam(trace, r.replace(class_=token)).values)
        assert class_name(trace, r) == str(trace["class_label"].values[token])


def test_lm_attn_top1_reads_the_row_of_the_token_it_weighs(trace):
    token = _kth(trace, 1)
    r = vc.Recipe(site="lm_attn", layer=0, class_="top1", relu="none")
    got = vc.cam(trace, r)
    assert np.ptp(got.values) > 0  # a real map, not a degenerate zero map
    np.testing.assert_array_equal(got.values, vc.cam(trace, r.replace(class_=token)).values)
    checklist = got.attrs["checklist"]
    assert f"the row predicting answer token {token}" in checklist
    assert "ranked 1 by logit among the 3 answer tokens" in checklist
