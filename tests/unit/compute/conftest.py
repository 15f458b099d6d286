"""Fixtures of the ``vc.cam`` tests on hand-made traces (``test_flat_*.py``): the trace and the canonical-order
arrays the reference works from."""

from __future__ import annotations

import pytest
from cam_reference import SEED, canonical_arrays, handmade


@pytest.fixture(scope="module")
def hm():
    return handmade(SEED)


@pytest.fixture(scope="module")
def arr():
    return canonical_arrays(SEED)
