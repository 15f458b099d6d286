"""Issue #33 part 5, "say what the map is": every map's checklist and methods paragraph say in words what the map
is made from (token activations x gradients, attention weights, cross-modal interaction), carry the caveat of the
raster reshape, and quote the position probe when the trace holds one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import timm

import vitcam_nb as vc

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.DegenerateMapWarning")


def test_a_map_says_what_it_shows_and_that_raster_order_is_an_assumption():
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_classes=3).eval()
    tr = vc.trace(model, np.random.default_rng(3).integers(0, 255, (32, 32, 3), dtype=np.uint8), targets="top1",
                  sites=["F1", "F2"])
    f1, f2 = vc.cam(tr, vc.Recipe(site="F1")), vc.cam(tr, vc.Recipe(site="F2"))
    assert json.loads(f1.attrs["checklist"])["feature representation"]["what the map shows"].startswith(
        "token activations x gradients: the LayerNorm output before attention (F1)")
    assert "What the map shows: attention weights x gradients: the softmax attention per head (F2)" in \
        f2.attrs["methods"]
    for m in (f1, f2):
        assert "Tokens are placed on the grid in raster order (patch_row, patch_col): this assumes each token still " \
               "stands for its own patch" in m.attrs["methods"]
    tr["position_r2"] = vc.evaluate.position_probe(tr, folds=4)
    quoted = json.loads(vc.cam(tr, vc.Recipe(site="F1")).attrs["checklist"])["spatial reconstruction"]
    assert quoted["position probe"].startswith("a ridge probe (vc.evaluate.position_probe, 4-fold CV over patch "
                                               "tokens) predicts each token's grid position from its F1 activations")
