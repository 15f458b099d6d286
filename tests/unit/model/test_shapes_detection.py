"""The known-answer detection images and the bundled detector ``shapes-yolos`` (issue #37, item 4).

The generator's boxes are checked against boxes recomputed here from the masks with ``np.nonzero``; the training
script's output loads with its origin; the pointing game per detection is recomputed here from each map.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitcam_nb as vc
from vitcam_nb.data.shapes_detection import DET_CLASS_NAMES, MAX_OBJECTS, NO_OBJECT, shapes_detection

torch.set_num_threads(1)

#: Fresh images: the training script's seeds are 20000 onwards and its test seed 90020.
SEED = 31_337


def test_boxes_are_the_tight_boxes_of_disjoint_masks_one_object_per_band():
    images, labels, boxes, masks = shapes_detection(40, seed=3)
    assert images.shape == (40, 64, 64, 3) and images.dtype == np.uint8
    assert set(np.unique(labels)) <= {NO_OBJECT, *range(len(DET_CLASS_NAMES))}
    count = (labels >= 0).sum(axis=1)
    assert set(count) == {2, 3}
    assert not (masks.sum(axis=1) > 1).any()  # objects never overlap
    for i in range(40):
        for k in range(MAX_OBJECTS):
            if labels[i, k] == NO_OBJECT:
                assert not masks[i, k].any() and not boxes[i, k].any()
                continue
            ys, xs = np.nonzero(masks[i, k])
            assert boxes[i, k].tolist() == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
            # the object's centre (of its disc, within a pixel of the box centre) lies in band k
            assert k * 64 / 3 - 1 <= (xs.min() + xs.max() + 1) / 2 <= (k + 1) * 64 / 3 + 1
    again = shapes_detection(40, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(again, (images, labels, boxes, masks)))
    assert not np.array_equal(shapes_detection(40, seed=4)[0], images)


def test_bad_generator_arguments_are_refused():
    with pytest.raises(ValueError, match="n must be >= 0"):
        shapes_detection(-1, seed=0)
    with pytest.raises(ValueError, match="size must be >= 32"):
        shapes_detection(2, seed=0, size=16)


def test_the_training_script_writes_a_card_and_weights_that_load_with_their_origin(tmp_path):
    """Two steps of the real training loop (the bundled run is the same code with more steps)."""
    pytest.importorskip("transformers")
    from vitcam_nb.data.train_detection import train
    from vitcam_nb.models import _load_from_files

    card = train(tmp_path, log=lambda _msg: None, steps=2, batch_size=16, n_test=8, log_every=1)
    weights = tmp_path / "shapes-yolos.safetensors"
    assert card["weights_sha256"] == vc.core.provenance.file_sha256(weights) and card["weights_bytes"] < 2_000_000
    assert card["training"]["steps"] == 2 and card["training"]["init_from"]["name"] == "shapes-vit"
    assert [h["step"] for h in card["training"]["history"]] == [1, 2]
    assert "fixed assignment" in card["training"]["loss"] and card["data"]["train_seeds"].startswith("20000 + step")
    model = _load_from_files(weights, tmp_path / "shapes-yolos.json")
    assert type(model).__name__ == "YolosForObjectDetection" and not model.training
    assert vc.core.provenance.weights_origin(model) == f"bundled shapes-yolos (file sha256 {card['weights_sha256']})"
    assert [model.config.id2label[i] for i in range(3)] == list(DET_CLASS_NAMES)
    # the backbone was copied from shapes-vit: its first block's key projection is shapes-vit's second qkv third
    # moved by two AdamW steps at most (at the backbone's rate, 0.2 x the warmup's 2e-5 and 4e-5)
    vit = vc.load_model("shapes-vit")
    k = model.vit.encoder.layer[0].attention.attention.key.weight.detach()
    assert (k - vit.blocks[0].attn.qkv.weight[64:128]).abs().max() < 0.2 * 6e-5 * 1.1
    # detection token k starts at the mean position of band k's patch columns (0-2, 3-4, 5-7 of 8) and moves by
    # two AdamW steps at the full rate at most
    pos = model.vit.embeddings.position_embeddings[0].detach()
    patches = vit.pos_embed[0, 1:].detach().reshape(8, 8, -1)
    for k, cols in enumerate(([0, 1, 2], [3, 4], [5, 6, 7])):
        assert (pos[65 + k] - patches[:, cols].mean((0, 1))).abs().max() < 6e-5 * 1.1
    images, _labels, _boxes, _masks = shapes_detection(1, seed=SEED)
    x = vc.preprocess.prepare_input(model, images[0]).tensor  # the kit's preprocessing is the training's
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(x[0].permute(1, 2, 0).numpy(), (images[0] / 255.0 - mean) / std, rtol=1e-5, atol=1e-5)


def _tiny_yolos():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.YolosConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   image_size=[64, 64], patch_size=8, num_detection_tokens=3, num_labels=3,
                                   use_mid_position_embeddings=False)
    torch.manual_seed(0)
    return transformers.YolosForObjectDetection(cfg).eval()


def test_the_pointing_game_per_detection_is_the_peak_inside_each_objects_own_mask():
    model = _tiny_yolos()
    table, summary = vc.evaluate.report_known_answer_detection(model, n_images=3, seed=SEED)
    images, labels, _boxes, masks = shapes_detection(3, seed=SEED)
    assert len(table) == int((labels >= 0).sum()) == summary["gradcam F1 last"]["detections"]
    for _, row in table.iterrows():  # every row recomputed here from a map of its own trace
        i, k = int(row["image"]), int(row["detection"])
        tr = vc.trace(model, images[i], targets=vc.targets.detection(query=[0, 1, 2]))
        m = vc.cam(tr, vc.Recipe(class_=k)).values
        peak = m == m.max()
        assert row["pointing"] == masks[i, k][peak].mean() and row["chance"] == masks[i, k].mean()
        others = masks[i][[j for j in range(3) if j != k]].any(axis=0)
        assert row["other_object"] == others[peak].mean() and row["label"] == labels[i, k]
    assert summary["gradcam F1 last"]["chance"] == pytest.approx(table["chance"].mean())


def test_the_report_refuses_bad_arguments_naming_them():
    model = _tiny_yolos()
    with pytest.raises(ValueError, match="n_images: expected a positive int"):
        vc.evaluate.report_known_answer_detection(model, n_images=0)
    with pytest.raises(TypeError, match="recipes: expected a non-empty mapping"):
        vc.evaluate.report_known_answer_detection(model, n_images=1, recipes={"a": "gradcam"})
