"""``vc.presets.cp_lrp`` against lxt's own CP-LRP patch for torchvision ViTs (lxt 2.1,
``lxt/efficient/models/vit_torch.py``: identity rule on GELU, the LayerNorm's std a constant, no gradient through
the softmax), run on a tiny random torchvision ViT whose weights the kit traces in a timm copy (issue #53).

lxt 2.1 is installed ``--no-deps`` in CI (its metadata pins old transformers); under transformers 5 its BERT file
fails to import, so ``parity_cases.lxt_cp_lrp_patched`` stubs that file in ``sys.modules`` (the ViT patch does
not use it) and undoes lxt's class-level patch afterwards. zennit is not installed: only lxt's optional Gamma rules
need it, which the kit does not apply (docs/presets.md, "How each preset was checked").
"""

from __future__ import annotations

import numpy as np
import torch
from parity_cases import cp_lrp_vs_lxt


def test_cp_lrp_equals_lxt_cp_lrp_patch_at_the_first_blocks_input():
    forwards = [c.forward for c in (torch.nn.GELU, torch.nn.LayerNorm, torch.nn.MultiheadAttention)]
    case = cp_lrp_vs_lxt()
    assert case.kit.shape == case.ref.shape == (4, 4)
    assert np.ptp(case.ref) > 1e-3  # a real relevance map
    np.testing.assert_allclose(case.kit, case.ref, rtol=0, atol=1e-5 * float(np.abs(case.ref).max()))
    # lxt patches torch's classes for the whole process: undone after the comparison
    assert [c.forward for c in (torch.nn.GELU, torch.nn.LayerNorm, torch.nn.MultiheadAttention)] == forwards
    assert not hasattr(torch.nn.LayerNorm, "original_forward")
