"""vc.interop recognises pytorch-grad-cam's FinerCAM (issue #34 item 4): the translation's recipe on a trace made
with its contrast target gives the library's own FinerCAM map (<= 1e-4 after min-max)."""

from __future__ import annotations

import numpy as np
import pytest
from vitcam_testing import make_input, make_model

import vitcam_nb as vc
from vitcam_nb.core.errors import RecipeError

pgc = pytest.importorskip("pytorch_grad_cam")
FinerCAM = pytest.importorskip("pytorch_grad_cam.finer_cam").FinerCAM
from pytorch_grad_cam import GradCAM, LayerCAM  # noqa: E402
from pytorch_grad_cam.utils.model_targets import FinerWeightedTarget  # noqa: E402


def _reshape(model):
    prefix, (gh, gw) = model.num_prefix_tokens, model.patch_embed.grid_size
    return lambda t: t[:, prefix:, :].reshape(t.size(0), gh, gw, t.size(2)).permute(0, 3, 1, 2)


def _library(model, layers, x, base, **call):
    cam = FinerCAM(model, layers, _reshape(model), base_method=base)
    try:
        return cam(x, **call)[0]
    finally:
        cam.base_cam.activations_and_grads.release()


@pytest.mark.parametrize(("base", "call"), [(GradCAM, {}),
                                            (LayerCAM, {"alpha": 0.7, "comparison_categories": [1, 3],
                                                        "target_idx": 2})])
def test_finercam_call_gives_the_library_map(base, call):
    model, x = make_model("vit"), make_input("vit")
    layers = [model.blocks[1].norm1]
    t = vc.interop.from_pytorch_grad_cam(model, "FinerCAM", layers, _reshape(model), base_method=base, **call)
    assert t.ok and t.findings == [] and t.recipe.site == "F1" and t.recipe.class_ == 0
    assert t.target.against == "nearest" and t.target.alpha == call.get("alpha", 1.0)
    assert "contrast score" in t.report()
    tr = vc.trace(model, x, targets=t.target, sites=["F1"])
    expected = _library(model, layers, x, base, **call)
    ours = vc.cam(tr, t.recipe).values
    assert np.abs(ours - expected).max() <= 1e-4


def test_finer_weighted_target_names_its_classes():
    model, x = make_model("vit"), make_input("vit")
    layers = [model.blocks[1].norm2]
    target = FinerWeightedTarget(4, [0, 2], 0.5)
    t = vc.interop.from_pytorch_grad_cam(model, "FinerCAM", layers, _reshape(model), targets=[target])
    assert (t.target.class_, t.target.against, t.target.alpha) == (4, [0, 2], 0.5)
    tr = vc.trace(model, x, targets=t.target, sites=["F4"])
    expected = _library(model, layers, x, GradCAM, targets=[target])
    assert np.abs(vc.cam(tr, t.recipe).values - expected).max() <= 1e-4


def test_finercam_bad_arguments_are_refused_by_name():
    model = make_model("vit")
    layers = [model.blocks[1].norm1]
    with pytest.raises(RecipeError, match="^base_method:"):
        vc.interop.from_pytorch_grad_cam(model, "FinerCAM", layers, _reshape(model), base_method="AblationCAM")
    with pytest.raises(RecipeError, match="^ranks:"):
        vc.interop.from_pytorch_grad_cam(model, "FinerCAM", layers, _reshape(model), comparison_categories=[])
    with pytest.raises(RecipeError, match="^target_idx:"):
        vc.interop.from_pytorch_grad_cam(model, "FinerCAM", layers, _reshape(model), target_idx=10_000)
