"""``vc.presets.legrad`` against LeGrad's authors' code and torchcam's LeGrad, run unchanged on the same weights and
input (issue #53): the official ``legrad/wrapper.py`` (pip ``legrad-torch`` 1.1, installed ``--no-deps`` in CI
because it pins open-clip-torch<=2.23) on a tiny random open_clip CLIP built in code, and torchcam 0.5's
``LeGrad`` on a tiny random torchvision ``VisionTransformer`` whose weights are copied into a timm ViT for the kit
(``parity_cases.py``). Maps agree to 1e-5 (min-max normalised; the official 32x32 upsampled map, torchcam's patch
grid). The kit's class-token variant ``legrad_cls`` is shown NOT to be the official map.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity_cases import image_tensor, legrad_vs_legrad_torch, legrad_vs_torchcam, torchvision_and_timm

import vitcam_nb as vc
from vitcam_nb.core.errors import RecipeError

TOL = 1e-5


@pytest.mark.parametrize(("layer_index", "layer"), [(-2, None), (0, "all"), (1, (1, 2))])
def test_legrad_equals_legrad_torch_on_open_clip(layer_index, layer):
    case = legrad_vs_legrad_torch(layer_index, layer)
    assert case.kit.shape == case.ref.shape == (32, 32)
    assert case.max_abs <= TOL
    assert np.ptp(case.ref) == pytest.approx(1.0)  # a real, min-max normalised map
    if layer is None:  # the preset's default blocks are the official default's (layer_index=-2: the last two)
        assert case.notes["recipe"].layer == (-2, -1)


def test_legrad_cls_is_not_the_official_map():
    case = legrad_vs_legrad_torch(-2, (-2, -1), readout="model")
    assert case.max_abs > 0.05 and case.pearson < 0.99


@pytest.mark.parametrize(("blocks", "layer"), [((-2, -1), None), ((0, 1, 2), "all")])
def test_legrad_equals_torchcam_legrad_on_torchvision_vit(blocks, layer):
    case = legrad_vs_torchcam(blocks, None if layer is None else vc.presets.legrad(layer=layer))
    assert case.kit.shape == case.ref.shape == (4, 4)
    assert case.max_abs <= TOL
    tv, tr, c = case.notes["tv"], case.notes["trace"], case.notes["class"]
    with torch.no_grad():  # the timm copy is the same network
        assert float((tv(case.notes["x"]) - case.notes["timm"](case.notes["x"])).abs().max()) <= 1e-5
    # torchcam's per-block scores are the kit's: heads(ln(mean over all tokens)) of each block's output
    outs = []
    hooks = [blk.register_forward_hook(lambda _m, _i, o: outs.append(o)) for blk in tv.encoder.layers]
    with torch.no_grad():
        tv(case.notes["x"])
        scores = [float(tv.heads(tv.encoder.ln(o.mean(1)))[0, c]) for o in outs]
    for h in hooks:
        h.remove()
    np.testing.assert_allclose(tr["logits"].values, scores, rtol=1e-5, atol=1e-6)


def test_top1_is_the_models_own_top_class_whatever_the_readout():
    # on this input the model's top class (3) is not the top class of the last block's mean read-out (1)
    tv, tm = torchvision_and_timm()
    x = image_tensor(6)
    last = []
    hook = tm.blocks[-1].register_forward_hook(lambda _m, _i, o: last.append(o))
    with torch.no_grad():
        own = int(tv(x).argmax())
        assert int(tm(x).argmax()) == own
        mean_top = int(tm.head(tm.norm(last[0].mean(1))).argmax())
    hook.remove()
    assert own != mean_top
    for readout in ("mean", "model"):
        tr = vc.trace(tm, x, targets=vc.targets.layerwise(readout=readout), sites=["F2"])
        assert int(tr.attrs["layerwise_class"]) == own


def test_legrad_presets_refuse_the_other_readout():
    _, tm = torchvision_and_timm()
    x = image_tensor()
    official = vc.trace(tm, x, targets=vc.targets.layerwise(), sites=["F2"])
    kits = vc.trace(tm, x, targets=vc.targets.layerwise(readout="model"), sites=["F2"])
    with pytest.raises(RecipeError, match="read out by 'model'; trace with .*readout='mean'.*legrad_cls"):
        vc.cam(kits, vc.presets.legrad())
    with pytest.raises(RecipeError, match="read out by 'mean'; trace with .*readout='model'.*legrad\\(\\)"):
        vc.cam(official, vc.presets.legrad_cls())
    # the read-out is part of the trace id; a trace of the earlier read-out keeps the id it had (no "readout" key)
    assert official.attrs["trace_id"] != kits.attrs["trace_id"]
    assert "readout" not in vc.targets.layerwise(readout="model").settings()
    # the old preset's recipe id is legrad_cls's: a stored id keeps meaning the class-token read-out
    assert vc.presets.legrad_cls().id == "3dbb53ddae17" and vc.presets.legrad().id != "3dbb53ddae17"
    assert vc.presets.preset_name(vc.Recipe.from_json(vc.presets.legrad_cls().to_json())) == "legrad_cls"
    with pytest.raises(vc.VitcamError, match="readout"):
        vc.targets.layerwise(readout="cls")
    # each map's checklist says which LeGrad it is: the official one, or the kit's class-token variant
    ours = vc.cam(kits, vc.presets.legrad_cls()).attrs
    assert "this is LeGrad, class-token read-out (the kit's variant)" in ours["checklist"]
    assert "the model's own pooling" in ours["checklist"]
    theirs = vc.cam(official, vc.presets.legrad()).attrs
    assert "this is LeGrad (" in theirs["checklist"] and "legrad/wrapper.py" in theirs["checklist"]
    assert "mean over all tokens (class token included)" in theirs["methods"]
