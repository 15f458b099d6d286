"""Issue #52, finding 13: ``run_figure``'s ``examples`` is checked by name before any map is computed, and a refused
call leaves no folder behind."""

from __future__ import annotations

import pytest

import vitcam_nb as vc
from vitcam_nb import audit_figure


@pytest.mark.parametrize("examples", ["x", -1, 0, 2.5, True, None])
def test_examples_is_refused_by_name_before_any_work(tmp_path, monkeypatch, examples):
    traced: list[int] = []
    real = audit_figure.trace
    monkeypatch.setattr(audit_figure, "trace", lambda *a, **k: traced.append(1) or real(*a, **k))
    with pytest.raises(vc.ArgumentError, match=rf"^examples: expected a count >= 1 of example maps per label, got "
                                               rf"{examples!r}"):
        audit_figure.run_figure(tmp_path / "f", model="shapes-vit", images=1, photo=False, progress=False,
                                axes={"site": ["F1"], "weighting": ["gradcam"]}, examples=examples)
    assert traced == [] and not (tmp_path / "f").exists()
