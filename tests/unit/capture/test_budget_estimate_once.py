"""The budget check makes each memory mode's estimate once per trace (a VLM's estimate walks the model and its
image-token layout), and chooses the same mode and refusal as estimating each time."""

from __future__ import annotations

from dataclasses import replace

import pytest
import timm

import vitcam_nb as vc
from benchmarks.items.vlm_trace_cost import ANSWER, PROMPT, tiny_llava
from vitcam_nb.capture import budget
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.core.errors import TraceError


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []
    real = budget.estimate_plan

    def counted(plan, hw, batch=1):
        calls.append((plan.recompute, plan.target_groups, batch))
        return real(plan, hw, batch)

    monkeypatch.setattr(budget, "estimate_plan", counted)
    return calls


def test_vlm_estimate_made_once(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = TracePlan.for_trace(tiny_llava(), vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER))
    calls = _counting(monkeypatch)
    budget.fit_budget(plan, (32, 32), None)
    assert calls == [(False, 1, 1)]
    assert (plan.recompute, plan.target_groups) == (False, 1)


def test_vlm_refusal_names_the_same_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = TracePlan.for_trace(tiny_llava(), vc.targets.answer(input_ids=PROMPT, answer_ids=ANSWER))
    need = budget.estimate_plan(replace(plan, recompute=False, target_groups=1), (32, 32))["peak_bytes"]
    calls = _counting(monkeypatch)
    with pytest.raises(TraceError, match=f"{need / 1e9:.2f} GB"):
        budget.fit_budget(plan, (32, 32), need - 1)
    assert calls == [(False, 1, 1)]


def test_vit_each_mode_estimated_once_same_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    plan = TracePlan.for_trace(m, "top5", sites=["F1"], layers=[-1])
    calls = _counting(monkeypatch)
    budget.fit_budget(plan, (224, 224), None)
    # the fit's own estimate of the plain pass is made once (_chosen_mode asks twice more: its Dataset and peak)
    assert calls.count((False, 1, 1)) == 3
    assert (plan.recompute, plan.target_groups) == (True, 3)  # fit_budget's documented choice for this plan
