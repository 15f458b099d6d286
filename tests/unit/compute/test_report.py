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


def _region_trace(reduce: str):
    from vitcam_nb import models
    from vitcam_nb.data.train_seg import SEG_CLASSES

    model = models.load_model("shapes-vit-seg")
    img, label, mask = models.sample_image("shapes", 0, with_mask=True)
    c = int(label) + 1
    target = vc.targets.region(mask, c, reduce=reduce, labels=SEG_CLASSES)
    tr = vc.trace(model, img, targets=target, sites=["F1"], layers=[-1])
    return model, img, mask, c, target, tr


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_region_trace_checklist_names_the_region_score(reduce):
    model, img, mask, c, target, tr = _region_trace(reduce)
    # what the text claims was differentiated is what the trace holds: the region sum (or mean) of z_c
    with torch.no_grad():
        out = model(vc.preprocess.prepare_input(model, img).tensor)[0].double()
    m = torch.from_numpy(mask).double()
    expected = float((out[c] * m).sum() / (m.sum() if reduce == "mean" else 1))
    assert abs(float(tr["logits"].values[c]) - expected) <= 1e-4 * abs(expected)
    norm = " / sum_yx m[y,x]" if reduce == "mean" else ""
    gradcam = json.loads(vc.cam(tr, vc.Recipe(class_=c)).attrs["checklist"])["gradient target"]
    assert gradcam["scalar"] == (f"the region score s_c of class {c}: the {reduce} of its logits over the region, "
                                 f"s_c = sum_yx m[y,x] z_c[y,x]{norm} (m the region mask, z_c[y,x] the class's "
                                 "dense pre-softmax logits)")
    assert gradcam["derivation"] == "direct: stored gradient of s_c"
    older = tr.copy()  # a region trace made before target_reduce was recorded
    older.attrs = {k: v for k, v in tr.attrs.items() if k != "target_reduce"}
    assert tr.attrs["target_reduce"] == reduce
    assert json.loads(vc.cam(older, vc.Recipe(class_=c)).attrs["checklist"])["gradient target"] == gradcam
    logprob = json.loads(vc.cam(tr, vc.Recipe(class_=c, target="logprob")).attrs["checklist"])["gradient target"]
    assert logprob["scalar"].startswith(f"the log-probability log p_c = log softmax(s)_c of class {c} over the "
                                        f"region scores s_j of all classes, s_j = sum_yx m[y,x] z_j[y,x]{norm} ")
    assert logprob["derivation"] == "derived exactly: dlog p_c = ds_c - dE, E = sum_j p_j s_j, p detached"
    methods = vc.cam(tr, vc.Recipe(class_=c)).attrs["methods"]
    assert f"Gradient target: the region score s_c of class {c}: the {reduce} of its logits" in methods
    assert "raw logit" not in methods and "z_c (pre-softmax)" not in methods


def test_scored_recipes_on_a_region_trace_name_the_region_score():
    model, img, mask, c, target, tr = _region_trace("sum")
    recipes = [vc.Recipe(weighting=w, class_=c) for w in ("scorecam", "ablationcam")]
    tr = vc.score(tr, model, recipes, img, targets=target, batch_size=64, progress=False)
    for recipe, variable in zip(recipes, ("score", "ablation")):
        got = json.loads(vc.cam(tr, recipe).attrs["checklist"])["gradient target"]
        assert got["scalar"].startswith(f"the region score s_c of class {c}: the sum of its logits over the region")
        assert got["derivation"].endswith(f"stored in the trace's {variable!r} variable by vc.score (the target's "
                                          "score s_c of each perturbed input)")
    # gScore-CAM ranks channels by the region score's gradient
    g = json.loads(vc.cam(tr, vc.Recipe(weighting="gscorecam", class_=c, k=4)).attrs["checklist"])
    assert g["gradient target"]["derivation"].startswith("the stored gradient of s_c selects the top-4 channels")


def test_classification_trace_keeps_the_raw_logit_text():
    tr = vc.trace(_model(2), np.zeros((32, 32, 3), np.uint8), targets="top1")
    got = json.loads(vc.cam(tr, vc.Recipe()).attrs["checklist"])["gradient target"]
    assert got["scalar"].startswith("the raw logit z_c (pre-softmax) of ")
    assert got["derivation"] == "direct: stored gradient of z_c"


def test_a_similarity_trace_names_its_target_score_not_a_logit():
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                              num_classes=0)
    target = vc.targets.similarity(torch.randn(2, model.num_features, generator=torch.Generator().manual_seed(0)),
                                   ["a", "b"])
    tr = vc.trace(model, np.zeros((32, 32, 3), np.uint8), targets=target)
    got = json.loads(vc.cam(tr, vc.Recipe(layer=0, class_=1)).attrs["checklist"])["gradient target"]
    assert got["scalar"] == f"the target score s_c of class 1 ({tr.attrs['target_scores']})"
    assert got["scalar"].startswith("the target score s_c of class 1 (cosine similarity")
    assert "logit" not in got["scalar"]
    assert got["derivation"] == "direct: stored gradient of s_c"
