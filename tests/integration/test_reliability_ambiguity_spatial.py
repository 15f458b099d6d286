"""Issue #33 part 4, "the five categories all open": spatial reconstruction is no longer closed by construction
in vc.ambiguity. A user's upsample space was popped (every recipe came back with upsample "none") and the
default space fixed normalize and upsample, so the category's share was 0 whatever the maps did."""

from __future__ import annotations

import numpy as np
from vitcam_testing import make_input, make_model

import vitcam_nb as vc

TRACE = vc.trace(make_model("vit"), make_input("vit"))
REPORTED = dict(site="F1", layer=0, weighting="gradcam", target="logit", weight_tokens="patch", relu="none")


def test_a_user_upsample_space_reaches_the_recipes():
    amb = vc.ambiguity(TRACE, reported=REPORTED, space={"upsample": ["bilinear", "bicubic"]})
    assert sorted({r.upsample for r in amb.recipes}) == ["bicubic", "bilinear"]
    assert "upsample" in amb.open and amb.maps.shape[1:] == (32, 32)


def test_the_default_space_opens_spatial_reconstruction():
    amb = vc.ambiguity(TRACE, reported=REPORTED)
    assert amb.open == ["upsample", "normalize"]
    # minmax and max differ on a map with negative values (relu none), bilinear and blocks differ everywhere
    assert amb.sensitivity.categories["spatial reconstruction"] > 0.01
    assert not np.allclose(amb.maps.values[0], amb.maps.values[-1])
