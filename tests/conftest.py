"""Shared fixtures. The helpers live in ``vitcam_testing`` (a unique module name: ``tests/ui`` has its own
conftest, and two modules both imported as ``conftest`` would shadow each other)."""

from vitcam_testing import *  # noqa: F403  (re-exports the fixtures so pytest registers them)
