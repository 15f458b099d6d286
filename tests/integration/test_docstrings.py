"""Every public docstring example runs and prints what it shows (examples that need a user's trace or
weights are marked ``+SKIP``)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import warnings

import pytest

import vitcam_nb

# vitcam_nb_nodelay ships beside vitcam_nb (a Jupyter server extension that must not import it).
MODULES = sorted(m.name for m in pkgutil.walk_packages(vitcam_nb.__path__, "vitcam_nb.")
                 if not m.name.endswith("__main__")) + ["vitcam_nb_nodelay"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degenerate maps of random-init example models are expected
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
                                 | doctest.IGNORE_EXCEPTION_DETAIL, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
