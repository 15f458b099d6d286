"""Shared fixtures. The helpers live in ``vitcam_testing`` and ``vitcam_notebooks`` (unique module names:
``tests/ui`` has its own conftest, and two modules both imported as ``conftest`` would shadow each other)."""

from vitcam_notebooks import executed_notebooks  # noqa: F401  (registers the fixture)
from vitcam_testing import *  # noqa: F403  (re-exports the fixtures so pytest registers them)
