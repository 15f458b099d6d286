"""``vitcam-nb demo --model shapes-yolos`` (issue #37): the bundled detector on a generated image with known boxes
writes every output; its trace holds one detection target per object, whose logits are the model's own."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import vitcam_nb as vc
from vitcam_nb.cli import main
from vitcam_nb.data.shapes_detection import shapes_detection
from vitcam_nb.demo import DETECTION_SEED, OUTPUTS

pytest.importorskip("transformers")
torch.set_num_threads(1)


@pytest.mark.slow
def test_demo_of_the_bundled_detector_writes_its_outputs_for_each_detection(tmp_path, capsys):
    if "shapes-yolos" not in vc.models.bundled_names():
        pytest.skip("bundled model shapes-yolos is not available (python -m vitcam_nb.data.train_detection)")
    out = tmp_path / "out"
    assert main(["demo", "--out", str(out), "--model", "shapes-yolos", "--quiet"]) == 0
    for name in OUTPUTS:
        assert (out / name).stat().st_size > 0, name
    printed = capsys.readouterr().out
    assert "vitcam-nb demo wrote:" in printed and "bundled shapes-yolos" in printed
    images, labels, _boxes, masks = shapes_detection(1, seed=DETECTION_SEED)
    tr = vc.load(out / "trace.nc")
    present = [int(k) for k in np.nonzero(labels[0] >= 0)[0]]
    found = json.loads(tr.attrs["target_detections"])
    assert tr.attrs["target_kind"] == "detection" and [d["detection"] for d in found] == present
    net = vc.load_model("shapes-yolos")
    with torch.no_grad():
        logits = net(pixel_values=vc.preprocess.prepare_input(net, images[0]).tensor).logits[0].numpy()
    want = [logits[k, :-1].max() for k in present]  # each detection's top class, "no object" excluded
    np.testing.assert_allclose(tr["logits"].values, want, rtol=1e-5, atol=1e-5)
    top = present[int(np.argmax(want))]
    html = (out / "report.html").read_text()
    assert f"the mask of object {top}" in html and "pointing game" in html
    assert masks[0, top].any()


def test_demo_of_the_bundled_detector_refuses_a_missing_image_before_loading(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--model", "shapes-yolos", "--image", str(tmp_path / "no.png"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "image:" in err and "no.png is not a file" in err
    assert not any(tmp_path.glob("*.nc"))
