"""Issue #52, finding 10: the ``chefer_lrp`` relevance pass refuses what it does not define, by name and before any
pass: prob and logprob targets of a recipe (the relevance is not linear in its start: the expected logit's relevance
is not the sum of p_j times each class's), contrast and per-block targets, register-token ViTs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc

IMG = 32
IMAGE = np.random.default_rng(3).integers(0, 256, (IMG, IMG, 3), dtype=np.uint8)


def _model(**kw) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, **kw)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


@pytest.fixture
def calls():
    """Forward calls of every model built in the test, counted on its patch embedding."""
    seen: list[int] = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, _args: seen.append(1) if type(m).__name__ == "PatchEmbed" else None)
    yield seen
    handle.remove()


def test_prob_and_logprob_of_a_chefer_trace_are_refused_by_target():
    model = _model()
    tr = vc.trace(model, IMAGE, targets="top3", sites=["F1", "F2"], rule="chefer_lrp")
    # What the refusal protects: on a trace of every class, the expected logit's relevance (traced, started from
    # p) is not the p-weighted sum of the classes' relevances, which a prob target would combine.
    full = vc.trace(model, IMAGE, targets=list(range(5)), sites=["F1"], rule="chefer_lrp")
    p = np.exp(full["logits"].values - full["logits"].values.max())
    p = p / p.sum()
    rel = full["grad"].sel(site="F1").values.astype(np.float64)  # (target, layer, token, channel)
    weighted = np.tensordot(p, rel[:5], axes=1)
    expected = rel[[int(c) for c in full["target_class"].values].index(-1)]
    assert np.abs(weighted - expected).max() > 1e-6 * np.abs(expected).max()
    for target in ("prob", "logprob"):
        with pytest.raises(vc.RecipeError, match=rf"^target: a chefer_lrp trace holds the relevance of each class's "
                                                 rf"one-hot; '{target}' is not derived from it"):
            vc.cam(tr, vc.Recipe(site="F1", layer=-1, target=target))
    vc.cam(tr, vc.Recipe(site="F1", layer=-1, target="logit"))  # the class's own relevance stays


@pytest.mark.parametrize("make", [lambda: vc.targets.contrast(0, against=[1]), lambda: vc.targets.layerwise(0)])
def test_contrast_and_layerwise_targets_are_refused_before_any_pass(make, calls):
    target = make()
    with pytest.raises(vc.TraceError, match=rf"^targets: rule='chefer_lrp' starts its relevance from the one-hot of "
                                            rf"a class \(as the official relprop\); a {target.kind} target is a "
                                            "relevance it does not define"):
        vc.trace(_model(), IMAGE, targets=target, sites=["F2"], rule="chefer_lrp")
    assert calls == []
    vc.trace(_model(), IMAGE, targets=make(), sites=["F2"], rule="gradient")  # the target itself is fine


def test_a_register_token_vit_is_refused_by_rule(calls):
    model = _model(reg_tokens=2)
    with pytest.raises(vc.TraceError, match=r"^rule: rule='chefer_lrp' is defined here for .*; this model has 2 "
                                            "register tokens, which Chefer's ViT has not"):
        vc.trace(model, IMAGE, targets="top1", sites=["F2"], rule="chefer_lrp")
    assert calls == []
    vc.trace(model, IMAGE, targets="top1", sites=["F2"], rule="attnlrp")  # other rules cover register variants
