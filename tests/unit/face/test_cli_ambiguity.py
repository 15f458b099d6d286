"""``vitcam-nb ambiguity`` (issue #21): the JSON it writes is what vc.ambiguity answers on the same trace."""

from __future__ import annotations

import json

import pytest

import vitcam_nb as vc
from vitcam_nb.audit import parse_reported_args
from vitcam_nb.cli import main


def test_cli_writes_figure_and_the_summary_vc_ambiguity_gives(tmp_path, capsys):
    assert main(["ambiguity", "--model", "shapes-vit", "--reported", "site=F1", "layer=-1", "weighting=gradcam",
                 "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "ambiguity.json").read_text())
    assert (tmp_path / "ambiguity.png").stat().st_size > 10_000
    img, _label, mask = vc.sample_image("shapes", 0, with_mask=True)
    amb = vc.ambiguity(vc.trace(vc.load_model("shapes-vit"), img), dict(site="F1", layer=-1, weighting="gradcam"),
                       mask=mask)
    assert summary["recipe_ids"] == [r.id for r in amb.recipes]
    assert summary["median_spearman"] == pytest.approx(amb.spread.median_spearman)
    assert summary["sensitivity"]["fields"] == pytest.approx(amb.sensitivity.fields)
    assert summary["localises"] == pytest.approx(amb.localises)
    assert "leaves 5 choice(s) open" in capsys.readouterr().out  # spatial reconstruction open too


def test_cli_refuses_bad_words(capsys):
    assert main(["ambiguity", "--reported", "site"]) == 2
    assert "expected field=value" in capsys.readouterr().err
    assert parse_reported_args(["layer=-1", "site=F4"]) == {"layer": -1, "site": "F4"}
