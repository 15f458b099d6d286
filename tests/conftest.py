"""Shared fixtures. The helpers live in ``vitcam_testing`` and ``vitcam_notebooks`` (unique module names:
``tests/ui`` has its own conftest, and two modules both imported as ``conftest`` would shadow each other).

Property tests are reproducible: Hypothesis draws the same examples on every run and every machine
(``derandomize``) and keeps no example database between runs, so the suite's outcome does not depend on a draw or
on what an earlier run found. ``VITCAM_HYPOTHESIS_PROFILE=explore`` draws afresh, to look for new failures."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("VITCAM_HYPOTHESIS_PROFILE", "ci"))

from vitcam_notebooks import executed_notebooks  # noqa: E402, F401  (registers the fixture)
from vitcam_testing import *  # noqa: E402, F403  (re-exports the fixtures so pytest registers them)
