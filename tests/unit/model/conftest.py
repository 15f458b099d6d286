"""Fixtures of the BLIP tests (``test_blip*.py``): the tiny BLIP model and its trace at every vision site and
``xattn``, built once per module. ``test_blip`` is imported inside them, so only a BLIP test imports
transformers (``test_blip`` skips without it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def blip():
    from test_blip import make_blip

    return make_blip()


@pytest.fixture(scope="module")
def blip_trace(blip):
    from test_blip import CORE, EXTENDED, itm_target, make_x

    import vitcam_nb as vc

    return vc.trace(blip, make_x(), targets=itm_target(), sites=CORE + EXTENDED + ["xattn"])
