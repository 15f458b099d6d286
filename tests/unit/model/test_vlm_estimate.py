"""``vc.estimate`` of a generative VLM's answer trace (issue 55, item 7): the Dataset's size from the plan alone
(tower sites, and the LM sites at the image-token positions only), checked against the size of the real trace of
the tiny LLaVA of test_vlm_llava.py and of the tiny PaliGemma and Gemma 3 of test_vlm_gemma_families.py; a longer
prompt around the same image leaves the stored LM arrays (and their estimate) as they are while the pass's peak
grows; the budget check now covers these models. The peak itself is checked against a measured one in
tests/integration/test_vlm_estimate_peak.py."""

from __future__ import annotations

import numpy as np
import pytest

import vitcam_nb as vc

pytest.importorskip("transformers")
from test_vlm_gemma_families import SETUP  # noqa: E402
from test_vlm_gemma_families import make as make_gemma  # noqa: E402
from test_vlm_gemma_families import make_x as make_gemma_x  # noqa: E402
from test_vlm_llava import ANSWER, IMAGE_ID, PROMPT, make_llava, make_x  # noqa: E402

# Every variable the estimate names a part for; "other" (coordinates, logits, image) is the rest of the Dataset.
LM_PARTS = ("projector", "projector_grad", "lm_resid", "lm_resid_grad", "lm_attn", "lm_attn_grad")
# The coordinates are counted from their dtypes and lengths, not read off a Dataset: the whole Dataset within this.
REL = 0.005


def _check_parts(est: dict, tr) -> None:
    for name, size in est["parts"].items():
        if name == "other":
            continue
        assert size == (tr[name].nbytes if name in tr else 0), name
    assert est["dataset_bytes"] == pytest.approx(tr.nbytes, rel=REL)
    assert est["peak_bytes"] > est["dataset_bytes"]


@pytest.fixture(scope="module")
def llava():
    return make_llava()


@pytest.mark.parametrize("sites, dtype", [(None, "float32"), (["F1", "F2", "lm_resid"], "float32"),
                                          (["F3", "projector", "lm_attn"], "float16")])
def test_llava_estimate_is_the_size_of_its_trace(llava, sites, dtype):
    target = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)
    est = vc.estimate(llava, make_x(), targets=target, sites=sites, dtype=dtype)
    tr = vc.trace(llava, make_x(), targets=target, sites=sites, dtype=dtype)
    _check_parts(est, tr)
    assert est["image_tokens"] == 16 and est["sequence"] == len(PROMPT) + len(ANSWER)
    assert est["memory_mode"] == "plain" and est["targets"] == 7


@pytest.mark.parametrize("family", ["paligemma", "gemma3"])
def test_other_families_estimate_is_the_size_of_their_trace(family):
    model = make_gemma(family)
    target = vc.targets.answer(input_ids=SETUP[family][2], answer_ids=ANSWER)
    est = vc.estimate(model, make_gemma_x(family), targets=target)
    _check_parts(est, vc.trace(model, make_gemma_x(family), targets=target))


def test_a_longer_prompt_does_not_grow_the_stored_lm_arrays(llava):
    """The same image with 40 more text tokens: the LM sites' arrays (and their estimate) keep their size, the
    pass's estimated peak grows (it holds the whole sequence's attention)."""
    short = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)
    long = vc.targets.answer(input_ids=PROMPT[:3] + [IMAGE_ID] * 16 + [7, 8] * 21, answer_ids=ANSWER)
    trs = [vc.trace(llava, make_x(), targets=t) for t in (short, long)]
    ests = [vc.estimate(llava, make_x(), targets=t) for t in (short, long)]
    for name in LM_PARTS:
        assert trs[0][name].nbytes == trs[1][name].nbytes == ests[0]["parts"][name] == ests[1]["parts"][name], name
    np.testing.assert_array_equal(trs[1]["image_token_pos"].values, np.arange(3, 19))
    assert ests[1]["sequence"] == ests[0]["sequence"] + 40
    assert ests[1]["peak_bytes"] > ests[0]["peak_bytes"]
    _check_parts(ests[1], trs[1])


def test_a_vlm_trace_over_its_budget_is_refused_and_one_within_it_runs(llava):
    target = vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER)
    peak = vc.estimate(llava, make_x(), targets=target)["peak_bytes"]
    with pytest.raises(vc.TraceError, match="max_bytes: this trace needs about"):
        vc.trace(llava, make_x(), targets=target, max_bytes=peak / 2)
    assert vc.trace(llava, make_x(), targets=target, max_bytes=2 * peak).sizes["image_token"] == 16


def test_a_vlm_estimate_needs_the_answer_target(llava):
    with pytest.raises(vc.VitcamError, match="is a generative VLM"):
        vc.estimate(llava, make_x(), targets="top1")


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5"])
def test_qwen_estimate_is_the_size_of_its_trace(kind):
    """Qwen2-VL / 2.5-VL (a tower over the image's own packed patch grid, image_grid_thw): runs once the family is
    registered and its tiny builder (tests/vlm_qwen_tiny.py) exists."""
    from vitcam_nb.adapters.hf_vlm import VLM_FAMILIES

    if not any("Qwen2VLForConditionalGeneration" in f.classes for f in VLM_FAMILIES.values()):
        pytest.skip("the Qwen2-VL family is not registered in this checkout")
    tiny = pytest.importorskip("vlm_qwen_tiny")
    model, pixel_values, target = tiny.tiny_qwen(kind)
    est = vc.estimate(model, pixel_values, targets=target)
    _check_parts(est, vc.trace(model, pixel_values, targets=target))
    assert est["input_size"] == list(tiny.SIZE)
