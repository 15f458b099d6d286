"""Issue #32, vc.interop: a call on a family the kit traces is answered right (the translated recipe, computed with
vc.cam, gives pytorch-grad-cam 1.5.7's own map) or refused with the kit's error, never misjudged; Swin is probed at
the grid of the stage the hooked module sits in; models interop does not read (Hugging Face, open_clip) and bad
targets are refused with RecipeError; an AblationCAM call states pytorch-grad-cam's ablation value; the preset
citation takes a name. A hypothesis fuzz of the entry points lets only the kit's own errors escape."""

from __future__ import annotations

import math

import numpy as np
import pytest
import timm
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vitcam_testing import SPECS, make_input, make_model, tiny_hf_vit, tiny_open_clip

import vitcam_nb as vc
from vitcam_nb.core.errors import RecipeError, TraceError, TraceFileError

pytest.importorskip("pytorch_grad_cam")
from pytorch_grad_cam import AblationCAM, GradCAM  # noqa: E402
from pytorch_grad_cam.ablation_layer import AblationLayerVit  # noqa: E402
from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget  # noqa: E402

CLASS = 3


def _redraw(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """O(1) weights (timm's init gives near-uniform attention and near-zero logits, which hides mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("cls_token", "pos_embed", "relative_position_bias_table") or "cpb_mlp" in name:
                p.copy_(0.5 * noise)
            elif leaf in ("gamma", "gamma_1", "gamma_2") or (leaf == "weight" and p.ndim == 1):
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim >= 2:
                p.copy_(noise / math.sqrt(p[0].numel()))
            elif "logit_scale" not in name:
                p.copy_(0.1 * noise)
    return model.eval()


def _timm(name: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return _redraw(timm.create_model(name, pretrained=False, num_classes=10, **kw))


SWIN = dict(img_size=64, window_size=4, depths=(2, 2), num_heads=(2, 4), embed_dim=16)
#: family -> (model builder, input (H, W)); the kinds of tests/vitcam_testing.py first.
FAMILIES = {kind: (lambda kind=kind: make_model(kind), SPECS[kind].input_hw) for kind in SPECS}
FAMILIES.update({
    "swin": (lambda: _timm("swin_tiny_patch4_window7_224", **SWIN), (64, 64)),
    "swinv2": (lambda: _timm("swinv2_tiny_window8_256", **SWIN), (64, 64)),
    "beit": (lambda: _timm("beitv2_base_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4),
             (32, 32)),
    "eva02": (lambda: _timm("eva02_tiny_patch14_224", img_size=28, patch_size=7, embed_dim=32, depth=2, num_heads=4,
                            ref_feat_shape=(4, 4)), (28, 28)),
})


def _image(hw: tuple[int, int]) -> torch.Tensor:
    return torch.randn((1, 3, *hw), generator=torch.Generator().manual_seed(5))


def _probed_block(model: torch.nn.Module) -> torch.nn.Module:
    """The last stage's second-to-last block (the last block's patch tokens often never reach the output)."""
    return model.layers[-1].blocks[-2] if hasattr(model, "layers") else model.blocks[-2]


def _right_reshape(model: torch.nn.Module, module: torch.nn.Module, hw: tuple[int, int]):
    """A reshape written from the model's own attributes (not from vitcam_nb): tokens after the prefix on the
    patch grid, or, on Swin, the (H, W, C) grid of the block's stage."""
    if hasattr(model, "layers"):
        h, w = _probed_block(model).input_resolution
        return lambda t: t.reshape(t.size(0), h, w, t.size(-1)).permute(0, 3, 1, 2)
    gh, gw = hw[0] // model.patch_embed.patch_size[0], hw[1] // model.patch_embed.patch_size[1]
    prefix = model.num_prefix_tokens
    return lambda t: t[:, prefix:, :].reshape(t.size(0), gh, gw, t.size(2)).permute(0, 3, 1, 2)


def _library_map(method, model, layer, rt, x, **kw) -> np.ndarray:
    with method(model=model, target_layers=[layer], reshape_transform=rt, **kw) as cam:
        return cam(input_tensor=x, targets=[ClassifierOutputTarget(CLASS)])[0]


def _swin_probe_call(model: torch.nn.Module, layer: torch.nn.Module) -> vc.interop.Translation:
    return vc.interop.from_pytorch_grad_cam(model, "GradCAM", target_layers=[layer],
                                            reshape_transform=lambda t: t.permute(0, 3, 1, 2),
                                            targets=[ClassifierOutputTarget(CLASS)])


def test_swin_last_stage_call_of_the_issue_is_answered_and_its_recipe_gives_the_library_map():
    model = FAMILIES["swin"][0]()
    x = _image((64, 64))
    layer = model.layers[-1].blocks[-1].norm1
    t = _swin_probe_call(model, layer)
    assert t.ok and t.findings == [] and t.recipe.site == "F1" and t.recipe.layer == 3
    expected = _library_map(GradCAM, model, layer, lambda t: t.permute(0, 3, 1, 2), x)
    ours = vc.cam(vc.trace(model, x, targets=[CLASS]), t.recipe).values
    np.testing.assert_allclose(ours, expected, atol=1e-5)


def test_swin_probe_uses_each_stage_grid():
    model = FAMILIES["swin"][0]()
    # stage 0 is 16x16 of 16 channels, stage 1 8x8 of 32: a reshape hard-coding stage 0's grid is wrong at stage 1
    stage0 = lambda t: t.reshape(t.size(0), 16, 16, 16).permute(0, 3, 1, 2)  # noqa: E731
    right = vc.interop.from_pytorch_grad_cam(model, GradCAM, [model.layers[0].blocks[1].norm1], stage0)
    wrong = vc.interop.from_pytorch_grad_cam(model, GradCAM, [model.layers[1].blocks[1].norm1], stage0)
    assert right.ok and right.recipe.layer == 1
    assert not wrong.ok and wrong.findings[0].kind == "reshape" and "8x8" in wrong.findings[0].message


@pytest.mark.parametrize("site", ["F1", "F4", "F6"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_is_answered_right_or_refused(family, site):
    build, hw = FAMILIES[family]
    model, x = build(), _image(hw)
    block = _probed_block(model)
    module = {"F1": block.norm1, "F4": block.norm2, "F6": block}[site]
    rt = _right_reshape(model, module, hw)
    try:
        t = vc.interop.from_pytorch_grad_cam(model, GradCAM, [module], rt, [ClassifierOutputTarget(CLASS)],
                                             input_size=hw)
    except RecipeError as exc:  # refused: only where no site is that module (post-norm Swin V2's norms)
        assert family == "swinv2" and site in ("F1", "F4") and "not a site" in str(exc)
        return
    assert t.ok, t.report()
    assert t.recipe.site == site
    expected = _library_map(GradCAM, model, module, rt, x)
    ours = vc.cam(vc.trace(model, x, targets=[CLASS]), t.recipe).values
    np.testing.assert_allclose(ours, expected, atol=1e-5)
    # and a mirrored grid (the same cells in another order) is never taken for the recipe
    mirrored = vc.interop.from_pytorch_grad_cam(model, GradCAM, [module], lambda t: rt(t).flip(-1),
                                                [ClassifierOutputTarget(CLASS)], input_size=hw)
    assert not mirrored.ok and mirrored.findings[0].kind == "order"


def test_dynamic_size_model_needs_the_input_size():
    model = make_model("vit_dynamic")
    rt = _right_reshape(model, model.blocks[-1].norm1, (24, 40))
    with pytest.raises(RecipeError, match=r"^input_size: .*dynamic_img_size"):
        vc.interop.from_pytorch_grad_cam(model, GradCAM, [model.blocks[-1].norm1], rt)
    with pytest.raises(RecipeError, match=r"^input_size: "):
        fixed = make_model("vit")
        vc.interop.from_pytorch_grad_cam(fixed, GradCAM, [fixed.blocks[-1].norm1], rt, input_size=(24, 40))


@pytest.mark.parametrize("family", ["hf_vit", "open_clip"])
@pytest.mark.parametrize("entry", ["pytorch_grad_cam", "torchcam"])
def test_models_interop_does_not_read_are_refused_naming_the_family(family, entry):
    model = tiny_hf_vit() if family == "hf_vit" else tiny_open_clip()
    layer = model.vit.layers[-1].layernorm_before if family == "hf_vit" else \
        model.visual.transformer.resblocks[-1].ln_1
    rt = lambda t: t[:, 1:, :].reshape(t.size(0), 4, 4, t.size(2)).permute(0, 3, 1, 2)  # noqa: E731
    with pytest.raises(RecipeError, match=rf"^model: .*family '{family}'"):
        if entry == "torchcam":
            vc.interop.from_torchcam(model, "GradCAM", layer)
        else:
            vc.interop.from_pytorch_grad_cam(model, GradCAM, [layer], rt)


@pytest.mark.parametrize("call", ["torchcam_cat", "captum_tuple", "pgc_category", "pgc_out_of_range"])
def test_bad_class_arguments_are_refused_with_the_kits_error(call):
    model = make_model("vit")
    layer = model.blocks[-1].norm1
    with pytest.raises(RecipeError, match=r"^(class_idx|target|targets): "):
        if call == "torchcam_cat":
            vc.interop.from_torchcam(model, "GradCAM", layer, class_idx="cat")
        elif call == "captum_tuple":
            from captum.attr import LayerGradCam
            vc.interop.from_captum(LayerGradCam(model, layer), target=(1, 2))
        else:
            category = "cat" if call == "pgc_category" else 10  # the model has 10 classes
            vc.interop.from_pytorch_grad_cam(model, GradCAM, [layer], _right_reshape(model, layer, (32, 32)),
                                             [ClassifierOutputTarget(category)])


def test_ablationcam_states_the_ablation_value_and_it_is_the_whole_difference():
    model, x = make_model("vit"), make_input("vit")
    layer = model.blocks[-1].norm1
    rt = _right_reshape(model, layer, (32, 32))
    t = vc.interop.from_pytorch_grad_cam(model, "AblationCAM", [layer], rt, [ClassifierOutputTarget(CLASS)])
    assert not t.ok and [f.kind for f in t.findings] == ["ablation"]
    assert "min(activations) - 1e7" in t.findings[0].message and "AblationLayerVit" in t.findings[0].message
    assert t.corrected.weighting == "ablationcam"
    ours = vc.cam(vc.score(vc.trace(model, x, targets=[CLASS]), model, t.corrected, x), t.corrected).values

    class ZeroAblationVit(AblationLayerVit):  # pytorch-grad-cam's layer with the paper's zero ablation
        def __call__(self, _x):
            out = self.activations.transpose(1, self.activations.ndim - 1)
            for i in range(out.size(0)):
                out[i, self.indices[i], :] = 0
            return out.transpose(out.ndim - 1, 1)

    library = _library_map(AblationCAM, model, layer, rt, x, ablation_layer=AblationLayerVit())
    zeroed = _library_map(AblationCAM, model, layer, rt, x, ablation_layer=ZeroAblationVit())
    np.testing.assert_allclose(ours, zeroed, atol=1e-5)  # the stated difference is the only one
    assert np.abs(ours - library).max() > 0.1  # and it is real at a LayerNorm site


def test_citation_accepts_a_preset_name():
    assert vc.presets.citation("agcam") == vc.presets.CITATIONS["agcam"] == vc.presets.citation(vc.presets.agcam())
    assert vc.presets.citation("attention_rollout").startswith("Abnar")
    with pytest.raises(RecipeError, match=r"^recipe: unknown preset name 'nope'"):
        vc.presets.citation("nope")
    with pytest.raises(RecipeError, match=r"^recipe: expected a vitcam_nb.Recipe"):
        vc.presets.citation(3)


# -- fuzz: only the kit's own errors escape ---------------------------------------------------------------------
KIT_ERRORS = (RecipeError, TraceError, TraceFileError)
_FUZZ_MODEL = make_model("vit", depth=2)
_FUZZ_SWIN = FAMILIES["swin"][0]()
_MODULES = [m for _, m in _FUZZ_MODEL.named_modules()] + [m for _, m in _FUZZ_SWIN.named_modules()]
_NAMES = [n for n, _ in _FUZZ_MODEL.named_modules()] + [n for n, _ in _FUZZ_SWIN.named_modules()]
models = st.sampled_from([_FUZZ_MODEL, _FUZZ_SWIN])
methods = st.sampled_from(["GradCAM", "HiResCAM", "AblationCAM", "ScoreCAM", "LayerCAM", "", "gradcam", "EigenCAM",
                           GradCAM, AblationCAM, 3, None, object()])
layers = st.one_of(st.sampled_from(_MODULES), st.sampled_from(_NAMES), st.text(max_size=12), st.integers(),
                   st.none(), st.just(torch.nn.Linear(2, 2)))
classes = st.one_of(st.integers(-3, 12), st.text(max_size=3), st.none(), st.floats(allow_nan=True),
                    st.tuples(st.integers(0, 3), st.integers(0, 3)), st.just(np.int64(2)), st.just(torch.tensor(1)),
                    st.just(True))
reshapes = st.sampled_from([None, lambda t: t, lambda t: t[:, 1:].reshape(1, 4, 4, -1).permute(0, 3, 1, 2),
                            lambda t: t.permute(0, 3, 1, 2), lambda t: t.reshape(1, 8, 8, -1).permute(0, 3, 1, 2),
                            lambda t: t.permute(0, 2, 1), lambda t: 1 / 0, lambda t: "x", lambda t: t * 2.5])
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _only_kit_errors(call) -> None:
    try:
        call()
    except KIT_ERRORS:
        pass


@FUZZ
@given(model=models, method=methods, layer_list=st.one_of(st.lists(layers, max_size=3), layers), rt=reshapes,
       cls=classes, wrap=st.booleans(), size=st.one_of(st.none(), st.tuples(st.integers(-1, 70), st.integers(-1, 70))))
def test_fuzz_from_pytorch_grad_cam(model, method, layer_list, rt, cls, wrap, size):
    targets = [ClassifierOutputTarget(cls)] if wrap else cls
    _only_kit_errors(lambda: vc.interop.from_pytorch_grad_cam(model, method, layer_list, rt, targets,
                                                              input_size=size))


@FUZZ
@given(model=models, method=methods, layer=layers, cls=classes)
def test_fuzz_from_torchcam(model, method, layer, cls):
    _only_kit_errors(lambda: vc.interop.from_torchcam(model, method, layer, class_idx=cls))


@FUZZ
@given(layer=layers, cls=classes, forward=st.sampled_from([None, "model", "other"]))
def test_fuzz_from_captum(layer, cls, forward):
    from captum.attr import LayerGradCam

    func = _FUZZ_MODEL if forward in (None, "model") else (lambda x: x)
    lgc = LayerGradCam(func, layer if isinstance(layer, torch.nn.Module) else _FUZZ_MODEL.blocks[0].norm1)
    if not isinstance(layer, torch.nn.Module):
        lgc.layer = layer
    _only_kit_errors(lambda: vc.interop.from_captum(lgc, target=cls, model=_FUZZ_MODEL if forward == "model" else None))


def test_swin_window_sites_and_torchcam_on_swin():
    model = FAMILIES["swin"][0]()
    t = vc.interop.from_pytorch_grad_cam(model, GradCAM, [model.layers[1].blocks[0].attn],
                                         lambda t: t.permute(0, 2, 1))
    assert not t.ok and t.findings[0].kind == "windows" and t.corrected.site == "attn_out"
    t = vc.interop.from_torchcam(model, "GradCAM", "layers.1.blocks.0.norm1")
    assert t.corrected.layer == 2 and "(batch, 8 rows, 8 cols, 32 channels)" in t.findings[0].message


def test_swin_layers_of_two_stages_are_probed_at_each_stage_grid():
    model = FAMILIES["swin"][0]()
    stage1 = lambda t: t.reshape(t.size(0), 8, 8, t.size(-1)).permute(0, 3, 1, 2)  # noqa: E731
    layers = [model.layers[1].blocks[0].norm1, model.layers[0].blocks[0].norm1]  # stage 1 first: 8x8, then 16x16
    t = vc.interop.from_pytorch_grad_cam(model, GradCAM, layers, stage1)
    assert not t.ok and t.findings[0].kind == "reshape" and "16x16" in t.findings[0].message
    assert vc.interop.from_pytorch_grad_cam(model, GradCAM, layers[:1], stage1).ok
