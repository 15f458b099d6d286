"""Robustness metrics (issue #22): the pure scores against a NumPy loop, the one-trace-per-input path against
Quantus 0.6 driving the kit's own explainer per recipe and per perturbation (same perturbations), and bad input."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import vitcam_nb as vc
import vitcam_nb.evaluate as ev


def test_scores_match_a_numpy_loop():
    rng = np.random.default_rng(0)
    m, mj = rng.random((6, 6)), rng.random((4, 6, 6))
    x, xj = rng.normal(size=(3, 6, 6)), rng.normal(size=(4, 3, 6, 6))
    z, zj = rng.normal(size=5), rng.normal(size=(4, 5))
    s = ev.robustness_scores(m, mj, x, xj, z, zj)
    sens = [np.sqrt(((mj[j] - m) ** 2).sum()) / np.sqrt((m ** 2).sum()) for j in range(4)]
    lip = [np.sqrt(((mj[j] - m) ** 2).sum()) / np.sqrt(((xj[j] - x) ** 2).sum()) for j in range(4)]
    rel_m = [np.sqrt((((m - mj[j]) / m) ** 2).sum()) for j in range(4)]
    ris = [rel_m[j] / np.sqrt((((x - xj[j]) / x) ** 2).sum()) for j in range(4)]
    ros = [rel_m[j] / np.sqrt(((z - zj[j]) ** 2).sum()) for j in range(4)]
    assert s["max_sensitivity"] == pytest.approx(max(sens), rel=1e-12)
    assert s["avg_sensitivity"] == pytest.approx(np.mean(sens), rel=1e-12)
    assert s["local_lipschitz"] == pytest.approx(max(lip), rel=1e-12)
    assert s["relative_input_stability"] == pytest.approx(max(ris), rel=1e-12)
    assert s["relative_output_stability"] == pytest.approx(max(ros), rel=1e-12)
    # the same map everywhere: nothing moves
    still = ev.robustness_scores(m, np.stack([m] * 3), x, xj[:3], z, zj[:3])
    assert all(v == 0.0 for v in still.values())


def test_perturbations_are_seeded_and_bounded():
    x = torch.zeros(1, 3, 8, 8)
    a, b, c = ev.perturb(x, 5, 0.3, seed=4), ev.perturb(x, 5, 0.3, seed=4), ev.perturb(x, 5, 0.3, seed=5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert float(a.abs().max()) <= 0.3 and float(a.abs().max()) > 0.25
    np.testing.assert_array_equal(a.numpy(), np.random.default_rng(4).uniform(-0.3, 0.3, (5, 3, 8, 8)).astype(
        np.float32))


@pytest.mark.parametrize("kw, match", [({"n": 0}, "n:"), ({"radius": -1.0}, "radius:"), ({"radius": float("nan")},
                                      "radius:"), ({"seed": -1}, "seed:")])
def test_perturbation_settings_out_of_range_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        ev.perturb(torch.zeros(1, 3, 4, 4), **kw)


def test_unknown_metric_and_zero_map():
    with pytest.raises(ValueError, match="metrics: unknown"):
        ev.robustness_scores(np.ones(2), np.ones((1, 2)), np.ones(2), np.ones((1, 2)), np.ones(2), np.ones((1, 2)),
                             ["flatness"])
    with pytest.warns(ev.MetricWarning, match="all zeros"):
        s = ev.robustness_scores(np.zeros(2), np.ones((1, 2)), np.ones(2), np.ones((1, 2)), np.ones(2),
                                 np.ones((1, 2)), ["max_sensitivity"])
    assert np.isnan(s["max_sensitivity"])


def test_parity_with_quantus_on_shapes_vit(model_snapshot, assert_model_unchanged):
    """One trace per perturbed input, then every recipe = Quantus rerunning the kit's explainer per recipe and per
    perturbation, on the same perturbations (Quantus's perturb_func replays ours). ROS is compared with
    Quantus's prediction-change NaN switched off."""
    quantus = pytest.importorskip("quantus")
    from vitcam_nb.data import shapes

    model = vc.load_model("shapes-vit").eval()
    images, labels, _ = shapes(1, seed=2204)
    x, _ = ev.model_input(model, images[0])
    y = int(labels[0])
    recipes = [vc.presets.get("gradcam"), vc.presets.get("layercam")]
    before = model_snapshot(model)
    ours = ev.robustness(model, x, recipes, n=3, radius=0.2, seed=1, target=y)
    assert_model_unchanged(before, model)
    assert ours.attrs["seed"] == 1 and ours.attrs["n_perturbations"] == 3 and ours.attrs["target"] == y
    xs = ev.perturb(x, 3, 0.2, 1).numpy()
    classes = {"max_sensitivity": quantus.MaxSensitivity, "avg_sensitivity": quantus.AvgSensitivity,
               "local_lipschitz": quantus.LocalLipschitzEstimate,
               "relative_input_stability": quantus.RelativeInputStability,
               "relative_output_stability": quantus.RelativeOutputStability}
    for recipe in recipes:
        recipe = recipe.replace(class_=y)

        def explain(model, inputs, targets, recipe=recipe, **kw):
            out = []
            for xi in np.asarray(inputs):
                tr = vc.trace(model, torch.from_numpy(np.asarray(xi, np.float32)), targets=y, sites=[recipe.site])
                out.append(np.asarray(vc.cam(tr, recipe).values)[None])
            return np.stack(out)

        a = explain(model, x.numpy(), [y])
        for name, cls in classes.items():
            replay = iter(xs)
            metric = cls(nr_samples=3, perturb_func=lambda arr, indices=None, replay=replay, **k: next(replay).reshape(
                arr.shape), disable_warnings=True, return_nan_when_prediction_changes=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = metric(model=model, x_batch=x.numpy(), y_batch=np.array([y]), a_batch=a.copy(),
                                explain_func=explain, channel_first=True, device="cpu")[0]
            assert ours.sel(recipe=recipe.id, metric=name).item() == pytest.approx(float(theirs), rel=1e-5), name


def test_model_calling_metrics_refuse_a_trace_of_other_weights():
    """Bad input (issue #22): a trace made with other weights is refused by the metrics that call the model."""
    import timm

    torch.manual_seed(0)
    a = timm.create_model("vit_tiny_patch16_224", depth=1, img_size=32, patch_size=16, num_classes=3).eval()
    b = timm.create_model("vit_tiny_patch16_224", depth=1, img_size=32, patch_size=16, num_classes=3).eval()
    tr = vc.trace(a, torch.zeros(3, 32, 32), targets=0, sites=["F1"])
    sal = np.random.default_rng(0).random((2, 2))
    assert ev.deletion(a, tr, sal, target=0, progress=False).sizes["fraction"] == 5  # the model that made it: fine
    for fn in (ev.deletion, ev.insertion, ev.lerf_morf_area):
        with pytest.raises(ValueError, match="image: the trace was made with other weights"):
            fn(b, tr, sal, target=0, progress=False)


def test_grouped_layers_equal_one_trace_and_cam_per_input():
    """Recipes differing only in their layer share one gallery per in-memory trace; each equals vc.trace + vc.cam of
    that input alone, scored by the NumPy formula of max-sensitivity."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3).eval()
    x = torch.from_numpy(np.random.default_rng(3).normal(size=(1, 3, 32, 32)).astype(np.float32))
    recipes = [vc.Recipe(site="F1", layer=layer, weighting=w) for w in ("gradcam", "layercam") for layer in (0, 2)]
    recipes.append(vc.Recipe(site="F4", layer=1))
    ours = ev.robustness(model, x, recipes, n=3, radius=0.1, seed=5, target=1, metrics=["max_sensitivity"],
                         batch_size=2)
    xs = ev.perturb(x, 3, 0.1, 5)
    for i, recipe in enumerate(recipes):
        maps = [np.asarray(vc.cam(vc.trace(model, xi[None], targets=1, sites=[recipe.site]), recipe.replace(class_=1))
                           .values, np.float64) for xi in torch.cat([x, xs])]
        expected = max(np.linalg.norm(m - maps[0]) / np.linalg.norm(maps[0]) for m in maps[1:])
        assert ours.values[i, 0] == pytest.approx(expected, rel=1e-5)


def test_a_published_method_on_a_trace_is_retraced_with_the_sites_that_trace_holds():
    """AttCAT reads resid_pre and F2: robustness of a trace holding them traces the copies with them too, and
    equals vc.trace (same sites) + vc.cam per input, scored by the NumPy formula."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    x = torch.from_numpy(np.random.default_rng(4).normal(size=(1, 3, 32, 32)).astype(np.float32))
    sites = ["F1", "F2", "resid_pre"]
    tr = vc.trace(model, x, targets=1, sites=sites)
    recipe = vc.presets.attcat().replace(class_=1)
    ours = ev.robustness(model, tr, [recipe], n=2, radius=0.1, seed=2, target=1, metrics=["max_sensitivity"])
    x0, _ = ev.model_input(model, tr)  # the input a trace stands for: its stored image, preprocessed
    maps = [np.asarray(vc.cam(vc.trace(model, xi[None], targets=1, sites=sites), recipe).values, np.float64)
            for xi in torch.cat([x0, ev.perturb(x0, 2, 0.1, 2)])]
    expected = max(np.linalg.norm(m - maps[0]) / np.linalg.norm(maps[0]) for m in maps[1:])
    assert ours.values[0, 0] == pytest.approx(expected, rel=1e-5)
