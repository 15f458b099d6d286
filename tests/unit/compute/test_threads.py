"""Thread use while maps are computed (issue #23): BLAS pools at one thread inside ``small_array_threads``,
``vc.cam`` and ``vc.gallery``, and the user's own settings back afterwards — after a normal return, an
exception and nested blocks. The observed counts come from threadpoolctl, independently of the module."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits
from vitcam_testing import make_input, make_model

import vitcam_nb as vc
from vitcam_nb import api
from vitcam_nb.compute.threads import small_array_threads


def _blas_threads() -> list[int]:
    return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]


@pytest.fixture
def user_two_threads():
    """The user's setting for the test: two BLAS threads (a value no code path under test sets)."""
    if not _blas_threads():
        pytest.skip("numpy has no BLAS library threadpoolctl can control here")
    with threadpool_limits(limits=2, user_api="blas"):
        before = _blas_threads()
        yield before
    assert _blas_threads() != [] and all(n >= 1 for n in _blas_threads())


def test_block_limits_then_restores(user_two_threads):
    with small_array_threads():
        assert set(_blas_threads()) == {1}
        with small_array_threads():                     # nested: still one thread, not restored early
            assert set(_blas_threads()) == {1}
        assert set(_blas_threads()) == {1}
    assert _blas_threads() == user_two_threads


def test_restores_after_exception(user_two_threads):
    with pytest.raises(ZeroDivisionError), small_array_threads():
        assert set(_blas_threads()) == {1}
        _ = 1 / 0
    assert _blas_threads() == user_two_threads


def test_leaves_single_thread_pools_alone():
    with threadpool_limits(limits=1, user_api="blas"):
        with small_array_threads():
            assert set(_blas_threads()) <= {1}
        assert set(_blas_threads()) <= {1}


def test_cam_and_gallery_run_single_threaded_and_restore(user_two_threads, monkeypatch):
    tr = vc.trace(make_model("vit"), make_input("vit"), targets="top1")
    seen = []
    real = api.kind_for

    def spy(trace, recipe):
        seen.append(_blas_threads())
        return real(trace, recipe)

    monkeypatch.setattr(api, "kind_for", spy)
    m = vc.cam(tr, vc.Recipe(site="F1", layer=0))
    assert _blas_threads() == user_two_threads
    with pytest.warns(vc.DegenerateMapWarning):  # the last block's F4 patch tokens never reach the output
        g = vc.gallery(tr, vc.Recipe(), vary={"layer": "all", "site": ["F1", "F4"]})
    assert _blas_threads() == user_two_threads
    with pytest.raises(vc.RecipeError):
        vc.cam(tr, vc.Recipe(site="F1", layer=99))
    assert _blas_threads() == user_two_threads
    assert len(seen) == 3 and all(set(s) == {1} for s in seen)
    # Same values whatever the thread count: the gallery's map equals the map computed with two threads.
    with threadpool_limits(limits=2, user_api="blas"):
        two = vc.cam(tr, vc.Recipe(site="F1", layer=0)).values
    np.testing.assert_array_equal(m.values, two)
    np.testing.assert_array_equal(g.sel(layer=0, site="F1").values, two)
