"""The pytorch-grad-cam family against pytorch-grad-cam 1.5.7 itself on the torchvision-initialised timm ViT of
``parity_cases.py`` (the case the benchmark table reports; ``test_presets_gradcam.py`` covers every site and layer,
``test_scored_parity.py`` Score-CAM and Ablation-CAM): the last block's ``norm1``, class token dropped, min-max
maps at the input size to 1e-4 (pytorch-grad-cam resizes with cv2, the kit with torch's bilinear rule).
"""

from __future__ import annotations

import numpy as np
import pytest
from parity_cases import PGC_METHODS, pgc_vs_kit


@pytest.mark.parametrize("method", PGC_METHODS)
def test_pytorch_grad_cam_methods_equal_the_kits_presets(method):
    case = pgc_vs_kit(method)
    assert case.kit.shape == case.ref.shape == (32, 32)
    assert np.ptp(case.ref) > 0.5  # a real map
    assert case.max_abs <= 1e-4
