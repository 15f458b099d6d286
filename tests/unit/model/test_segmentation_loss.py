"""The segmentation loss target: the score a trace stores is torch's ``cross_entropy`` of the dense output
against the label map (mean or sum, ``ignore_index``), and its gradient is the one autograd gives, on the bundled
segmenter, a Hugging Face DPT and a UperNet-Swin; bad label maps are refused before any forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitcam_nb as vc
from vitcam_nb.core.errors import TraceError


def _ce(out: torch.Tensor, labels: np.ndarray, ignore: int, reduction: str) -> torch.Tensor:
    return F.cross_entropy(out, torch.from_numpy(labels).long()[None], ignore_index=ignore, reduction=reduction)


@pytest.fixture(scope="module")
def bundled():
    model = vc.load_model("shapes-vit-seg")
    image, label, mask = vc.sample_image("shapes", 0, with_mask=True)
    labels = np.where(mask, label + 1, 0).astype(np.int64)  # background 0, the object's class + 1
    labels[:6, :6] = 255  # a corner left out of the loss
    return model, image, labels


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_stored_score_and_gradient_are_torch_cross_entropy_on_the_bundled_segmenter(bundled, reduction):
    model, image, labels = bundled
    target = vc.targets.segmentation_loss(labels, ignore_index=255, reduction=reduction)
    tr = vc.trace(model, image, targets=target, sites=["F1"])
    x = vc.preprocess.prepare_input(model, image).tensor
    seen = {}
    hook = model.blocks[-1].norm1.register_forward_hook(lambda _m, _i, o: seen.setdefault("F1", o))
    try:
        loss = _ce(model(x), labels, 255, reduction)
        grad = torch.autograd.grad(loss, seen["F1"])[0][0].numpy()
    finally:
        hook.remove()
    np.testing.assert_allclose(tr["logits"].values, [loss.item()], rtol=1e-5)
    assert tr.attrs["target_kind"] == "segmentation_loss" and tr["target_class"].values[0] == 0
    stored = tr["grad"].sel(layer=int(tr["layer"].values[-1]), site="F1", target="logit_0").values
    np.testing.assert_allclose(stored, grad, rtol=1e-4, atol=1e-6 * np.abs(grad).max())
    m = vc.cam(tr, vc.Recipe(site="F1", layer=-1, upsample="none", normalize="none"))
    act = seen["F1"].detach()[0, 1:].numpy()
    want = np.maximum(act @ grad[1:].mean(0), 0).reshape(m.shape)
    np.testing.assert_allclose(m.values, want, rtol=1e-4, atol=1e-6 * want.max())
    assert "cross-entropy" in m.attrs["methods"] and "ignore_index 255" in m.attrs["methods"]


def test_the_loss_on_a_dpt_and_a_upernet_is_torch_cross_entropy():
    pytest.importorskip("transformers")
    from unit.model.test_hf_dpt import build as build_dpt
    from unit.model.test_hf_dpt import make_input as dpt_input
    from unit.model.test_hf_upernet import make_image, make_upernet

    for model, x in ((build_dpt(), dpt_input()), (make_upernet(), make_image())):
        with torch.no_grad():
            out = model(pixel_values=x).logits
        labels = np.random.default_rng(0).integers(0, out.shape[1], out.shape[-2:])
        labels[0, :] = -100
        tr = vc.trace(model, x, targets=vc.targets.segmentation_loss(labels), sites=["F1"])
        np.testing.assert_allclose(tr["logits"].values, [_ce(out, labels, -100, "mean").item()], rtol=1e-5)


@pytest.mark.parametrize("labels,kwargs,match", [
    (np.zeros((4, 4, 1), int), {}, "labels: expected an \\(H, W\\) label map"),
    (np.zeros((4, 4)), {}, "labels: expected integer class indices"),
    (np.full((4, 4), 7), {"ignore_index": 7}, "every pixel is ignore_index 7"),
    (np.zeros((4, 4), int), {"reduction": "none"}, "reduction: expected one of"),
    (np.zeros((4, 4), int), {"ignore_index": 1.5}, "ignore_index: expected an int"),
])
def test_bad_label_maps_are_refused_when_made(labels, kwargs, match):
    with pytest.raises(TraceError, match=match):
        vc.targets.segmentation_loss(labels, **kwargs)


def test_a_label_map_that_does_not_fit_the_output_is_refused(bundled):
    model, image, labels = bundled
    with pytest.raises(TraceError, match="labels: the map is 32x32 but the model's output is 64x64"):
        vc.trace(model, image, targets=vc.targets.segmentation_loss(labels[:32, :32]), sites=["F1"])
    with pytest.raises(TraceError, match="labels: class 9 is out of range; the model has 6 classes"):
        vc.trace(model, image, targets=vc.targets.segmentation_loss(np.full((64, 64), 9)), sites=["F1"])
