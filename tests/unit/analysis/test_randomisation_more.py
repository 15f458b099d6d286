"""Smooth MPRT, efficient MPRT and Quantus's re-initialisation scheme (issue #22): independent references (the plain
MPRT, scipy's entropy, the parameters themselves), seeding and refusals naming the argument."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import vitcam_nb as vc
import vitcam_nb.evaluate as ev


@pytest.fixture(scope="module")
def tiny():
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", depth=2, img_size=32, patch_size=8, num_classes=3).eval()
    x = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(1))
    return model, x, vc.Recipe(layer=1, class_=0)


KW = {"sites": ["F1"]}


def test_smooth_mprt_with_one_sample_is_the_plain_mprt(tiny):
    model, x, recipe = tiny
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        smooth = ev.smooth_mprt(model, x, recipe, n_samples=1, seed=3, init="matched", trace_kwargs=KW)
        plain = ev.model_randomisation(model, x, recipe, seed=3, init="matched", metrics=("spearman",),
                                       trace_kwargs=KW)
    np.testing.assert_allclose(smooth.values, plain.values, atol=1e-12)
    assert smooth["layer"].values.tolist() == plain["layer"].values.tolist()


def test_smooth_mprt_is_seeded_and_records_its_settings(tiny):
    model, x, recipe = tiny
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = ev.smooth_mprt(model, x, recipe, "independent", n_samples=3, noise=0.2, seed=1, trace_kwargs=KW)
        b = ev.smooth_mprt(model, x, recipe, "independent", n_samples=3, noise=0.2, seed=1, trace_kwargs=KW)
    np.testing.assert_array_equal(a.values, b.values)
    xn, _ = ev.model_input(model, x)
    assert a.attrs["noise_std"] == pytest.approx(0.2 * float(xn.max() - xn.min()))
    assert (a.attrs["mode"], a.attrs["n_samples"], a.attrs["seed"], a.attrs["target_class"]) == ("independent", 3, 1, 0)


def test_discrete_entropy_and_efficient_mprt_against_references(tiny):
    from scipy.stats import entropy

    values = np.random.default_rng(0).normal(size=500)
    assert ev.discrete_entropy(values, 30) == pytest.approx(entropy(np.histogram(values, bins=30)[0]))
    model, x, recipe = tiny
    r = ev.efficient_mprt(model, x, recipe, n_bins=20, seed=2, trace_kwargs=KW)
    tr0 = vc.trace(model, x, targets=[0], **KW)
    trr = vc.trace(ev.randomise_parts(model, [p for p, _ in ev.model_parts(model)], seed=2), x, targets=[0], **KW)
    from vitcam_nb.evaluate._common import grid_map

    h0 = entropy(np.histogram(grid_map(tr0, recipe).values, bins=20)[0])
    h1 = entropy(np.histogram(grid_map(trr, recipe).values, bins=20)[0])
    assert r.attrs["value"] == pytest.approx((h1 - h0) / h0)
    assert float(r) == r.attrs["value"]


def test_reset_init_is_quantus_scheme_and_leaves_everything_else_alone(tiny):
    model, _, _ = tiny
    state = torch.random.get_rng_state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = ev.randomise_parts(model, ["blocks.1"], seed=6, init="reset")
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's generator is untouched
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])  # the given model is never modified
    rs = r.state_dict()
    changed = {k for k in rs if not torch.equal(rs[k], before[k])}
    assert changed and all(k.startswith("blocks.1.") for k in changed)
    ref = torch.nn.Linear(*reversed(model.blocks[1].attn.qkv.weight.shape))
    torch.manual_seed(7)
    ref.reset_parameters()
    assert torch.equal(rs["blocks.1.attn.qkv.weight"], ref.weight.detach())
    e = ev.randomise_parts(model, ["embed"], seed=6, init="reset").state_dict()
    assert torch.equal(e["pos_embed"], before["pos_embed"]) and not torch.equal(e["patch_embed.proj.weight"],
                                                                                  before["patch_embed.proj.weight"])


@pytest.mark.parametrize("kw, match", [
    (dict(mode="top"), "mode"), (dict(n_samples=0), "n_samples"), (dict(noise=-0.1), "noise"),
    (dict(seed=-1), "seed"), (dict(parts=["blocks.9"]), "parts"), (dict(metrics=("nope",)), "metrics"),
    (dict(init="xavier"), "init"),
])
def test_smooth_mprt_refusals(tiny, kw, match):
    model, x, recipe = tiny
    with pytest.raises(ValueError, match=f"^{match}:"):
        ev.smooth_mprt(model, x, recipe, n_samples=kw.pop("n_samples", 1), trace_kwargs=KW, **kw)


def test_efficient_mprt_refusals_and_other_weights(tiny):
    import timm

    model, x, recipe = tiny
    for kw, match in [(dict(n_bins=1), "n_bins"), (dict(parts=[]), "parts"), (dict(seed=1.5), "seed")]:
        with pytest.raises(ValueError, match=f"^{match}:"):
            ev.efficient_mprt(model, x, recipe, trace_kwargs=KW, **kw)
    other = timm.create_model("vit_tiny_patch16_224", depth=2, img_size=32, patch_size=8, num_classes=3).eval()
    tr = vc.trace(model, x, targets=[0], **KW)
    for fn in (ev.efficient_mprt, ev.smooth_mprt):
        with pytest.raises(ValueError, match="image: the trace was made with other weights"):
            fn(other, tr, recipe, trace_kwargs=KW)
