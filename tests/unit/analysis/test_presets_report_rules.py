"""The presets' known-answer report ranks the backward-rule presets beside the others: a rule preset's row is
computed from a trace made with its rule, and equals pointing game and deletion AUC computed directly on
``vc.cam(vc.trace(..., rule=r), preset)``; exact Shapley values are read back from a cache file."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import ndimage

import vitcam_nb as vc
from vitcam_nb.data import shapes
from vitcam_nb.evaluate.localisation.metrics import default_tolerance
from vitcam_nb.evaluate.report.presets import report_presets, rule_for

RULE_PRESETS = ["cp_lrp", "attnlrp", "libragrad"]


def test_a_rule_presets_row_equals_pointing_game_and_deletion_on_a_trace_made_with_its_rule():
    names = ["gradcam", *RULE_PRESETS, "tokentm"]
    table = report_presets(n_images=1, seed=2, names=names, deletion_steps=4, progress=False).set_index("preset")
    assert (table["status"] == "ok").all(), table["status"].to_dict()
    assert table["rule"].to_dict() == {"gradcam": "gradient", "cp_lrp": "cp_lrp", "attnlrp": "attnlrp",
                                       "libragrad": "libragrad", "tokentm": "gradient"}
    model = vc.load_model("shapes-vit")
    images, labels, masks = shapes(1, 2)
    label, mask = int(labels[0]), masks[0]
    near = ndimage.distance_transform_edt(~mask) <= default_tolerance(mask.shape)
    aucs = {}
    for rule in RULE_PRESETS:
        tr = vc.trace(model, images[0], targets=[label], sites=["resid_pre"], rule=rule)
        assert tr.attrs["backward_rule"] == rule
        recipe = vc.presets.get(rule).replace(class_=label)
        up = vc.cam(tr, recipe).values
        peaks = up == up.max()
        assert table.loc[rule, "pointing_game"] == pytest.approx((peaks & near).sum() / peaks.sum(), abs=1e-12)
        grid = vc.cam(tr, recipe.replace(upsample="none")).values
        n_cells = grid.size
        curve = vc.evaluate.deletion(model, tr, grid, target=label, mode="token", step=int(np.ceil(n_cells / 4)),
                                     substrate="mean", score="prob", progress=False)
        aucs[rule] = curve.attrs["auc"]
        assert table.loc[rule, "deletion_auc"] == pytest.approx(aucs[rule], rel=1e-6), rule
    # the rules give different maps, so the rows are not one trace's numbers repeated
    assert len({round(a, 9) for a in aucs.values()}) > 1


def test_rule_for_names_the_trace_a_preset_reads():
    assert [rule_for(vc.presets.get(n)) for n in RULE_PRESETS] == RULE_PRESETS
    assert rule_for(vc.presets.get("tokentm")) == rule_for(vc.presets.gradcam()) == "gradient"


def test_shapley_values_are_read_back_from_the_cache_file(tmp_path):
    path = tmp_path / "shapley_values.json"
    kwargs = dict(n_images=1, seed=1, names=["attnlrp"], deletion_steps=4, shapley_images=1, shapley_grid=(2, 2),
                  shapley_cache=path, progress=False)
    first = report_presets(**kwargs)
    assert first.attrs["shapley_cache"] == f"0 image(s) read from {path}, 1 computed"
    (entry,) = json.loads(path.read_text())["entries"].values()
    model = vc.load_model("shapes-vit")
    images, labels, _ = shapes(1, 1)
    phi = vc.evaluate.shapley_patches(model, images[0], (2, 2), "mean", target=int(labels[0]), progress=False)
    np.testing.assert_allclose(entry["values"], phi.values, rtol=1e-6, atol=1e-9)
    # a planted value proves the second run reads the file instead of computing
    planted = json.loads(path.read_text())
    key = next(iter(planted["entries"]))
    planted["entries"][key]["values"] = [[4.0, 3.0], [2.0, 1.0]]
    path.write_text(json.dumps(planted))
    second = report_presets(**kwargs)
    assert second.attrs["shapley_cache"] == f"1 image(s) read from {path}, 0 computed"
    tr = vc.trace(model, images[0], targets=[int(labels[0])], sites=["resid_pre"], rule="attnlrp")
    grid = vc.cam(tr, vc.presets.attnlrp().replace(class_=int(labels[0]), upsample="none")).values
    direct = vc.evaluate.shapley_agreement(grid, np.array([[4.0, 3.0], [2.0, 1.0]])).attrs["value"]
    assert second["shapley_agreement"].iloc[0] == pytest.approx(direct, abs=1e-12)


def test_a_file_that_is_not_a_shapley_cache_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text('{"mine": 1}')
    with pytest.raises(ValueError, match="shapley_cache: .* is not a vitcam_nb Shapley cache"):
        report_presets(n_images=1, names=["gradcam"], shapley_images=1, shapley_grid=(2, 2), shapley_cache=path,
                       progress=False)
    assert path.read_text() == '{"mine": 1}'
