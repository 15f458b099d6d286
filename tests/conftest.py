"""Shared fixtures. The helpers live in ``vitcam_testing`` and ``vitcam_notebooks`` (unique module names:
``tests/ui`` has its own conftest, and two modules both imported as ``conftest`` would shadow each other).

Property tests are reproducible: Hypothesis draws the same examples on every run and every machine
(``derandomize``) and keeps no example database between runs, so the suite's outcome does not depend on a draw or
on what an earlier run found. ``VITCAM_HYPOTHESIS_PROFILE=explore`` draws afresh, to look for new failures."""

import os

import pytest
from hypothesis import settings
from vitcam_notebooks import executed_notebooks  # noqa: F401  (registers the fixture)
from vitcam_testing import *  # noqa: F403  (re-exports the fixtures so pytest registers them)

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("VITCAM_HYPOTHESIS_PROFILE", "ci"))


#: Test files that share one session fixture's work (the executed notebooks), so one worker runs them both.
_NOTEBOOK_FILES = ("test_notebooks.py", "test_docs_site.py")


# tryfirst: xdist's worker reads the xdist_group marks in its own collection hook, registered after this conftest
# (and so called before it): without it no group reached the scheduler and a file's tests were split.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (the README's line: ``-n auto --dist loadgroup``) each test file goes to one worker whole,
    so its module fixtures (a store, a JupyterLab server, a Chromium page) are made once, not once per worker that
    gets one of its tests; the real-browser tests (marker ``browser``) all go to one worker, one after another, so
    that two JupyterLab servers and Chromiums never compete for the same cores and run past their timeouts; and the
    notebook tests go with the documentation site's build, which reads the same executed notebooks. A test that
    names its own ``xdist_group`` keeps it."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        path = item.nodeid.split("::")[0]
        if path.rsplit("/", 1)[-1] in _NOTEBOOK_FILES:
            group = "executed-notebooks"
        elif item.get_closest_marker("browser"):
            group = "browser"
        else:
            group = path
        item.add_marker(pytest.mark.xdist_group(group))
