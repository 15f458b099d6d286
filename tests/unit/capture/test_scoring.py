"""vc.score (issue #19): the model-in-the-loop pass stores Score-CAM / Ablation-CAM outputs in the trace; afterwards
the scored recipes are pure computations. Values are checked against forward passes written here independently."""

from __future__ import annotations

import copy
import re
import warnings

import numpy as np
import pytest
import torch

import vitcam_nb as vc
from vitcam_nb.core.errors import RecipeError, TraceError


@pytest.fixture
def setup(model_factory, model_input):
    model, x = model_factory("vit"), model_input("vit")
    tr = vc.trace(model, x, targets="top2", sites=["F1", "F3", "F4"])
    return model, x, tr


def test_ablation_scores_are_logits_with_the_channel_zeroed(setup, model_snapshot, assert_model_unchanged):
    model, x, tr = setup
    model.blocks[0].train()  # a mixed train/eval state comes back as it was
    before = model_snapshot(model)
    out = vc.score(tr, model, "ablationcam", x, layer=1, batch_size=5, progress=False)
    assert_model_unchanged(before, model)
    model.eval()
    assert "ablation" in out and "score" not in out and "ablation" not in tr  # the input trace is left alone
    classes = tr["target_class"].values
    for k in (0, 7, 31):
        # Zeroing LayerNorm channel k is zeroing its weight and bias: an independent way to ablate F1.
        ref = copy.deepcopy(model)
        with torch.no_grad():
            ref.blocks[1].norm1.weight[k] = 0
            ref.blocks[1].norm1.bias[k] = 0
            z = ref(x)[0].double()
        expected = [float(z[c]) if c >= 0 else float((torch.softmax(z, 0) * z).sum()) for c in classes]
        got = out["ablation"].sel(layer=1, site="F1", channel=k).values
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.isnan(out["ablation"].sel(layer=0).values).all()


def test_score_cam_scores_are_logits_of_masked_inputs(setup):
    model, x, tr = setup
    out = vc.score(tr, model, vc.Recipe(site="F4", layer=0, weighting="scorecam"), x, progress=False)
    act = tr["act"].sel(layer=0, site="F4").values[1:]  # 16 patch tokens, 4x4 raster
    k = 3
    grid = torch.from_numpy(act[:, k].reshape(1, 1, 4, 4).astype(np.float64))
    up = torch.nn.functional.interpolate(grid, size=(32, 32), mode="bilinear", align_corners=True)
    mask = (up - up.min()) / (up.max() - up.min() + 1e-8)
    with torch.no_grad():
        z = model(x * mask.float())[0]
    c = int(tr["target_class"].values[0])
    assert abs(float(out["score"].sel(layer=0, site="F4", channel=k).values[0]) - float(z[c])) <= 1e-5


def test_scored_maps_follow_their_formulas_and_round_trip(setup, tmp_path):
    model, x, tr = setup
    tr = vc.score(tr, model, [vc.Recipe(weighting="scorecam"), vc.Recipe(weighting="ablationcam")], x,
                  progress=False)
    raw = dict(upsample="none", normalize="none", relu="none")
    A = tr["act"].sel(layer=2, site="F1").values[1:].astype(np.float64)
    s = tr["score"].sel(layer=2, site="F1").values[0].astype(np.float64)
    w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    ours = vc.cam(tr, vc.Recipe(weighting="scorecam", **raw)).values.ravel()
    np.testing.assert_allclose(ours, A @ w, rtol=1e-5, atol=1e-6)
    base = float(tr["logits"].values[int(tr["target_class"].values[0])])
    drop = (base - tr["ablation"].sel(layer=2, site="F1").values[0]) / base
    np.testing.assert_allclose(vc.cam(tr, vc.Recipe(weighting="ablationcam", **raw)).values.ravel(), A @ drop,
                               rtol=1e-4, atol=1e-5)
    # gScore-CAM with every channel kept is Score-CAM; with k channels, the softmax runs over the top k by gradient
    C = A.shape[1]
    np.testing.assert_allclose(vc.cam(tr, vc.Recipe(weighting="gscorecam", k=C, **raw)).values,
                               vc.cam(tr, vc.Recipe(weighting="scorecam", **raw)).values, rtol=1e-6)
    G = tr["grad"].sel(layer=2, site="F1").isel(target=0).values[1:].astype(np.float64)
    top = np.argsort(-G.mean(0), kind="stable")[:5]
    wk = np.exp(s[top] - s[top].max()) / np.exp(s[top] - s[top].max()).sum()
    np.testing.assert_allclose(vc.cam(tr, vc.Recipe(weighting="gscorecam", k=5, **raw)).values.ravel(),
                               A[:, top] @ wk, rtol=1e-5, atol=1e-6)
    path = tmp_path / "scored.nc"
    vc.save(tr, path)
    back = vc.load(path)
    for r in (vc.Recipe(weighting="scorecam"), vc.Recipe(weighting="ablationcam", **raw),
              vc.Recipe(weighting="gscorecam", k=4)):
        assert np.ptp(vc.cam(tr, r).values) > 0
        np.testing.assert_array_equal(vc.cam(back, r).values, vc.cam(tr, r).values)


def test_missing_scores_are_refused_with_the_call_that_adds_them(setup):
    model, x, tr = setup
    recipe = vc.Recipe(site="F4", layer=0, weighting="scorecam")
    with pytest.raises(RecipeError, match=re.escape("vc.score(tr, model, vc.Recipe(site='F4', layer=0, "
                                                    "weighting='scorecam'), image)")):
        vc.cam(tr, recipe)
    scored = vc.score(tr, model, vc.Recipe(site="F4", layer=0, weighting="gscorecam", k=3), x, progress=False)
    assert int(np.isfinite(scored["score"].sel(layer=0, site="F4").values[0]).sum()) == 3
    vc.cam(scored, vc.Recipe(site="F4", layer=0, weighting="gscorecam", k=3))
    with pytest.raises(RecipeError, match=re.escape("vc.Recipe(site='F4', layer=0, weighting='scorecam')")):
        vc.cam(scored, recipe)  # three channels scored, Score-CAM needs all 32
    with pytest.raises(RecipeError, match="add them with vc.score"):
        vc.cam(scored, vc.Recipe(site="F4", layer=0, weighting="ablationcam"))


def test_a_second_call_scores_only_what_is_missing(setup):
    model, x, tr = setup
    calls = []
    handle = model.register_forward_pre_hook(lambda _m, args: calls.append(int(args[0].shape[0])))
    try:
        once = vc.score(tr, model, "gscorecam", x, k=4, progress=False)
        # one check pass of the unperturbed input (equal hashes do not make the same model: its logits must be the
        # trace's), then the top-4 channels of top1 in one pass (each forward scores every traced target)
        assert calls == [1, 4]
        calls.clear()
        twice = vc.score(once, model, "gscorecam", x, k=4, progress=False)
        assert calls == []
        np.testing.assert_array_equal(twice["score"].values, once["score"].values)
        vc.score(once, model, "scorecam", x, progress=False)
        assert calls == [1, 32 - 4]
    finally:
        handle.remove()


def test_refusals(setup):
    model, x, tr = setup
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.head.bias.add_(1.0)
    with pytest.raises(TraceError, match="model: its weights .* not those the trace was made with"):
        vc.score(tr, other, "scorecam", x)
    with pytest.raises(TraceError, match="image: its model input"):
        vc.score(tr, model, "scorecam", x + 1)
    with pytest.raises(TraceError, match="image: vc.score needs the image"):
        vc.score(tr, model, "scorecam")
    with pytest.raises(RecipeError, match="recipes_or_method: gradcam needs no model outputs"):
        vc.score(tr, model, "gradcam", x)
    with pytest.raises(TraceError, match="batch_size"):
        vc.score(tr, model, "scorecam", x, batch_size=0)
    with pytest.raises(RecipeError, match="site: 'F5' is not in this trace"):
        vc.score(tr, model, "scorecam", x, site="F5")
    with pytest.raises(RecipeError, match="k: 33 is more than the 32 channels"):
        vc.score(tr, model, "gscorecam", x, k=33)


def test_recipe_field_k():
    assert vc.Recipe().id == "36db00aafece" and '"k"' not in vc.Recipe().to_json()
    r = vc.Recipe(weighting="gscorecam", k=300)
    assert vc.Recipe.from_json(r.to_json()) == r and r.id != r.replace(k=200).id
    with pytest.raises(RecipeError, match="k: gscorecam keeps the top-k channels by gradient; set k"):
        vc.Recipe(weighting="gscorecam")
    with pytest.raises(RecipeError, match="k: only weighting 'gscorecam'"):
        vc.Recipe(k=3)
    with pytest.raises(RecipeError, match="k: expected None or an int >= 1"):
        vc.Recipe(weighting="gscorecam", k=0)
    with pytest.raises(RecipeError, match="site: scorecam scores the channels of a token site"):
        vc.Recipe(weighting="scorecam", site="F2")
    with pytest.raises(RecipeError, match="target: gscorecam ranks channels by the gradient of the logit.*scorecam "
                                          "and ablationcam also take 'prob' and 'logprob'"):
        vc.Recipe(weighting="gscorecam", k=3, target="prob")


def test_prob_needs_the_stored_logsumexp(setup):
    model, x, tr = setup
    recipe = vc.Recipe(weighting="ablationcam", target="prob", layer=0)
    tr = vc.score(tr, model, recipe, x, progress=False).drop_vars(["ablation_logsumexp"])
    with pytest.raises(RecipeError, match=re.escape("target: prob needs the logsumexp") + ".*vc.score"):
        vc.cam(tr, recipe)
    assert vc.score(tr, model, recipe.replace(target="logit"), x) is tr  # the logit needs nothing more
    assert "ablation_logsumexp" in vc.score(tr, model, recipe, x, progress=False)


def test_checklist_states_the_method_and_where_the_scores_come_from(setup):
    model, x, tr = setup
    tr = vc.score(tr, model, "scorecam", x, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        m = vc.cam(tr, vc.Recipe(weighting="scorecam"))
    text = m.attrs["checklist"]
    assert "Wang et al. 2020" in text and "vc.score" in text and "align_corners=True" in text
    assert "Ramaswamy et al. 2020" in vc.Recipe(weighting="ablationcam").checklist().to_json()
    assert "Chen et al. 2022" in vc.Recipe(weighting="gscorecam", k=3).describe()
