"""The VLM trace-cost section of docs/performance.md is the committed benchmark JSON's, never written by hand."""

from __future__ import annotations

import json

from benchmarks import vlm_cost_section as sec


def test_the_page_states_what_the_committed_json_measured():
    assert sec.main(["--check"]) == 0, "run: python -m benchmarks.vlm_cost_section"
    result = json.loads(sec.JSON.read_text())
    text = sec.PAGE.read_text().split(sec.START, 1)[1].split(sec.END, 1)[0]
    for row in result["rows"].values():
        verdict = "met" if row["ratio"] <= row["target"] else "not met"
        assert f"{row['ratio']:.2f}× (CPU time {row['cpu_ratio']:.2f}×) | ≤ {row['target']}: {verdict} |" in text


def test_a_ratio_above_its_target_is_said_to_miss_it():
    row = {"trace": {"median_s": 0.0121}, "baseline": {"median_s": 0.01}, "ratio": 1.21, "cpu_ratio": 1.19,
           "target": 1.2, "workload": "tiny"}
    result = {"rows": {"m": row, "n": {**row, "ratio": 1.2}}, "date": "2026-12-07T00:00:00",
              "machine": {"cpu_model": "c", "usable_cpus": 2}, "torch_threads": 1, "load_average_start": [1, 1, 1],
              "load_average_end": [1, 1, 1], "command": "python -m x"}
    rows = sec.section(result).splitlines()[2:4]
    assert rows[0].endswith("≤ 1.2: not met |") and rows[1].endswith("≤ 1.2: met |")
