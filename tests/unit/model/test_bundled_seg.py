"""The bundled segmentation model ``shapes-vit-seg`` (issue #19): its card's IoU is reproduced, it segments fresh
images, and a region target on it is traced and scored."""

from __future__ import annotations

import numpy as np
import torch

import vitcam_nb as vc
from vitcam_nb import models
from vitcam_nb.data.segmenter import LinearSegmenter
from vitcam_nb.data.shapes import shapes
from vitcam_nb.data.train import state_dict_sha256
from vitcam_nb.data.train_seg import SEG_CLASSES, evaluate, pixel_labels

FRESH_SEED = 424_243


def test_card_iou_is_reproduced():
    card = models.model_card("shapes-vit-seg")
    model = models.load_model("shapes-vit-seg")
    assert isinstance(model, LinearSegmenter) and not model.training
    assert card["classes"] == SEG_CLASSES and state_dict_sha256(model.state_dict()) == card["state_dict_sha256"]
    assert set(card["data"]["train_seeds"]).isdisjoint({card["data"]["test_seed"], FRESH_SEED})
    images, labels, masks = shapes(card["data"]["n_test"], seed=card["data"]["test_seed"])
    got = evaluate(model, images, pixel_labels(labels, masks))
    assert abs(got["mean_iou"] - card["test_mean_iou"]) <= 1e-4
    assert abs(got["pixel_accuracy"] - card["test_accuracy"]) <= 1e-4


def test_segments_fresh_images():
    model = models.load_model("shapes-vit-seg")
    images, labels, masks = shapes(100, seed=FRESH_SEED)
    got = evaluate(model, images, pixel_labels(labels, masks))
    assert got["pixel_accuracy"] >= 0.9 and got["mean_iou"] >= 0.5, got


def test_region_target_on_the_bundled_model():
    model = models.load_model("shapes-vit-seg")
    img, label, mask = models.sample_image("shapes", 0, with_mask=True)
    target = vc.targets.region(mask, int(label) + 1, labels=SEG_CLASSES)
    tr = vc.trace(model, img, targets=target, sites=["F1"], layers=[-1])
    assert tr["target_label"].values[0] == SEG_CLASSES[int(label) + 1]
    tr = vc.score(tr, model, vc.Recipe(weighting="scorecam", class_=int(label) + 1), img, targets=target,
                  batch_size=64, progress=False)
    m = vc.cam(tr, vc.Recipe(weighting="scorecam", class_=int(label) + 1))
    assert m.shape == (64, 64) and np.isfinite(m.values).all()
    with torch.no_grad():
        out = model(vc.preprocess.prepare_input(model, img).tensor)[0]
    c = int(label) + 1
    expected = float((out[c] * torch.from_numpy(mask)).sum())
    assert abs(float(tr["logits"].values[c]) - expected) <= 1e-3 * abs(expected)
