"""Issue 52 (Reliability IV), second battery, the LOWs still open on main: each refused by a kit error naming the
argument, before any work, with nothing written."""

from __future__ import annotations

import numpy as np
import pytest

import vitcam_nb as vc

MODEL = vc.load_model("shapes-vit")  # 6 blocks
IMAGE = vc.sample_image("shapes", 0)
TR = vc.trace(MODEL, IMAGE, targets="top1")


@pytest.mark.parametrize("label", [-1, -3, -100])
def test_segmentation_loss_refuses_negative_labels_other_than_the_ignore_index(label):
    labels = np.array([[label, 1], [0, 1]])
    with pytest.raises(vc.TraceError, match=f"^labels: class {label} is negative"):
        vc.targets.segmentation_loss(labels, ignore_index=255)
    # The same pixel is skipped when it carries the ignore index (the default -100 included).
    kept = vc.targets.segmentation_loss(labels, ignore_index=label)
    assert kept.ignore_index == label and "3 labelled pixels" in kept.description


@pytest.mark.parametrize("trace, layers, absent", [(TR, [5, 9], 9), (TR, [-7, 0], -7),
                                                   (vc.trace(MODEL, IMAGE, targets="top1", layers=[0, 2, 4]),
                                                    [0, 1], 1)])
def test_ambiguity_refuses_a_layer_the_trace_does_not_hold_by_name(trace, layers, absent):
    with pytest.raises(vc.ArgumentError, match=rf"^space: layer {absent} is not a block of this trace"):
        vc.ambiguity(trace, {"site": "F1"}, space={"layer": layers})


@pytest.mark.parametrize("progress", ["x", "no", 1, None])
def test_export_html_refuses_a_progress_that_is_not_a_flag(tmp_path, progress):
    with pytest.raises(vc.ArgumentTypeError, match="^progress: expected True or False"):
        vc.export_html(TR, tmp_path / "page.html", axes={"site": ["F1"], "layer": [-1]}, progress=progress)
    assert list(tmp_path.iterdir()) == []
