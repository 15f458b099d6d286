"""vc.interop (issue #21): the recipe a pytorch-grad-cam call computes gives the library's own map (<= 1e-4 after
its min-max normalisation) on a ViT, a DeiT-distilled and a register model; known-bad calls give findings and
no recipe; torchcam and Captum on ViT tokens return maps over embedding dimensions, which no recipe expresses."""

from __future__ import annotations

import numpy as np
import pytest
from vitcam_testing import SPECS, make_input, make_model

import vitcam_nb as vc
from vitcam_nb.core.errors import RecipeError

pgc = pytest.importorskip("pytorch_grad_cam")
from pytorch_grad_cam import GradCAM, HiResCAM, LayerCAM  # noqa: E402
from pytorch_grad_cam.utils.model_targets import (  # noqa: E402
    ClassifierOutputSoftmaxTarget,
    ClassifierOutputTarget,
)

KINDS = ("vit", "deit_distilled", "vit_reg")


def right_reshape(model):
    prefix = model.num_prefix_tokens
    gh, gw = model.patch_embed.grid_size

    def rt(t):
        return t[:, prefix:, :].reshape(t.size(0), gh, gw, t.size(2)).permute(0, 3, 1, 2)
    return rt


def tutorial_reshape(t):  # pytorch-grad-cam's ViT tutorial, with the grid of the 32 px models: drops one token
    return t[:, 1:, :].reshape(t.size(0), 4, 4, t.size(2)).permute(0, 3, 1, 2)


def sliced_reshape(t):  # drops one token and keeps 16: on DeiT-distilled the distillation token becomes a patch
    return t[:, 1:17, :].reshape(t.size(0), 4, 4, t.size(2)).permute(0, 3, 1, 2)


def library_map(method, model, layers, rt, x, targets):
    with method(model=model, target_layers=layers, reshape_transform=rt) as cam:
        return cam(input_tensor=x, targets=targets)[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("method", "target"), [(GradCAM, ClassifierOutputTarget(3)),
                                                (HiResCAM, ClassifierOutputSoftmaxTarget(3)),
                                                (LayerCAM, None)])
def test_recipe_map_equals_the_library_map(kind, method, target):
    model, x = make_model(kind), make_input(kind)
    targets = None if target is None else [target]
    layers = [model.blocks[1].norm2]
    t = vc.interop.from_pytorch_grad_cam(model, method, target_layers=layers, reshape_transform=right_reshape(model),
                                         targets=targets)
    assert t.ok and t.findings == [] and t.recipe.site == "F4" and t.recipe.layer == 1
    assert t.recipe.target == ("logit" if not isinstance(target, ClassifierOutputSoftmaxTarget) else "prob")
    expected = library_map(method, model, layers, right_reshape(model), x, targets)
    tr = vc.trace(model, x, targets="top1" if target is None else [3])
    ours = vc.cam(tr, t.recipe).values
    assert ours.shape == expected.shape
    assert np.abs(ours - expected).max() <= 1e-4


def test_two_layers_are_averaged_like_the_library():
    model, x = make_model("vit"), make_input("vit")
    layers = [model.blocks[0].norm1, model.blocks[1].norm1]
    t = vc.interop.from_pytorch_grad_cam(model, GradCAM, layers, right_reshape(model), [ClassifierOutputTarget(2)])
    assert t.recipe.layer == (0, 1) and t.recipe.layer_fusion == "mean"
    expected = library_map(GradCAM, model, layers, right_reshape(model), x, [ClassifierOutputTarget(2)])
    assert np.abs(vc.cam(vc.trace(model, x, targets=[2]), t.recipe).values - expected).max() <= 1e-4


@pytest.mark.parametrize("kind", ["deit_distilled", "vit_reg"])
def test_tutorial_reshape_on_prefix_models_is_a_finding(kind):
    model = make_model(kind)
    t = vc.interop.from_pytorch_grad_cam(model, GradCAM, [model.blocks[1].norm1], tutorial_reshape,
                                         [ClassifierOutputTarget(1)])
    assert t.recipe is None and not t.ok
    assert t.findings[0].kind == "reshape" and f"{len(SPECS[kind].prefix)} prefix" in t.findings[0].message
    assert t.corrected.site == "F1" and t.corrected.weight_tokens == "patch"
    with pytest.raises(RuntimeError):  # the library itself cannot run this call
        library_map(GradCAM, model, [model.blocks[1].norm1], tutorial_reshape, make_input(kind),
                    [ClassifierOutputTarget(1)])


def test_distillation_token_kept_as_a_patch_is_a_finding_and_no_recipe_matches():
    model, x = make_model("deit_distilled"), make_input("deit_distilled")
    layers = [model.blocks[1].norm1]
    t = vc.interop.from_pytorch_grad_cam(model, GradCAM, layers, sliced_reshape, [ClassifierOutputTarget(1)])
    assert t.recipe is None
    assert [f.kind for f in t.findings] == ["prefix token"] and "['dist']" in t.findings[0].message
    wrong = library_map(GradCAM, model, layers, sliced_reshape, x, [ClassifierOutputTarget(1)])
    meant = vc.cam(vc.trace(model, x, targets=[1]), t.corrected).values
    assert np.abs(wrong - meant).max() > 1e-2  # the corrected recipe is not what the bad call computed


def test_hard_coded_14x14_on_a_384px_model():
    model = make_model("vit", img_size=384, patch_size=16, depth=1)
    rt = lambda t: t[:, 1:, :].reshape(t.size(0), 14, 14, t.size(2)).permute(0, 3, 1, 2)  # noqa: E731
    t = vc.interop.from_pytorch_grad_cam(model, GradCAM, [model.blocks[0].norm1], rt)
    assert t.recipe is None and "24x24 patches" in t.findings[0].message


def test_a_module_that_is_not_a_site_is_refused_naming_the_sites():
    model = make_model("vit")
    with pytest.raises(RecipeError, match=r"blocks.1.attn.qkv.*F1 \(blocks.1.norm1:output\)"):
        vc.interop.from_pytorch_grad_cam(model, GradCAM, [model.blocks[1].attn.qkv], right_reshape(model))


def test_a_headless_model_targets_an_embedding_dimension():
    model = make_model("vit", num_classes=0)
    t = vc.interop.from_pytorch_grad_cam(model, GradCAM, [model.blocks[1].norm1], right_reshape(model))
    assert t.recipe is None and t.findings[0].kind == "target" and "embedding dimension" in t.findings[0].message


def test_torchcam_on_vit_tokens_is_no_recipe():
    methods = pytest.importorskip("torchcam.methods")
    model, x = make_model("vit"), make_input("vit")
    t = vc.interop.from_torchcam(model, "GradCAM", target_layer="blocks.1.norm1", class_idx=3)
    assert t.recipe is None and t.findings[0].kind == "token axis"
    assert (t.corrected.site, t.corrected.layer, t.corrected.class_) == ("F1", 1, 3)
    extractor = methods.GradCAM(model, target_layer="blocks.1.norm1")
    try:
        cams = extractor(3, model(x))
    finally:
        extractor.remove_hooks()
    assert cams[0].shape[-1] == model.embed_dim  # indexed by embedding dimension, not by patch
    with pytest.raises(RecipeError, match="is not a site"):
        vc.interop.from_torchcam(model, "GradCAM", target_layer="blocks.1.mlp.fc1")


def test_captum_on_vit_tokens_is_no_recipe():
    attr = pytest.importorskip("captum.attr")
    model, x = make_model("vit_reg"), make_input("vit_reg")
    method = attr.LayerGradCam(model, model.blocks[2].norm1)
    t = vc.interop.from_captum(method, target=4)
    assert t.recipe is None and (t.corrected.site, t.corrected.layer, t.corrected.class_) == ("F1", 2, 4)
    out = method.attribute(x, target=4)
    assert tuple(out.shape) == (1, 1, model.embed_dim)
    assert "No recipe expresses" in t.report() and t.corrected.id in t.report()
