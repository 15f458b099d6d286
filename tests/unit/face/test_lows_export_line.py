"""vc.export_html prints one short line per call; what the page leaves out is named in the page, not printed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.DegenerateMapWarning")


@pytest.fixture(scope="module")
def tr():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)
    return vc.trace(model.eval(), np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8), targets="top1")


def test_export_prints_one_short_line_and_the_page_names_what_it_left_out(tr, tmp_path, capsys):
    # scorecam needs vc.score outputs this trace lacks: the page leaves it out and says so.
    path = vc.export_html(tr, tmp_path / "e.html", axes={"site": ["F1"], "layer": [-1],
                                                         "weighting": ["gradcam", "scorecam"]}, progress=False)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and len(out) <= 120, out
    assert out.startswith(f"e.html: {path.stat().st_size / 1e6:.2f} MB (") and "leaves out" in out
    html = path.read_text()
    assert "Not in this page:" in html and "scorecam" in html.split("Not in this page:")[1][:400]
    assert "Not in this page:" not in out
