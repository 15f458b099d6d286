"""The known-answer report of the presets (evaluate.presets_report): one row per preset, measured like the
known-answer report, or skipped with the reason."""

from __future__ import annotations

import numpy as np

import vitcam_nb as vc
from vitcam_nb.evaluate.report.known_answer import report_known_answer
from vitcam_nb.evaluate.report.presets import fit_to_model, report_presets


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


def test_published_methods_get_the_sites_and_layerwise_trace_they_read():
    import contextlib

    from scipy import ndimage

    from vitcam_nb.data import shapes
    from vitcam_nb.evaluate.localisation.metrics import default_tolerance

    names = ["legrad", "agcam", "attcat", "grad_eclip"]
    table = report_presets(n_images=2, seed=3, names=names, deletion_steps=4, progress=False).set_index("preset")
    assert (table["status"] == "ok").all(), table["status"].to_dict()
    model = vc.load_model("shapes-vit")
    images, labels, masks = shapes(2, 3)
    one_head = lambda: vc.adapters.single_head_attention(model, layers=[-1])  # noqa: E731
    for name, sites, targets, context in (("legrad", ["F2"], lambda c: vc.targets.layerwise(c), contextlib.nullcontext),
                                          ("agcam", ["F2", "attn_scores"], lambda c: [c], contextlib.nullcontext),
                                          ("attcat", ["F2", "resid_pre"], lambda c: [c], contextlib.nullcontext),
                                          ("grad_eclip", ["F3", "v", "q_out", "k_out"], lambda c: [c], one_head)):
        hits = []
        for image, label, mask in zip(images, labels, masks, strict=True):
            with context():
                tr = vc.trace(model, image, targets=targets(int(label)), sites=sites)
            up = vc.cam(tr, vc.presets.get(name).replace(class_=int(label))).values
            near = ndimage.distance_transform_edt(~mask) <= default_tolerance(mask.shape)
            peaks = up == up.max()
            hits.append((peaks & near).sum() / peaks.sum())
        assert np.isclose(table.loc[name, "pointing_game"], np.mean(hits)), name
