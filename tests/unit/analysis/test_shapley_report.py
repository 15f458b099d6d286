"""The Shapley row of the presets' known-answer report: each preset's agreement with exact Shapley values equals
the direct computation on the same image, and bad Shapley settings are refused before any trace."""

from __future__ import annotations

import numpy as np
import pytest

import vitcam_nb as vc
from vitcam_nb.data import shapes
from vitcam_nb.evaluate.report.presets import report_presets


def test_the_shapley_column_equals_shapley_agreement_of_the_token_grid_map():
    names = ["gradcam", "attention_rollout"]
    table = report_presets(n_images=1, seed=1, names=names, deletion_steps=4, shapley_images=1,
                           shapley_grid=(2, 2), progress=False).set_index("preset")
    assert "2x2 patch groups" in table.attrs["shapley"] and "first 1 image" in table.attrs["shapley"]
    model = vc.load_model("shapes-vit")
    images, labels, _ = shapes(1, 1)
    label = int(labels[0])
    tr = vc.trace(model, images[0], targets=[label], sites=["F1", "F2"])
    phi = vc.evaluate.shapley_patches(model, tr, (2, 2), "mean", target=label, progress=False)
    for name in names:
        recipe = vc.presets.get(name)
        recipe = recipe if recipe.layer_fusion == "rollout" else recipe.replace(class_=label)
        grid = vc.cam(tr, recipe.replace(upsample="none")).values
        direct = vc.evaluate.shapley_agreement(grid, phi).attrs["value"]
        assert table.loc[name, "shapley_agreement"] == pytest.approx(direct, abs=1e-12), name
        assert table.loc[name, "shapley_n_images"] == 1
    assert np.isfinite(table["shapley_agreement"]).all()


@pytest.mark.parametrize("kwargs,message", [({"shapley_grid": (3, 3)}, "grid: 3x3 groups do not tile the 64x64"),
                                            ({"shapley_baseline": "noise"}, "baseline: expected one of"),
                                            ({"shapley_images": 3}, "shapley_images: expected an int in 0..n_images")])
def test_bad_shapley_settings_are_refused_before_any_trace(kwargs, message, monkeypatch):
    import vitcam_nb.evaluate.report.presets as report

    def no_trace(*args, **kw):
        raise AssertionError("traced before the settings were checked")

    monkeypatch.setattr(report, "trace", no_trace)
    with pytest.raises(ValueError) as info:
        report_presets(n_images=2, names=["gradcam"], progress=False, **{"shapley_images": 1, **kwargs})
    assert str(info.value).startswith(message)
