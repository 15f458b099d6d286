"""Contrast targets (FinerCAM, issue #34 item 4): the stored gradient is the gradient of the contrast score, by a
hand-written autograd reference; FinerCAM's "nearest" classes; bad input refused naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb.core.errors import TraceError


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                          num_classes=7).eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return m, x


def _reference(model, x, score):
    """The gradient of score(logits) at blocks[1].norm1's output (site F1 of block 1), by autograd."""
    act = {}
    h = model.blocks[1].norm1.register_forward_hook(lambda _m, _i, o: act.setdefault("F1", o))
    try:
        z = model(x)[0]
        s = score(z)
        g = torch.autograd.grad(s, act["F1"])[0][0]
    finally:
        h.remove()
    return z.detach().double().numpy(), float(s.detach()), g.numpy()


def _stored(tr):
    return tr["grad"].sel(layer=1, site="F1").isel(target=0).values


def test_given_weights_gradient_is_the_autograd_of_the_linear_combination(vit):
    model, x = vit
    tr = vc.trace(model, x, targets=vc.targets.contrast(2, against=[0, 5], weights=[0.25, 1.5]), sites=["F1"])
    z, s, g = _reference(model, x, lambda z: z[2] - 0.25 * z[0] - 1.5 * z[5])
    np.testing.assert_allclose(_stored(tr), g, rtol=1e-5, atol=1e-5 * np.abs(g).max())
    # The score is a difference of logits: their float32 rounding (the pass runs attention unfused, the reference
    # fused; 7.7e-7 apart on a CPU without AVX-512) is relative to the logits, not to the difference.
    assert float(tr["logits"].values[0]) == pytest.approx(s, rel=1e-5, abs=1e-5 * np.abs(z).max())
    assert tr["target_class"].values.tolist() == [0, -1]
    assert (tr.attrs["contrast_class"], tr.attrs["contrast_against"], tr.attrs["contrast_weights"]) == (2, "0,5",
                                                                                                      "0.25,1.5")
    # the same gradient is the same linear combination of the class logits' gradients of one class trace
    cls = vc.trace(model, x, targets=[2, 0, 5], sites=["F1"])
    grad = cls["grad"].sel(layer=1, site="F1")
    combo = grad.sel(target="logit_2") - 0.25 * grad.sel(target="logit_0") - 1.5 * grad.sel(target="logit_5")
    np.testing.assert_allclose(_stored(tr), combo.values, rtol=1e-5, atol=1e-5 * np.abs(g).max())


def test_finercam_nearest_and_softmax_weights_as_pytorch_grad_cam(vit):
    model, x = vit
    t = vc.targets.contrast()  # FinerCAM's defaults: top-1 class, the 3 nearest by logit, alpha 1
    tr = vc.trace(model, x, targets=t, sites=["F1"])
    with torch.no_grad():
        z = model(x)[0].double().numpy()
    main = int(np.argmax(z))
    # nearest by hand: every other class with its logit distance, smallest first
    near = [k for _, k in sorted((abs(z[k] - z[main]), k) for k in range(len(z)) if k != main)][:3]
    assert tr.attrs["contrast_class"] == main and tr.attrs["contrast_against"] == ",".join(map(str, near))

    def finer(zz):  # FinerWeightedTarget's formula, written out
        p = torch.softmax(zz, dim=-1)
        num = sum(p[k] * (zz[main] - 1.0 * zz[k]) for k in near)
        return num / (sum(p[k] for k in near) + 1e-9)

    _, s, g = _reference(model, x, finer)
    np.testing.assert_allclose(_stored(tr), g, rtol=1e-5, atol=1e-5 * np.abs(g).max())
    assert float(tr["logits"].values[0]) == pytest.approx(s, rel=1e-5)
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    w = [float(v) for v in tr.attrs["contrast_weights"].split(",")]
    np.testing.assert_allclose(w, p[near] / p[near].sum(), rtol=1e-6)
    # the checklist's gradient target states the classes and the weighting
    text = vc.cam(tr, vc.Recipe(site="F1", layer=1)).attrs["checklist"]
    assert "FinerCAM" in text and f"z_{main}" in text and all(f"z_{k}" in text for k in near)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(class_=2, against=[]), "against"),
    (dict(class_=2, against=[2, 3]), "against"),
    (dict(class_=2, against=[0, 1], weights=[1.0]), "weights"),
    (dict(class_=2, against="nearest", weights=[1.0, 2.0]), "weights"),
    (dict(class_=2, against="closest"), "against"),
    (dict(class_=-1), "class_"),
    (dict(class_="dog"), "class_"),
    (dict(class_=2, against=[0, 1], weights=[1.0, float("nan")]), "weights"),
    (dict(ranks=[0, 1]), "ranks"),
])
def test_bad_arguments_are_refused_by_name(kwargs, argument):
    with pytest.raises(TraceError, match=f"^{argument}:"):
        vc.targets.contrast(**kwargs)


def test_unknown_classes_are_refused_before_the_pass(vit):
    model, x = vit
    with pytest.raises(TraceError, match="^class_: class 9 is out of range"):
        vc.trace(model, x, targets=vc.targets.contrast(9, against=[0]), sites=["F1"])
    with pytest.raises(TraceError, match=r"^against: class\(es\) \[7\] out of range"):
        vc.trace(model, x, targets=vc.targets.contrast(1, against=[0, 7]), sites=["F1"])
    with pytest.raises(TraceError, match="^ranks: rank 7 needs 8 classes"):
        vc.trace(model, x, targets=vc.targets.contrast(1, ranks=(1, 7)), sites=["F1"])


def test_classes_chosen_at_the_traced_image_are_kept_for_perturbed_inputs(vit):
    model, x = vit
    t = vc.targets.contrast(ranks=(1, 2))
    vc.trace(model, x, targets=t, sites=["F1"])
    main, near, _ = t.resolved
    others = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = t.batch_scores(model, others)[:, 0].double().numpy()
        z = model(others).double()
    p = torch.softmax(z, dim=-1)[:, near]
    want = ((p * (z[:, [main]] - z[:, near])).sum(1) / (p.sum(1) + 1e-9)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert t.resolved[:2] == (main, near)  # FinerCAM keeps its target's classes for every perturbed input
    t.check(model)  # a new trace chooses them again
    assert t.resolved is None
