"""``vc.estimate`` of answer traces whose tower runs on crops (LLaVA-NeXT, LLaVA-OneVision, Idefics3, SmolVLM: the
tiny configs of tests/unit/model/anyres_cases.py and test_vlm_idefics.py) and of Qwen2-VL / 2.5-VL (packed patches,
tests/vlm_qwen_tiny.py): every variable the estimate names a part for is exactly the real trace's variable (the
tower arrays with their leading ``crop`` dim), the coordinates ("other": the crop coordinates, the image as each
crop, one token axis per crop) within 1 % of the real trace's and the whole Dataset within the 0.5 % that
test_vlm_estimate.py states."""

from __future__ import annotations

import pytest

import vitcam_nb as vc

pytest.importorskip("transformers")
import anyres_cases  # noqa: E402
import test_vlm_idefics as idefics  # noqa: E402
import vlm_qwen_tiny  # noqa: E402

# The coordinates are counted from their dtypes and lengths, not read off a Dataset.
REL, REL_OTHER = 0.005, 0.01


def _case(kind: str):
    if kind in ("next", "onevision"):
        return anyres_cases.make(kind), anyres_cases.pixels(), anyres_cases.target(kind)
    if kind in idefics.KINDS:
        return (idefics.make(kind), idefics.make_x(),
                vc.targets.answer(input_ids=idefics.PROMPT, answer_ids=idefics.ANSWER))
    return vlm_qwen_tiny.tiny_qwen(kind)


def _check(est: dict, tr) -> None:
    named = 0
    for name, size in est["parts"].items():
        if name != "other":
            assert size == (tr[name].nbytes if name in tr else 0), name
            named += size
    assert est["parts"]["other"] == pytest.approx(tr.nbytes - named, rel=REL_OTHER)
    assert est["dataset_bytes"] == pytest.approx(tr.nbytes, rel=REL)
    assert est["peak_bytes"] > est["dataset_bytes"]


@pytest.mark.parametrize("kind", ["next", "onevision", *idefics.KINDS])
@pytest.mark.parametrize("sites, dtype", [(None, "float32"), (["F3", "F5", "lm_attn"], "float16")])
def test_crops_estimate_is_the_size_of_its_trace(kind, sites, dtype):
    model, x, target = _case(kind)
    est = vc.estimate(model, x, targets=target, sites=sites, dtype=dtype)
    tr = vc.trace(model, x, targets=target, sites=sites, dtype=dtype)
    crops = tr.sizes["crop"]
    assert crops == 5 and tr["act"].dims[0] == "crop"
    # the tower's tokens are per crop: the estimate's token count is the trace's token axis
    assert est["tokens"] == tr.sizes["token"]
    _check(est, tr)


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_5"])
@pytest.mark.parametrize("sites, dtype", [(None, "float32"), (["F3", "projector", "lm_attn"], "float16")])
def test_qwen_estimate_parts_and_coordinates(kind, sites, dtype):
    model, x, target = _case(kind)
    est = vc.estimate(model, x, targets=target, sites=sites, dtype=dtype)
    tr = vc.trace(model, x, targets=target, sites=sites, dtype=dtype)
    assert "crop" not in tr.dims and est["tokens"] == tr.sizes["token"]
    _check(est, tr)
