"""LLaVA-OneVision's shrunk crop grid (``anyres_max_N``, issue 55): why the ``projector`` site stays refused there.
The model bilinearly resizes the unpadded crop grid after the projector, so one LM token of the shrunk grid is a
blend of several crops' projector rows (measured here by autograd through the model's own packing), and what the
LM reads at each image token, the blend, is exactly ``lm_resid`` at layer 0, which the refusal points to (checked
against the model's own ``get_image_features``). The pre-shrink per-crop rows are another token set (per crop
cell, of the LM's width) that the trace has no variable for; see docs/vlm.md, Limits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from anyres_cases import SIZE, make, pixels, prompt, target  # noqa: E402

import vitcam_nb as vc  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return make("resampled")


def test_lm_resid_layer_0_is_the_packed_resampled_projector_output(model):
    tr = vc.trace(model, pixels(), targets=target("resampled"), sites=["lm_resid"])
    with torch.no_grad():
        packed = model.model.get_image_features(pixel_values=pixels(), image_sizes=torch.tensor([SIZE]))
    feats = packed.pooler_output[0].numpy()  # base 16 + 3 rows of (4 cells + newline)
    first = prompt("resampled").index(63)
    at = tr["image_token_pos"].values - first
    assert feats.shape[0] == 31 and at.size == 28
    np.testing.assert_allclose(tr["lm_resid"].values[0], feats[at], rtol=0, atol=1e-6)


def test_a_shrunk_token_blends_several_crops_projector_rows(model):
    rows = {}

    def keep(_m, _i, out):
        out.retain_grad()
        rows["p"] = out

    h = model.model.multi_modal_projector.register_forward_hook(keep)
    try:
        packed = model.model.get_image_features(pixel_values=pixels(), image_sizes=torch.tensor([SIZE]))
    finally:
        h.remove()
    feats = packed.pooler_output[0]
    owners = []
    for token in range(16, 31):
        if (token - 16) % 5 == 4:
            continue  # a newline token: no crop
        rows["p"].grad = None
        feats[token].sum().backward(retain_graph=True)
        touched = rows["p"].grad.abs().sum(dim=(1, 2))  # per crop the tower ran on
        owners.append(int((touched[1:] > 0).sum()))
        assert touched[0] == 0  # the base view is its own tile
    # 6x8 unpadded cells (padded rows 1..6 of 0..7; crops meet between rows 3 and 4) halved to 3x4: the middle
    # row reads unpadded rows 2-3, padded rows 3 (top crops) and 4 (bottom crops); columns halve within a crop
    assert owners == [1] * 4 + [2] * 4 + [1] * 4


def test_the_projector_stays_refused_by_name_before_the_model_runs(model):
    with pytest.raises(vc.TraceError, match=r"trace lm_resid instead \(its layer 0 is what the LM reads"):
        vc.trace(model, pixels(), targets=target("resampled"), sites=["projector"])
