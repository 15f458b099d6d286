"""Metrics as modules that register themselves (vitcam_nb.evaluate.metrics): a package of metric modules is found by
walking it, each registers in the score-card registry and its public functions become ``vc.evaluate.<name>`` with no
edit of vitcam_nb.evaluate; and the public correlation helper every metric shares (NaN rule included)."""

from __future__ import annotations

import sys
import textwrap
import warnings

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb.core.errors import ArgumentError
from vitcam_nb.evaluate import metrics as metric_modules
from vitcam_nb.evaluate.faithfulness.correlation import _correlation
from vitcam_nb.evaluate.metric_helpers import MetricWarning, correlation
from vitcam_nb.evaluate.metric_registry import METRICS, MetricInputs, metric_names


def test_a_package_of_metric_modules_registers_and_exports_without_a_list(tmp_path, monkeypatch):
    pkg = tmp_path / "my_metrics_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "peak_demo.py").write_text(textwrap.dedent('''
        import numpy as np
        from vitcam_nb.evaluate.metric_registry import on_maps, register_metric

        __all__ = ["peak_share_demo"]

        def peak_share_demo(saliency):
            """The largest cell over the total."""
            s = np.asarray(saliency, float)
            return float(s.max() / s.sum())

        register_metric("peak_share_demo", "complexity", on_maps(peak_share_demo), higher_is_better=False)
    '''))
    (pkg / "_helpers.py").write_text("raise RuntimeError('a module starting with _ is not walked')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = list(metric_modules._MODULES)
    try:
        assert metric_modules.discover("my_metrics_demo") == ("peak_share_demo",)
        assert "peak_share_demo" in metric_names("complexity")
        assert vc.evaluate.peak_share_demo([[1.0, 3.0], [0.0, 0.0]]) == 0.75
        assert "peak_share_demo" in dir(vc.evaluate)
        scores = METRICS.get("peak_share_demo").func(MetricInputs(None, [None, None], [np.ones((2, 2)), None],
                                                                  [None, None]))
        assert scores[0] == 0.25 and np.isnan(scores[1])
        assert metric_modules.discover("my_metrics_demo") == ()  # imported once: registered once
    finally:
        if "peak_share_demo" in METRICS:
            METRICS.unregister("peak_share_demo")
        metric_modules._MODULES[:] = modules
        metric_modules._REGISTERED[:] = [n for n in metric_modules._REGISTERED if n != "peak_share_demo"]
        for mod in [m for m in sys.modules if m.startswith("my_metrics_demo")]:
            del sys.modules[mod]
    with pytest.raises(AttributeError):
        vc.evaluate.peak_share_demo  # noqa: B018


def _ranks(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.size)
    out[np.argsort(x)] = np.arange(x.size)
    return out


def test_correlation_is_pearson_or_spearman_by_hand():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=20), rng.normal(size=20)
    b = a + 0.5 * b
    da, db = a - a.mean(), b - b.mean()
    pearson = np.sum(da * db) / np.sqrt(np.sum(da**2) * np.sum(db**2))
    assert correlation(a, b) == pytest.approx(pearson, rel=1e-12)
    ra, rb = _ranks(a), _ranks(b)  # no ties in continuous samples
    assert correlation(a, b, "spearman") == pytest.approx(np.corrcoef(ra, rb)[0, 1], rel=1e-12)
    assert _correlation("spearman", a, b, "x") == correlation(a, b, "spearman")  # the old private name


def test_correlation_of_a_constant_side_is_nan_with_a_warning_naming_the_metric():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = correlation([1.0, 2.0, 3.0], [4.0, 4.0, 4.0], "pearson", "my_metric")
    assert np.isnan(value)
    assert [w.category for w in caught] == [MetricWarning]
    assert "my_metric" in str(caught[0].message) and "model's responses" in str(caught[0].message)


def test_correlation_refuses_bad_input_by_name():
    with pytest.raises(ArgumentError, match="kind"):
        correlation([1.0, 2.0], [1.0, 2.0], "kendall")
    with pytest.raises(ArgumentError, match="a, b"):
        correlation([1.0, 2.0], [1.0, 2.0, 3.0])
