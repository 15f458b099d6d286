"""The known-answer report of the presets (evaluate.presets_report): one row per preset, measured like the
known-answer report, or skipped with the reason."""

from __future__ import annotations

import numpy as np

import vitcam_nb as vc
from vitcam_nb.evaluate.presets_report import fit_to_model, report_presets
from vitcam_nb.evaluate.report import report_known_answer


def test_a_preset_scores_what_the_known_answer_report_gives_its_recipe_and_others_are_skipped_with_a_reason():
    names = ["gradcam", "transition_attention_maps", "albef_itm_gradcam"]
    table = report_presets(n_images=2, seed=1, names=names, deletion_steps=4, progress=False)
    assert table["preset"].tolist() == names
    rows = table.set_index("preset")
    assert rows.loc["albef_itm_gradcam", "status"].startswith("skipped: needs a vision-language family")
    assert rows.loc["transition_attention_maps", "status"] == "ok"
    assert 0 <= rows.loc["transition_attention_maps", "pointing_game"] <= 1
    # gradcam at F1 of the last block is one variant of the full known-answer report: the same numbers.
    full, _ = report_known_answer(n_images=2, seed=1, sites=["F1"], weightings=["gradcam"], targets=["logit"],
                                  deletion_steps=4, progress=False)
    last = full[full["layer"] == full["layer"].max()].iloc[0]
    assert np.isclose(rows.loc["gradcam", "pointing_game"], last["pointing_game"])
    assert np.isclose(rows.loc["gradcam", "deletion_auc"], last["deletion_auc"])


def test_layer_tuples_are_clipped_to_the_model():
    assert fit_to_model(vc.presets.transition_attention_maps(), 6).layer == (-6, -5, -4, -3, -2, -1)
    assert fit_to_model(vc.presets.vit_cx(layer=-7), 6) is None
