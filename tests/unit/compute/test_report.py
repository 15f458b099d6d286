"""The checklist text (vitcam_nb/compute/report.py) and its cache: a report belongs to the trace it describes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.DegenerateMapWarning")


def _model(depth: int) -> VisionTransformer:
    torch.manual_seed(depth)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=depth, num_heads=4,
                             num_classes=4).eval()


def test_stores_of_different_models_get_their_own_reports(tmp_path):
    images = list(np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8))
    recipe = vc.Recipe(site="F1", layer=-1)
    checklists = {}
    for depth in (2, 3):
        ds = vc.open_traces(vc.trace_many(_model(depth), images, tmp_path / f"d{depth}.zarr", targets="top1",
                                          progress=False))
        checklists[depth] = json.loads(vc.cam(ds, recipe).attrs["checklist"])
    assert checklists[2]["feature representation"]["layer"] == "block 1 of 0..1 (the last block)"
    assert checklists[3]["feature representation"]["layer"] == "block 2 of 0..2 (the last block)"


def test_a_trace_whose_attributes_changed_gets_a_new_report():
    tr = vc.trace(_model(2), np.zeros((32, 32, 3), np.uint8), targets="top1")
    first = json.loads(vc.cam(tr, vc.Recipe()).attrs["checklist"])["model and input"]["versions"]
    older = tr.copy()
    older.attrs = {**tr.attrs, "torch_version": "1.0", "vitcam_nb_version": "0.0.1"}  # same trace id
    again = json.loads(vc.cam(older, vc.Recipe()).attrs["checklist"])["model and input"]["versions"]
    assert again == f"vitcam_nb 0.0.1, torch 1.0, timm {tr.attrs['timm_version']}" != first
    listed = tr.copy()
    listed.attrs = {**tr.attrs, "notes": ["a", "list"]}  # unhashable: reported without the cache
    assert json.loads(vc.cam(listed, vc.Recipe()).attrs["checklist"])["model and input"]["versions"] == first
