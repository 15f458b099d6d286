"""vc.ambiguity (issue #21): the recipes a description allows, their spread, and first-order sensitivity shares
checked against an independent NumPy ANOVA over the factorial of maps computed one by one with vc.cam."""

from __future__ import annotations

import itertools
import json
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from vitcam_testing import make_input, make_model

import vitcam_nb as vc
from vitcam_nb.core.errors import DegenerateMapWarning
from vitcam_nb.evaluate import localising_share, pointing_game
from vitcam_nb.evaluate.ambiguity.sensitivity import main_effects

#: Spatial reconstruction stated (upsample none, min-max): the maps are compared on the token grid.
TOKEN = dict(upsample="none", normalize="minmax")


@pytest.fixture(scope="module")
def tr():
    return vc.trace(make_model("vit"), make_input("vit"))


def _cam(tr, **fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateMapWarning)
        return vc.cam(tr, vc.Recipe(upsample="none", **fields)).values.astype(np.float64)


def test_shares_match_an_independent_numpy_anova(tr):
    space = {"site": ["F1", "F4", "F6"], "target": ["logit", "logprob"], "relu": ["after", "none"]}
    amb = vc.ambiguity(tr, reported=dict(layer=0, weighting="layercam", **TOKEN), space=space)
    assert amb.sensitivity.design.startswith("exact") and amb.skipped == 0
    # The factorial as a (site, target, relu, pixel) array of maps computed one at a time.
    y = np.array([[[_cam(tr, layer=0, weighting="layercam", site=s, target=t, relu=r).ravel()
                    for r in space["relu"]] for t in space["target"]] for s in space["site"]])
    grand = y.mean(axis=(0, 1, 2))
    total = ((y - grand) ** 2).sum(-1).mean()
    for axis, field in enumerate(space):
        others = tuple(a for a in range(3) if a != axis)
        level_means = y.mean(axis=others)  # (levels, pixel)
        expected = ((level_means - grand) ** 2).sum(-1).mean() / total
        assert amb.sensitivity.fields[field] == pytest.approx(expected, abs=1e-6), field
    assert amb.sensitivity.categories["feature representation"] == pytest.approx(amb.sensitivity.fields["site"])
    # the spread over the 12 distinct maps
    maps = y.reshape(12, -1)
    assert amb.spread.std.values.ravel() == pytest.approx(maps.std(axis=0), abs=1e-6)
    rho = [stats.spearmanr(maps[i], maps[j])[0] for i, j in itertools.combinations(range(12), 2)]
    assert amb.spread.median_spearman == pytest.approx(np.median(rho), abs=1e-9)
    assert amb.spread.share_below_half == pytest.approx(np.mean(np.array(rho) < 0.5))


def test_only_one_field_changes_the_map(tr):
    # With a zero expected-logit gradient, prob and logprob are the logit gradient scaled: after min-max
    # normalisation the target choice changes nothing, so the ReLU choice explains all of the variance.
    quiet = tr.copy(deep=True)
    quiet["grad"].values[-1] = 0.0
    amb = vc.ambiguity(quiet, reported=dict(site="F1", layer=1, weighting="gradcam", weight_tokens="patch",
                                            **TOKEN))
    assert set(amb.sensitivity.fields) == {"target", "relu"}
    assert amb.sensitivity.fields["relu"] == pytest.approx(1.0, abs=1e-9)
    assert amb.sensitivity.fields["target"] == pytest.approx(0.0, abs=1e-9)
    assert amb.sensitivity.interaction == pytest.approx(0.0, abs=1e-9)
    assert amb.sensitivity.categories["aggregation"] == pytest.approx(1.0, abs=1e-9)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.lists(st.integers(2, 4), min_size=1, max_size=3))
def test_balanced_shares_and_remainder_sum_to_one(seed, levels):
    rng = np.random.default_rng(seed)
    cells = np.array(list(itertools.product(*(range(n) for n in levels))))
    y = rng.standard_normal((len(cells), 5)) + cells[:, :1] * rng.standard_normal(5)
    shares = main_effects(y, {f"f{i}": cells[:, i] for i in range(len(levels))})
    assert all(-1e-12 <= s <= 1 + 1e-12 for s in shares.values())
    remainder = 1.0 - sum(shares.values())
    assert remainder >= -1e-9  # orthogonal ANOVA on a balanced design


def test_real_trace_shares_are_a_partition(tr):
    amb = vc.ambiguity(tr, reported=dict(layer=-1, weighting="gradcam", **TOKEN))
    s = amb.sensitivity
    assert sum(s.fields.values()) + s.interaction == pytest.approx(1.0)
    assert sum(s.categories.values()) + s.category_interaction == pytest.approx(1.0)
    assert s.interaction >= -1e-9 and s.category_interaction >= -1e-9
    assert amb.open == ["site", "target", "weight_tokens", "heads", "attn_rows", "relu"]
    assert len({r.id for r in amb.recipes}) == len(amb.recipes) == amb.maps.sizes["recipe"]


def test_incompatible_combinations_are_skipped_and_counted(tr):
    # rollout needs F2: with sites F1/F4 open, every rollout cell is skipped (3 layers x 2 sites x 2 relu); a
    # fused recipe fuses every block, so the open layer gives one recipe per (site, relu).
    amb = vc.ambiguity(tr, reported=dict(weighting="gradcam", target="logit", weight_tokens="patch", heads="channels",
                                         attn_rows="cls", **TOKEN),
                       space={"site": ["F1", "F4"], "layer_fusion": ["mean", "rollout"], "relu": ["after", "none"]})
    assert amb.skipped == 12
    assert len(amb.recipes) == 4
    assert all(r.layer_fusion == "mean" and r.layer == "all" for r in amb.recipes)
    # a stated field is never changed to make a combination valid: heads="max" on F1 is no recipe
    amb = vc.ambiguity(tr, reported=dict(layer=0, weighting="gradcam", heads="max", **TOKEN),
                       space={"site": ["F1", "F3"], "target": ["logit"], "weight_tokens": ["patch"],
                              "relu": ["after"]})
    assert [r.site for r in amb.recipes] == ["F3"] and amb.skipped == 3  # F1 x 3 attn_rows values


def test_sampled_design_is_seeded_and_has_intervals(tr):
    kwargs = dict(reported=dict(layer=-1, weighting="gradcam", **TOKEN), max_cells=10, n_samples=64, n_boot=20)
    a, b = vc.ambiguity(tr, seed=3, **kwargs), vc.ambiguity(tr, seed=3, **kwargs)
    assert a.sensitivity.design.startswith("sampled: 64") and a.sensitivity.cells == 64
    assert a.sensitivity.fields == b.sensitivity.fields
    for field, share in a.sensitivity.fields.items():
        lo, hi = a.sensitivity.ci[field]
        assert 0 <= lo <= hi <= 1 and 0 <= share <= 1


def test_localisation_share_is_the_pointing_game(tr):
    mask = np.zeros((32, 32), bool)
    mask[4:14, 18:30] = True
    amb = vc.ambiguity(tr, reported=dict(site="F1", layer=0, **TOKEN), mask=mask)
    hits = []
    for m in amb.maps.values:
        up = vc.compute.spatial.upsample(m, (32, 32), "bilinear")
        hits.append(0.0 if np.ptp(up) == 0 else pointing_game(up, mask))
    assert amb.localises == pytest.approx(np.mean(hits))
    assert localising_share(amb.maps.values, mask) == pytest.approx(np.mean(hits))


def test_many_images_and_report(tr):
    other = vc.trace(make_model("vit"), make_input("vit", seed=1))
    mask = np.zeros((32, 32), bool)
    mask[:16, :16] = True
    many = vc.ambiguity([tr, other], reported=dict(site="F4", layer=0, **TOKEN), mask=[mask, mask])
    assert many.sensitivity.sizes["image"] == 2
    single = vc.ambiguity(other, reported=dict(site="F4", layer=0, **TOKEN), mask=mask)
    assert many.results[1].sensitivity.fields == single.sensitivity.fields
    assert many.localises[1] == pytest.approx(single.localises)
    assert "Over 2 images" in many.report()
    json.dumps(single.to_dict())
    assert "leaves" in single.report()


def test_bad_arguments_name_the_argument(tr):
    with pytest.raises(ValueError, match="reported: unknown key"):
        vc.ambiguity(tr, reported={"colour": "red"})
    with pytest.raises(ValueError, match="space: 'site' is reported"):
        vc.ambiguity(tr, reported={"site": "F1"}, space={"site": ["F1", "F4"]})
    with pytest.raises(ValueError, match="reported: a checklist category"):
        vc.ambiguity(tr, reported={"aggregation": "gradcam"})
    amb = vc.ambiguity(tr, reported={"site": "F1", "layer": 0, "aggregation": "open", "gradient target": "open"},
                       space={"weighting": ["gradcam", "layercam"]})
    assert "weighting" in amb.open and amb.sensitivity.categories["aggregation"] > 0


@pytest.fixture(scope="module")
def store3(tmp_path_factory):
    model = make_model("vit")
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (32, 32, 3), np.uint8) for _ in range(3)]
    masks = [np.zeros((32, 32), bool) for _ in range(3)]
    for i, m in enumerate(masks):
        m[8 * i: 8 * i + 12, 4:20] = True
    return vc.trace_many(model, images, tmp_path_factory.mktemp("amb") / "t.zarr", masks=masks, targets="top1",
                         progress=False)


def _assert_same(many, store, reported):
    assert many.sensitivity.sizes["image"] == 3
    for i in range(3):
        tr = vc.image_trace(store, i)
        one = vc.ambiguity(tr, reported=reported)
        got = many.results[i]
        assert [r.id for r in got.recipes] == [r.id for r in one.recipes]
        np.testing.assert_array_equal(got.maps.values, one.maps.values)
        assert got.sensitivity.fields == pytest.approx(one.sensitivity.fields)
        assert got.sensitivity.interaction == pytest.approx(one.sensitivity.interaction)
        assert got.spread.median_spearman == pytest.approx(one.spread.median_spearman)
        assert one.localises is not None  # the store's mask is used
        assert many.localises[i] == pytest.approx(one.localises)
        direct = localising_share(one.maps.values, tr["mask"].values)
        assert one.localises == pytest.approx(direct)


def test_a_store_is_one_dask_task_per_image_equal_to_each_image_alone(store3):
    from dask.callbacks import Callback

    reported = dict(site="F1", layer=1, weighting="layercam", **TOKEN)
    store = vc.open_traces(store3)
    finished = []

    class Count(Callback):
        def _posttask(self, key, result, dsk, state, worker_id):
            if type(result).__name__ == "Ambiguity":
                finished.append(key)

    with Count():
        many = vc.ambiguity(store, reported=reported)
    assert len(set(finished)) == 3  # the per-image analyses ran as dask tasks, not in a Python loop
    _assert_same(many, store, reported)


def test_a_store_runs_on_an_active_distributed_client(store3):
    distributed = pytest.importorskip("distributed")
    reported = dict(site="F1", layer=1, weighting="gradcam", **TOKEN)
    store = vc.open_traces(store3)
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0") as client:
        many = vc.ambiguity(store, reported=reported)
        keys = client.run_on_scheduler(lambda dask_scheduler: {str(t[0]) for t in dask_scheduler.transition_log})
    assert len({k for k in keys if k.startswith("_image-")}) == 3  # the Client's scheduler ran one task per image
    _assert_same(many, store, reported)


@pytest.mark.parametrize("kind", ["vit", "vit_avgpool"])
def test_every_map_is_the_one_its_recipe_gives(kind):
    # F2 recipes share their attention rows in the analysis; each map must still be exactly vc's own.
    tr = vc.trace(make_model(kind), make_input(kind))
    amb = vc.ambiguity(tr, reported=dict(layer=-1, weighting="gradcam", **TOKEN))
    assert any(r.site == "F2" for r in amb.recipes)
    for recipe, values in zip(amb.recipes, amb.maps.values):
        assert np.array_equal(values, _cam(tr, **{k: v for k, v in recipe.to_dict().items() if k != "upsample"}))
