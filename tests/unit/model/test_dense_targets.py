"""Dense targets (issue #19): region scores against a NumPy reference, mask resizing and its refusals, user
scores of a dense output, and the per-token linear segmenter traced by the vit adapter."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import vitcam_nb as vc
from vitcam_nb.core.errors import TraceError
from vitcam_nb.data.segmenter import LinearSegmenter


@pytest.fixture
def seg():
    torch.manual_seed(0)
    model = LinearSegmenter(3, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4).eval()
    return model, torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))


def test_segmenter_is_a_per_token_linear_head(seg):
    model, x = seg
    with torch.no_grad():
        out = model(x)
        tokens = model.forward_features(x)[0, 1:]  # 16 patch tokens after the final norm
        grid = (tokens @ model.seg_head.weight.T + model.seg_head.bias).T.reshape(1, 3, 4, 4)
        ref = torch.nn.functional.interpolate(grid, size=(32, 32), mode="bilinear", align_corners=False)
    assert out.shape == (1, 3, 32, 32)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_region_scores_and_trace(seg, reduce):
    model, x = seg
    mask = np.zeros((32, 32), bool)
    mask[4:12, 8:30] = True
    target = vc.targets.region(mask, 1, reduce=reduce)
    tr = vc.trace(model, x, targets=target, sites=["F1"])
    with torch.no_grad():
        out = model(x)[0].numpy().astype(np.float64)
    ref = (out * mask).sum(axis=(1, 2)) / (mask.sum() if reduce == "mean" else 1)
    np.testing.assert_allclose(tr["logits"].values, ref, rtol=1e-5)
    assert tr["target_class"].values.tolist() == [1, -1] and tr.attrs["target_kind"] == "region"
    assert reduce in tr.attrs["target_scores"]
    # the gradient of the region score, by autograd here, is what the trace stored
    act = {}
    h = model.blocks[1].norm1.register_forward_hook(lambda _m, _i, o: act.setdefault("F1", o))
    try:
        z = (model(x)[0, 1] * torch.from_numpy(mask)).sum()
        g = torch.autograd.grad(z / (mask.sum() if reduce == "mean" else 1), act["F1"])[0][0].numpy()
    finally:
        h.remove()
    stored = tr["grad"].sel(layer=1, site="F1", target="logit_1").values
    np.testing.assert_allclose(stored, g, rtol=1e-4, atol=1e-6 * np.abs(g).max())


def test_mask_resizing_and_refusals(seg):
    model, x = seg
    small = np.zeros((8, 8), bool)
    small[1:3, 2:6] = True
    with pytest.warns(UserWarning, match="mask: 8x8 resized to the model's 32x32 output"):
        s = vc.targets.region(small, 0).batch_scores(model, x)
    big = np.kron(small, np.ones((4, 4), bool))
    with torch.no_grad():
        np.testing.assert_allclose(s.detach().numpy(), vc.targets.region(big, 0).batch_scores(model, x).numpy(),
                                   rtol=1e-6)
    with pytest.raises(TraceError, match="mask: 10x10 does not fit the model's 32x32 output"):
        vc.targets.region(np.ones((10, 10)), 0).batch_scores(model, x)
    with pytest.raises(TraceError, match="mask: the region is empty"):
        vc.targets.region(np.zeros((32, 32)), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        one = np.zeros((64, 64), bool)
        one[1, 1] = True  # the nearest-neighbour subsample to 32x32 keeps even pixels only
        with pytest.raises(TraceError, match="mask: the region is empty at the model's output size"):
            vc.targets.region(one, 0).batch_scores(model, x)
    with pytest.raises(TraceError, match="class_: 5 is out of range; the model has 3 classes"):
        vc.trace(model, x, targets=vc.targets.region(np.ones((32, 32)), 5))
    with pytest.raises(TraceError, match="reduce"):
        vc.targets.region(np.ones((32, 32)), 0, reduce="max")
    with pytest.raises(TraceError, match="model: a dense target needs"):
        vc.targets.region(np.ones((2, 2)), 0).batch_scores(lambda t: torch.zeros(1, 3), x)


def test_dense_user_scores(seg):
    model, x = seg
    target = vc.targets.dense(lambda out: torch.stack([out[:, 0].amax(dim=(-2, -1)), out[:, 2].mean(dim=(-2, -1))],
                                                      dim=1), ["max of class 0", "mean of class 2"])
    tr = vc.trace(model, x, targets=target, sites=["F1"])
    with torch.no_grad():
        out = model(x)[0]
    np.testing.assert_allclose(tr["logits"].values, [float(out[0].max()), float(out[2].mean())], rtol=1e-5)
    assert tr["target_label"].values.tolist() == ["max of class 0", "mean of class 2", "expected logit"]
    with pytest.raises(TraceError, match=r"fn: expected \(1,\) or \(1, 2\) scores"):
        vc.trace(model, x, targets=vc.targets.dense(lambda out: out.sum(dim=(2, 3)), ["a", "b"]))


def test_score_needs_the_traced_dense_target(seg):
    model, x = seg
    mask = np.zeros((32, 32), bool)
    mask[4:20, 4:20] = True
    tr = vc.trace(model, x, targets=vc.targets.region(mask, 0), sites=["F1"], layers=[1])
    with pytest.raises(TraceError, match="targets: this trace's scores are 'region' targets"):
        vc.score(tr, model, "scorecam", x, layer=1)
    with pytest.raises(TraceError, match="not the trace's logits"):
        vc.score(tr, model, "scorecam", x, layer=1, targets=vc.targets.region(~mask, 0))
    with pytest.raises(TraceError, match="expected the 'region' target"):
        vc.score(tr, model, "scorecam", x, layer=1, targets=vc.targets.dense(lambda o: o.mean((1, 2, 3)), ["m"]))
