"""Tests of vitcam_nb.evaluate on models (issue #6): the atlas and the sanity checks (model randomisation) on
tiny ViTs, the known-answer report on a small random ViT, and the known-answer checks on the bundled model
when it is installed."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import vitcam_nb as vc
import vitcam_nb.evaluate as ev
from vitcam_nb.evaluate import MetricWarning


def _bundled_model():
    """The bundled known-answer model, or None while it is not installed yet."""
    try:
        from vitcam_nb.models import load_model

        return load_model("shapes-vit")
    except Exception:  # the models package or its weights file may not exist yet
        return None


# --------------------------------------------------------------------------------------------------
# atlas


@pytest.fixture(scope="module")
def vit_traces():
    from vitcam_testing import make_input, make_model

    model = make_model("vit")
    return [vc.trace(model, make_input("vit", seed), targets="top3") for seed in range(2)]


ATLAS_RECIPES = {
    "F1 L0": vc.Recipe(site="F1", layer=0),
    "F1 L0 max-norm": vc.Recipe(site="F1", layer=0, normalize="max"),
    "F4 L1": vc.Recipe(site="F4", layer=1),
    "F1 L2": vc.Recipe(site="F1", layer=2),
    "F6 L2": vc.Recipe(site="F6", layer=2),  # CLS pooling: zero gradient at the last block -> degenerate
    "rollout": vc.Recipe(site="F2", layer="all", layer_fusion="rollout"),
}


def test_atlas_known_values_labels_and_degenerate_recipes(vit_traces):
    tr = vit_traces[0]
    with pytest.warns(MetricWarning, match=r"F6 L2 \(.*degenerate|degenerate.*F6 L2"):
        da = ev.atlas(tr, ATLAS_RECIPES)
    assert da.dims == ("recipe_a", "recipe_b")
    assert list(da["label_a"].values) == list(ATLAS_RECIPES)
    assert list(da["recipe_a"].values) == [r.id for r in ATLAS_RECIPES.values()]
    # min-max and max normalisation of one map are increasing transforms of each other: Spearman 1
    assert da.sel(recipe_a=ATLAS_RECIPES["F1 L0"].id, recipe_b=ATLAS_RECIPES["F1 L0 max-norm"].id) == 1.0
    ok = ~da["degenerate_a"].values
    np.testing.assert_allclose(np.diag(da.values)[ok], 1.0)
    np.testing.assert_array_equal(da.values, da.values.T)
    assert np.isnan(da.sel(recipe_a=ATLAS_RECIPES["F6 L2"].id)).all()
    assert da["degenerate_a"].values.tolist() == [False, False, False, False, True, False]
    # the same call gives the same numbers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MetricWarning)
        np.testing.assert_array_equal(ev.atlas(tr, ATLAS_RECIPES).values, da.values)
    fig = ev.plot_atlas(da)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert sorted(labels) == sorted(ATLAS_RECIPES) and labels[-1] == "F6 L2"  # degenerate last
    assert labels.index("F1 L0") - labels.index("F1 L0 max-norm") in (-1, 1)  # the agreeing pair is adjacent


def test_atlas_over_many_traces_and_sign_measures(vit_traces):
    recipes = [ATLAS_RECIPES[k] for k in ("F1 L0", "F4 L1", "F1 L2")]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ds = ev.atlas(vit_traces, recipes, metric="sign_agreement", k=4)
    # the atlas takes signed maps itself (relu="none", normalize="none"), so no ReLU warning
    assert not [w for w in record if "before the ReLU" in str(w.message)]
    assert set(ds.data_vars) == {"mean", "std", "count"}
    assert ds["mean"].dims == ("recipe_a", "recipe_b")
    assert ds.attrs["n_images"] == 2 and ds.attrs["signed"] == 1
    np.testing.assert_array_equal(ds["count"].values, 2)
    per = [ev.atlas(t, recipes, metric="sign_agreement", k=4).values for t in vit_traces]
    np.testing.assert_allclose(ds["mean"].values, np.mean(per, axis=0))
    np.testing.assert_allclose(ds["std"].values, np.std(per, axis=0))
    ev.plot_atlas(ds)


def test_atlas_bad_input(vit_traces):
    r = vc.Recipe()
    with pytest.raises(ValueError, match=r"^recipes: the same recipe"):
        ev.atlas(vit_traces[0], [r, vc.Recipe(site="F1")])
    with pytest.raises(ValueError, match=r"^recipes: an atlas needs at least 2"):
        ev.atlas(vit_traces[0], [r])
    with pytest.raises(ValueError, match=r"^metric"):
        ev.atlas(vit_traces[0], [r, r.replace(layer=0)], metric="kendall")
    with pytest.raises(ValueError, match=r"^tr: item 1"):
        ev.atlas([vit_traces[0], "x"], [r, r.replace(layer=0)])


# --------------------------------------------------------------------------------------------------
# sanity checks


def test_randomise_parts_copies_and_is_seeded(model_factory, model_snapshot, assert_model_unchanged):
    model = model_factory("vit")
    before = model_snapshot(model)
    assert [p for p, _ in ev.model_parts(model)] == ["head", "blocks.2", "blocks.1", "blocks.0", "embed"]
    a = ev.randomise_parts(model, ["head", "blocks.2"], seed=3)
    b = ev.randomise_parts(model, ["head"], seed=3)
    assert_model_unchanged(before, model)
    assert torch.equal(a.head.weight, b.head.weight)  # a part gets the same draws in every mode
    assert not torch.equal(a.head.weight, model.head.weight)
    assert torch.equal(b.blocks[2].mlp.fc1.weight, model.blocks[2].mlp.fc1.weight)
    assert torch.equal(a.blocks[1].attn.qkv.weight, model.blocks[1].attn.qkv.weight)
    w = model.blocks[2].mlp.fc1.weight
    assert float(a.blocks[2].mlp.fc1.weight.detach().std()) == pytest.approx(float(w.detach().std()), rel=0.1)
    with pytest.raises(ValueError, match=r"^parts"):
        ev.randomise_parts(model, ["blocks.9"])


def test_randomised_logit(vit_traces):
    tr = vit_traces[0]
    out = ev.randomised_logit(tr, vc.Recipe(site="F1", layer=1))
    assert out.dims == ("metric",) and list(out["metric"].values) == ["spearman", "ssim"]
    traced = [int(c) for c in tr["target_class"].values if c >= 0]
    assert out.attrs["predicted"] == traced[0] and out.attrs["other"] in traced[1:]
    again = ev.randomised_logit(tr, vc.Recipe(site="F1", layer=1))
    np.testing.assert_array_equal(out.values, again.values)
    one = tr.isel(target=[0, len(tr["target"]) - 1])  # predicted class + expected logit only
    with pytest.raises(ValueError, match=r"^tr: the trace holds no class other"):
        ev.randomised_logit(one, vc.Recipe(site="F1", layer=1))


def _cascade_check(model, image, recipe):
    sim, maps = ev.model_randomisation(model, image, recipe, return_maps=True, seed=0)
    assert sim.dims == ("layer", "metric")
    assert list(sim["layer"].values) == [p for p, _ in ev.model_parts(model)]
    assert sim["n_randomised"].values.tolist() == list(range(1, sim.sizes["layer"] + 1))
    assert maps.sizes["layer"] == sim.sizes["layer"] + 1
    return sim, maps


def test_cascading_randomisation_lowers_similarity_on_the_bundled_model(model_snapshot,
                                                                         assert_model_unchanged):
    model = _bundled_model()
    if model is None:
        pytest.skip("vc.load_model('shapes-vit') is not available yet (bundled weights missing)")
    from vitcam_nb.data import shapes

    images, labels, _ = shapes(3, seed=123)
    before = model_snapshot(model)
    rows = []
    for image, label in zip(images, labels, strict=True):
        recipe = vc.Recipe(site="F1", layer=-1, class_=int(label))  # pytorch-grad-cam's ViT recipe
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MetricWarning)  # a fully random model may give a flat map
            sim = ev.model_randomisation(model, image, recipe, trace_kwargs={"sites": ["F1"]})
        rows.append(np.abs(sim.sel(metric="spearman").values))  # how much of the ranking survives
    assert_model_unchanged(before, model)
    curve = np.nanmean(rows, axis=0)  # mean |Spearman| to the original map, top part first
    half = len(curve) // 2
    # the more parts are randomised, the less of the original map is left
    assert curve[-1] < curve[0]
    assert np.nanmean(curve[half:]) < np.nanmean(curve[:half])


def test_randomisation_runs_on_a_small_random_vit(model_factory, model_snapshot, assert_model_unchanged):
    model = model_factory("vit")
    from vitcam_testing import make_input

    before = model_snapshot(model)
    sim, maps = _cascade_check(model, make_input("vit"), vc.Recipe(site="F1", layer=1))
    assert_model_unchanged(before, model)
    assert np.isfinite(sim.values).all()
    assert sim.attrs["mode"] == "cascading" and sim.attrs["target_class"] >= 0
    again = ev.model_randomisation(model, make_input("vit"), vc.Recipe(site="F1", layer=1), seed=0)
    np.testing.assert_array_equal(sim.values, again.values)
    ind = ev.model_randomisation(model, make_input("vit"), vc.Recipe(site="F1", layer=1), mode="independent")
    assert ind["n_randomised"].values.tolist() == [1] * ind.sizes["layer"]
    np.testing.assert_array_equal(ind.values[0], sim.values[0])  # the head alone: same draws, same map
    fig = ev.plot_randomisation(sim, maps)
    assert len(fig.axes) == maps.sizes["layer"] + 1


# --------------------------------------------------------------------------------------------------
# known-answer model: deletion and the report


def _tiny_shapes_vit():
    """A random 64-px ViT with the shapes data config, standing in for the bundled model in the report."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    m = VisionTransformer(img_size=64, patch_size=16, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    m.pretrained_cfg = {"input_size": (3, 64, 64), "crop_pct": 1.0, "mean": (0.5,) * 3, "std": (0.25,) * 3,
                        "interpolation": "bicubic", "crop_mode": "center"}
    return m.eval()


def test_report_known_answer_small(tmp_path):
    table, fig = ev.report_known_answer(
        _tiny_shapes_vit(), n_images=2, seed=0, sites=("F1", "F6"), weightings=("gradcam", "eigencam", "scorecam"),
        targets=("logit", "prob"), deletion_steps=4, out_dir=tmp_path, progress=False)
    # 2 layers x 2 sites x (gradcam: 2 targets + eigencam and scorecam (vc.score per image): once)
    assert len(table) == 16
    assert set(table[table.weighting == "scorecam"].target) == {"logit"}
    assert {"rank", "site", "layer", "weighting", "target", "pointing_game", "deletion_auc",
            "degenerate_frac", "recipe_id"} <= set(table.columns)
    ranked = table.dropna(subset=["pointing_game"])["pointing_game"].values
    assert (np.diff(ranked) <= 0).all()
    last_f6 = table[(table.site == "F6") & (table.layer == 1) & (table.weighting == "gradcam")]
    assert (last_f6["degenerate_frac"] == 1.0).all() and last_f6["pointing_game"].isna().all()
    for ext in ("csv", "png", "json"):
        assert (tmp_path / f"known_answer_report.{ext}").is_file()
    assert table.attrs["deletion_step"] == 4 and table.attrs["substrate"] == "mean"


def test_report_scores_channels_at_token_sites_only():
    """The default sites include F2, a matrix per head: Score-CAM rows are at the token sites alone."""
    table, _ = ev.report_known_answer(_tiny_shapes_vit(), n_images=1, seed=0, sites=("F1", "F2"),
                                      weightings=("gradcam", "scorecam"), targets=("logit",), deletion_steps=4,
                                      progress=False)
    assert set(table[table.weighting == "scorecam"].site) == {"F1"}
    assert set(table[table.weighting == "gradcam"].site) == {"F1", "F2"}
    assert len(table) == 2 * 3  # 2 layers x (gradcam at 2 sites + scorecam at 1)


def test_deletion_on_the_bundled_model_removes_the_evidence_first():
    model = _bundled_model()
    if model is None:
        pytest.skip("vc.load_model('shapes-vit') is not available yet (bundled weights missing)")
    from vitcam_nb.data import shapes

    images, labels, masks = shapes(4, seed=7)
    rng = np.random.default_rng(0)
    good, random = [], []
    for img, label, mask in zip(images, labels, masks, strict=True):
        # a good map: the evidence object's mask (tiny noise orders the patches within it)
        g = ev.deletion(model, img, mask.astype(float) + 0.01 * rng.random(mask.shape), target=int(label),
                        progress=False)
        assert g.values[g.attrs["n_cells"] // 8] < g.values[0]  # the most covered patches carry the class
        good.append(g)
        random += [ev.deletion(model, img, rng.random(mask.shape), target=int(label), progress=False)
                   for _ in range(2)]
    # the class score falls faster when the evidence goes first: lower curve early on, lower AUC
    assert np.mean([g.sel(fraction=0.25, method="nearest").item() for g in good]) < np.mean(
        [r.sel(fraction=0.25, method="nearest").item() for r in random])
    assert np.mean([g.attrs["auc"] for g in good]) < np.mean([r.attrs["auc"] for r in random])
