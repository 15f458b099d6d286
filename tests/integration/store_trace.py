"""The tiny ViT, the image and its trace that the store and trace-file reliability tests
(``test_reliability_store_*.py``) trace, save and load."""

from __future__ import annotations

import numpy as np
from vitcam_testing import make_model

import vitcam_nb as vc

MODEL = make_model("vit")
IMAGE = np.random.default_rng(5).integers(0, 255, (32, 32, 3), dtype=np.uint8)
TRACE = vc.trace(MODEL, IMAGE, targets="top1", sites=["F1"])
