"""The torch kernels (issue #35, item 2) equal the NumPy reference: every registered weighting, head rule, layer
fusion and upsampling, iterated from the registries so that a new registration is covered (or refused by name).

Kernel by kernel on random tensors (maps and scales), then the whole map of ``cam_tensors`` against ``vc.cam`` on
one tiny random-init ViT trace made once per module (values within 1e-5 float32, degenerate flags and their text
equal), then ``read_map`` against ``vc.cam``'s full-size maps. The CUDA variants run where a GPU is present.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb.compute import fusion, kernels, spatial, torch_kernels, torch_spatial
from vitcam_nb.compute.torch_maps import cam_tensors, layout_of, tensors_of, token_layout, torch_refusal
from vitcam_nb.core.errors import RecipeError
from vitcam_nb.core.recipe import HEAD_RULES, INTEGRATED_ROLLOUTS, LAYER_FUSIONS, NORMALIZES, ROLLOUTS, UPSAMPLES
from vitcam_nb.core.weighting import WEIGHTINGS

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
WITH_TORCH = [w.name for w in WEIGHTINGS.values() if w.torch_kernel is not None]
WITHOUT_TORCH = [w.name for w in WEIGHTINGS.values() if w.torch_kernel is None]
SCORED = [n for n in WITH_TORCH if WEIGHTINGS.get(n).scores]
IMG = 32


def _close(got: torch.Tensor, want: np.ndarray, tol: float = 1e-5) -> None:
    """Equal within ``tol`` of the largest value (at least 1: most maps are normalised to 1)."""
    got = got.detach().cpu().numpy()
    want = np.asarray(want)
    assert got.shape == want.shape
    assert np.abs(got - want).max(initial=0) <= tol * max(1.0, float(np.abs(want).max(initial=0)))


@pytest.fixture(scope="module")
def tiny():
    """A random-init ViT (2 blocks, 2 heads, 32 channels, 4x4 grid), traced for its top-2 classes, and scored for
    every scored weighting at F1 of both blocks (logit and prob targets)."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMG, patch_size=8, depth=2,
                              embed_dim=32, num_heads=2).eval()
    image = np.random.default_rng(1).integers(0, 256, (IMG, IMG, 3), np.uint8)
    trace = vc.trace(model, image, targets="top2")
    recipes = [vc.Recipe(weighting=w, site="F1", layer=layer, target=target, k=8 if w == "gscorecam" else None)
               for w in SCORED for layer in (0, 1) for target in _targets(w)]
    trace = vc.score(trace, model, recipes, image, progress=False)
    return trace


def _targets(name: str) -> tuple[str, ...]:
    return ("logit",) if name == "gscorecam" else ("logit", "prob")  # gscorecam ranks by the logit's gradient


def _recipe(name: str, **fields) -> vc.Recipe:
    k = {"k": 8} if name == "gscorecam" else {}
    return vc.Recipe(weighting=name, **k, **fields)


def _reference(trace, recipe):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vc.cam(trace, recipe)


def _assert_same_map(trace, recipe, device="cpu"):
    grid = recipe.replace(upsample="none")
    ref = _reference(trace, grid)
    out = cam_tensors(grid, tensors_of(trace, recipe.site, device), layout_of(trace))
    assert out.values.device.type == device
    # Float32 sums in another order differ by a few units in the last place of the map's magnitude scale (the
    # sum of absolute terms); min-max normalisation divides that by the map's span. On a random-init model the
    # span is often a small part of the scale, so the 1e-5 is of the scale, in the normalised map's units.
    raw = _reference(trace, grid.replace(normalize="none")).values
    span = float(raw.max() - raw.min())
    scale = float(out.scale[0])
    _close(out.values[0], ref.values, 1e-5 * max(1.0, scale / span if span > 0 else 1.0))
    raw_torch = cam_tensors(grid.replace(normalize="none"), tensors_of(trace, recipe.site, device), layout_of(trace))
    assert np.abs(raw_torch.values[0].cpu().numpy() - raw).max() <= 1e-5 * scale
    notes, partial = out.notes(0)
    assert bool(out.degenerate[0]) == bool(ref.attrs["degenerate"])
    assert ("; ".join(notes), "; ".join(partial)) == (ref.attrs["degenerate"], ref.attrs["degenerate_layers"])
    return out, ref


# -- kernel by kernel ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", WITH_TORCH)
@pytest.mark.parametrize("groups", [1, 4])
def test_every_torch_kernel_equals_its_numpy_kernel(name, groups, device):
    w = WEIGHTINGS.get(name)
    if w.all_channels and groups > 1:
        pytest.skip("projects all channels at once: heads stay 'channels'")
    rng = np.random.default_rng(2)
    A = rng.normal(size=(3, 9, 16)).astype(np.float32)
    G = rng.normal(size=(3, 9, 16)).astype(np.float32)
    G[..., 3, :2] = 0  # gradcampp's a = 0 where G = 0
    stored = {}
    if w.scores:
        stored = {"scores": rng.normal(size=(3, 16)).astype(np.float32),
                  "base": rng.uniform(1, 2, size=3).astype(np.float32), "k": 5}
    wmask, patch = np.arange(9) > 0, np.arange(1, 9)
    want = w.kernel(A, G, wmask, patch, groups, **stored)
    on = {"device": device}
    got = w.torch_kernel(torch.as_tensor(A, **on), torch.as_tensor(G, **on), slice(1, 9),
                         torch.as_tensor(patch, **on), groups,
                         **{k: torch.as_tensor(v, **on) if isinstance(v, np.ndarray) else v for k, v in stored.items()})
    for g, n in zip(got, want):
        _close(g, n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", [*HEAD_RULES, 1])
def test_every_head_rule_equals_numpy(rule, device):
    m = np.random.default_rng(3).normal(size=(2, 5, 3)).astype(np.float32)
    want = kernels.apply_head_rule(m, np.abs(m), rule)
    got = torch_kernels.apply_head_rule(torch.as_tensor(m, device=device), torch.as_tensor(np.abs(m), device=device),
                                        rule)
    for g, n in zip(got, want):
        _close(g, n)
    with pytest.raises(RecipeError, match="head 3 does not exist"):
        torch_kernels.apply_head_rule(torch.as_tensor(m), torch.as_tensor(m), 3)


@pytest.mark.parametrize("how", [f for f in LAYER_FUSIONS if f not in ROLLOUTS])
def test_every_plain_fusion_equals_numpy(how):
    m = np.random.default_rng(4).normal(size=(3, 4, 4)).astype(np.float32)
    _close(torch_kernels.fuse(torch.as_tensor(m), how), fusion.fuse(m, how))


@pytest.mark.parametrize("how", NORMALIZES)
def test_every_normalisation_equals_numpy(how):
    x = np.random.default_rng(5).normal(size=(3, 4, 5)).astype(np.float32)
    x[1] = 2.0  # constant: zeros under minmax
    x[2] = -np.abs(x[2])  # no positive maximum: zeros under max
    _close(torch_spatial.normalise(torch.as_tensor(x), how), spatial.normalise(x, how))


# -- whole maps on a trace -------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", WITH_TORCH)
def test_every_weighting_map_equals_vc_cam(tiny, name, device):
    sites = ("F1",) if WEIGHTINGS.get(name).scores else ("F1", "F3", "F2")
    for site in sites:
        for layer, target in zip((0, 1), _targets(name) * 2):
            _assert_same_map(tiny, _recipe(name, site=site, layer=layer, target=target), device)


def test_the_zero_gradient_map_is_flagged_as_vc_cam_flags_it(tiny):
    # CLS pooling: the last block's F3 patch tokens never reach the output, so their gradients are exactly zero.
    out, ref = _assert_same_map(tiny, vc.Recipe(site="F3", layer=1))
    assert bool(out.degenerate[0]) and ref.attrs["degenerate_cause"] == "zero gradient"
    assert int(out.codes[0, 0]) == 1 and not out.values.any()


def test_a_fusion_with_a_degenerate_layer_names_it_as_vc_cam_does(tiny):
    out, ref = _assert_same_map(tiny, vc.Recipe(site="F3", layer=(0, 1), layer_fusion="mean"))
    assert not bool(out.degenerate[0]) and ref.attrs["degenerate_layers"].startswith("layer 1: gradients")


@pytest.mark.parametrize("rule", [*HEAD_RULES, 1])
def test_every_head_rule_map_equals_vc_cam(tiny, rule):
    for site in ("F3", "F2"):
        _assert_same_map(tiny, vc.Recipe(site=site, layer=0, heads=rule))


@pytest.mark.parametrize("how", LAYER_FUSIONS)
def test_every_layer_fusion_equals_vc_cam_or_is_refused_by_name(tiny, how):
    if how in INTEGRATED_ROLLOUTS:
        recipe = vc.Recipe(site="F2", layer="all", layer_fusion=how)
        assert how in torch_refusal(recipe)
        with pytest.raises(RecipeError, match=how):
            cam_tensors(recipe, tensors_of(tiny, "F2"), layout_of(tiny))
        return
    site = "F2" if how in ROLLOUTS else "F1"
    layer = "all" if how in ROLLOUTS else (0, 1) if how != "none" else 1
    _assert_same_map(tiny, vc.Recipe(site=site, layer=layer, layer_fusion=how))


@pytest.mark.parametrize("name", WITHOUT_TORCH)
def test_a_weighting_without_a_torch_kernel_is_refused_by_name(tiny, name):
    recipe = vc.Recipe(weighting=name, target=WEIGHTINGS.get(name).scored_target)
    assert torch_refusal(recipe).startswith(f"weighting: {name} has no torch kernel")
    with pytest.raises(RecipeError, match=f"weighting: {name} has no torch kernel"):
        cam_tensors(recipe, tensors_of(tiny, "F1"), layout_of(tiny))


def test_a_batch_of_images_gives_each_image_its_own_map(tiny):
    other = tiny.copy(deep=True)
    other["act"].values[...] = other["act"].values[..., ::-1, :]  # other activations, same layout
    recipe = vc.Recipe(site="F1", layer=0, upsample="none")
    one, two = tensors_of(tiny, "F1"), tensors_of(other, "F1")
    batch = cam_tensors(recipe, {k: torch.cat([one[k], two[k]]) for k in one}, layout_of(tiny))
    _close(batch.values[0], _reference(tiny, recipe).values)
    _close(batch.values[1], _reference(other, recipe).values)


def test_missing_tensors_and_wrong_shapes_are_refused_naming_them(tiny):
    tensors = tensors_of(tiny, "F1")
    with pytest.raises(RecipeError, match="'attn'"):
        cam_tensors(vc.Recipe(site="F2"), tensors, layout_of(tiny))
    with pytest.raises(ValueError, match=r"tensors\['act'\]"):
        cam_tensors(vc.Recipe(), {**tensors, "act": tensors["act"][0]}, layout_of(tiny))
    with pytest.raises(TypeError, match=r"tensors\['act'\]"):
        cam_tensors(vc.Recipe(), {**tensors, "act": tensors["act"].numpy()}, layout_of(tiny))


# -- upsampling and normalisation on read ------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", UPSAMPLES)
@pytest.mark.parametrize("how", NORMALIZES)
def test_read_map_applies_every_upsampling_as_vc_cam(tiny, mode, how, device):
    view = layout_of(tiny)
    for recipe in (vc.Recipe(site="F1", layer=0, upsample=mode, normalize=how),
                   vc.Recipe(site="F2", layer="all", layer_fusion="rollout", upsample=mode, normalize=how),
                   vc.Recipe(site="F4", layer=(0, 1), layer_fusion="sum", upsample=mode, normalize=how)):
        assert torch_spatial.grid_reads_exactly(recipe)
        full = _reference(tiny, recipe).values
        grid = cam_tensors(recipe, tensors_of(tiny, recipe.site, device), view).values[0]
        _close(torch_spatial.read_map(grid, recipe, (view.height, view.width), view.pad), full)
        stored = _reference(tiny, recipe.replace(upsample="none")).values
        from_numpy = torch_spatial.read_map(stored, recipe, (view.height, view.width), view.pad)
        if isinstance(recipe.layer, int) or recipe.layer_fusion in ROLLOUTS:  # the very operations vc.cam runs
            np.testing.assert_array_equal(from_numpy, full)
        else:  # a linear fusion before or after the upsampling: equal within rounding
            np.testing.assert_allclose(from_numpy, full, atol=1e-5)


def test_a_max_over_several_upsampled_layers_does_not_read_from_the_grid():
    assert not torch_spatial.grid_reads_exactly(vc.Recipe(layer=(0, 1), layer_fusion="max"))
    assert torch_spatial.grid_reads_exactly(vc.Recipe(layer=(0, 1), layer_fusion="max", upsample="none"))


def test_a_layout_from_coordinates_gives_the_maps_of_the_traces_layout(tiny):
    view = layout_of(tiny)
    built = token_layout(tiny["token_kind"].values, tiny["patch_row"].values, tiny["patch_col"].values,
                         (view.gh, view.gw), tiny["layer"].values, (view.height, view.width),
                         num_layers=view.num_layers, num_heads=int(tiny.attrs["num_heads"]))
    for recipe in (vc.Recipe(site="F3", layer=0, heads="max"), vc.Recipe(site="F2", layer="all",
                                                                          layer_fusion="grad_rollout")):
        a = cam_tensors(recipe, tensors_of(tiny, recipe.site), view)
        b = cam_tensors(recipe, tensors_of(tiny, recipe.site), built)
        assert torch.equal(a.values, b.values) and torch.equal(a.codes, b.codes)
    kinds, rows, cols = (tiny[k].values for k in ("token_kind", "patch_row", "patch_col"))
    with pytest.raises(ValueError, match="patch_row, patch_col: one per token"):
        token_layout(kinds[1:], rows, cols, (4, 4), [0, 1], (IMG, IMG))
    with pytest.raises(ValueError, match="token_kind: 15 patch tokens for a 4x4 grid"):
        token_layout(kinds[:-1], rows[:-1], cols[:-1], (4, 4), [0, 1], (IMG, IMG))


def test_float16_storage_keeps_its_tolerance_and_verdicts(tiny):
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMG, patch_size=8, depth=2,
                              embed_dim=32, num_heads=2).eval()
    half = vc.trace(model, np.random.default_rng(6).integers(0, 256, (IMG, IMG, 3), np.uint8), targets="top1",
                    dtype="float16")
    assert layout_of(half).rtol == 1e-2
    for site in ("F1", "F3", "F2"):
        for layer in (0, 1):
            _assert_same_map(half, vc.Recipe(site=site, layer=layer, weighting="gradcampp"))


def test_a_target_whose_coefficient_is_zero_is_degenerate_as_in_vc_cam(tiny):
    # The top class far ahead: the second class's probability is 0 in float64, so its gradient coefficient is 0.
    saturated = tiny.copy(deep=True)
    top = int(saturated["target_class"].values[0])
    saturated["logits"].values[top] += 1e4
    out, ref = _assert_same_map(saturated, vc.Recipe(site="F1", layer=0, class_="top2", target="prob"))
    assert bool(out.degenerate[0]) and ref.attrs["degenerate_cause"] == "softmax saturated"


def test_to_grid_places_each_token_at_its_raster_position():
    raw = torch.arange(6.0).reshape(1, 6)
    flat = np.array([3, 0, 5, 1, 4, 2])
    want = np.zeros((1, 6), np.float32)
    want[:, flat] = raw.numpy()
    _close(torch_spatial.to_grid(raw, flat, (2, 3)), want.reshape(1, 2, 3))
    _close(torch_spatial.to_grid(raw, np.arange(6), (2, 3)), raw.numpy().reshape(1, 2, 3))
    with pytest.raises(ValueError, match="flat: expected each of the 2x3 raster positions once"):
        torch_spatial.to_grid(raw, np.array([0, 0, 1, 2, 3, 4]), (2, 3))


def test_a_weighting_registered_with_a_torch_kernel_is_computed_on_the_device(tiny):
    from vitcam_nb.core.weighting import Weighting, register_weighting

    def grad_abs(A, G, wmask, patch, groups):
        terms = abs(G[..., patch, :])
        terms = terms.reshape(*terms.shape[:-1], groups, terms.shape[-1] // groups)
        return terms.sum(-1), terms.sum(-1)

    register_weighting(Weighting("grad_abs_torch_demo", "map[t] = sum_k |G[t,k]|", grad_abs, torch_kernel=grad_abs))
    try:
        assert torch_refusal(vc.Recipe(weighting="grad_abs_torch_demo")) == ""
        _assert_same_map(tiny, vc.Recipe(weighting="grad_abs_torch_demo", site="F3", layer=0, heads="max"))
        with pytest.raises(TypeError, match="torch_kernel"):
            register_weighting(Weighting("bad_demo", "x", grad_abs, torch_kernel="grad_abs"))
    finally:
        WEIGHTINGS.unregister("grad_abs_torch_demo")
