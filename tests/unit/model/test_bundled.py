"""Bundled known-answer data and models: generator, weights integrity, accuracy, offline loading."""

from __future__ import annotations

import hashlib
import shutil
import socket

import numpy as np
import pytest
import torch

from vitcam_nb import models
from vitcam_nb.data import CLASS_NAMES, shapes
from vitcam_nb.data.train import accuracy, normalise

FRESH_SEED = 777_777  # used by no training run and no model card
N_FRESH = 300


# --------------------------------------------------------------------------------------------------
# generator


def test_shapes_deterministic_and_typed():
    a = shapes(24, seed=3)
    b = shapes(24, seed=3)
    c = shapes(24, seed=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    images, labels, masks = a
    assert images.shape == (24, 64, 64, 3) and images.dtype == np.uint8
    assert labels.shape == (24,) and labels.dtype == np.int64
    assert masks.shape == (24, 64, 64) and masks.dtype == bool
    assert set(np.unique(labels)) <= set(range(len(CLASS_NAMES)))
    assert CLASS_NAMES == ("circle", "square", "triangle", "cross", "ring")


@pytest.mark.parametrize("shortcut", [False, True, "random"])
def test_shapes_masks_mark_the_object(shortcut):
    images, labels, masks = shapes(200, seed=5, shortcut=shortcut)
    area = masks.sum(axis=(1, 2))
    assert (area > 100).all() and (area < 64 * 64 * 0.4).all()
    # the object never touches the border (it is placed fully inside the image)
    assert not masks[:, 0, :].any() and not masks[:, -1, :].any()
    assert not masks[:, :, 0].any() and not masks[:, :, -1].any()
    # object pixels (away from the anti-aliased edge) are one flat colour that differs clearly from the
    # image outside the mask
    from scipy import ndimage

    img = images.astype(np.float32)
    for i in range(len(images)):
        inside = img[i][ndimage.binary_erosion(masks[i], structure=np.ones((3, 3)))]
        outside = img[i][~masks[i]]
        assert inside.std(axis=0).max() < 1.0
        assert np.linalg.norm(inside.mean(axis=0) - outside.mean(axis=0)) > 40.0
    # every class is present and, per class, the mean object area is plausible
    assert np.bincount(labels, minlength=5).min() > 20


def test_shapes_shortcut_mark_is_class_coded():
    imgs_true, labels, _ = shapes(100, seed=8, shortcut=True)
    imgs_plain, labels_plain, _ = shapes(100, seed=8, shortcut=False)
    np.testing.assert_array_equal(labels, labels_plain)
    corners = [
        (slice(2, 8), slice(2, 8)),
        (slice(2, 8), slice(56, 62)),
        (slice(56, 62), slice(2, 8)),
        (slice(56, 62), slice(56, 62)),
    ]
    expected_corner = np.array([0, 1, 2, 3, 0])[labels]
    for i in range(100):
        ys, xs = corners[expected_corner[i]]
        patch = imgs_true[i, ys, xs].reshape(-1, 3)
        assert (patch == patch[0]).all()  # a flat mark sits in the class's corner


def test_shapes_rejects_bad_arguments():
    with pytest.raises(ValueError):
        shapes(2, seed=0, shortcut="yes")
    with pytest.raises(ValueError):
        shapes(-1, seed=0)


# --------------------------------------------------------------------------------------------------
# bundled models


def test_list_models_and_cards():
    rows = models.list_models()
    names = [r["name"] for r in rows]
    assert names == ["shapes-video", "shapes-vit", "shapes-vit-reg4", "shapes-vit-seg", "shapes-vit-shortcut",
                     "shapes-vlm", "shapes-yolos"]
    for row in rows:
        # the segmentation, video and detection models: tests/unit/model/test_bundled_seg.py,
        # test_shapes_video.py, test_bundled_detector.py, test_shapes_vlm.py
        if row["name"] in ("shapes-vit-seg", "shapes-video", "shapes-yolos", "shapes-vlm"):
            continue
        assert row["classes"] == list(CLASS_NAMES)
        assert row["test_accuracy"] >= 0.97
        card = models.model_card(row["name"])
        path = models._models_dir() / card["weights_file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == card["weights_sha256"] == row["weights_sha256"]
        assert set(card["data"]["train_seeds"]).isdisjoint({card["data"]["test_seed"], FRESH_SEED})
    shortcut = models.model_card("shapes-vit-shortcut")
    assert shortcut["test_accuracy_random_mark"] < 0.6


@pytest.fixture(scope="module")
def fresh_data():
    return {sc: shapes(N_FRESH, seed=FRESH_SEED, shortcut=sc) for sc in (False, True, "random")}


@pytest.mark.parametrize("name", ["shapes-vit", "shapes-vit-reg4", "shapes-vit-shortcut"])
def test_bundled_model_accuracy_on_fresh_images(name, fresh_data):
    model = models.load_model(name)
    assert not model.training
    card = models.model_card(name)
    images, labels, _ = fresh_data[card["data"]["shortcut"]]
    assert accuracy(model, images, labels) >= 0.97
    if name == "shapes-vit-shortcut":
        images, labels, _ = fresh_data["random"]
        assert accuracy(model, images, labels) < 0.6


@pytest.mark.parametrize("name", ["shapes-vit", "shapes-vit-reg4", "shapes-vit-shortcut"])
def test_card_accuracy_is_reproduced(name):
    card = models.model_card(name)
    data = card["data"]
    images, labels, _ = shapes(data["n_test"], seed=data["test_seed"], shortcut=data["shortcut"])
    model = models.load_model(name)
    assert abs(accuracy(model, images, labels) - card["test_accuracy"]) <= 0.01
    from vitcam_nb.data.train import state_dict_sha256

    assert state_dict_sha256(model.state_dict()) == card["state_dict_sha256"]


def test_timm_preprocessing_matches_training_normalisation():
    import timm.data
    from PIL import Image

    model = models.load_model("shapes-vit")
    cfg = timm.data.resolve_data_config(model=model)
    assert cfg["input_size"] == (3, 64, 64) and cfg["crop_pct"] == 1.0
    transform = timm.data.create_transform(**cfg)
    images = shapes(4, seed=1)[0]
    for img in images:
        got = transform(Image.fromarray(img))
        torch.testing.assert_close(got, normalise(img[None])[0], rtol=0, atol=1e-6)


def test_tampered_weights_raise(tmp_path):
    src = models._models_dir()
    weights = tmp_path / "shapes-vit.safetensors"
    card = tmp_path / "shapes-vit.json"
    shutil.copy(src / "shapes-vit.safetensors", weights)
    shutil.copy(src / "shapes-vit.json", card)
    models._load_from_files(weights, card)  # the intact copy loads
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="expected sha256") as info:
        models._load_from_files(weights, card)
    assert str(weights) in str(info.value)
    assert models.model_card("shapes-vit")["weights_sha256"] in str(info.value)


@pytest.mark.parametrize("name", ["shapes-vit-large", "no_such_timm_model_xyz"])
def test_unknown_name_lists_bundled(name):
    with pytest.raises(ValueError) as info:
        models.load_model(name)
    msg = str(info.value)
    for bundled in ("shapes-vit", "shapes-vit-reg4", "shapes-vit-shortcut"):
        assert bundled in msg
    assert 'load_model("vit_base_patch16_224", pretrained=True)' in msg


def test_load_model_passthrough_and_timm_names():
    m = torch.nn.Linear(2, 2)
    assert models.load_model(m) is m
    vit = models.load_model("vit_tiny_patch16_224", num_classes=3)  # random weights, no download
    assert vit.head.out_features == 3 and not vit.training
    with pytest.raises(TypeError):
        models.load_model(3)
    with pytest.raises(ValueError):
        models.load_model("shapes-vit", pretrained=True)


def test_bundled_models_load_and_run_offline(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    from vitcam_nb.data.shapes_vlm import VOCAB

    for name in models.bundled_names():
        model = models.load_model(name)
        with torch.no_grad():
            if name == "shapes-video":  # one clip of 4 frames
                logits = model(pixel_values=torch.zeros(1, 4, 3, 32, 32)).logits
            elif name == "shapes-yolos":  # three detections, each over three classes and "no object"
                logits = model(pixel_values=normalise(models.sample_image()[None])).logits
            elif name == "shapes-vlm":  # next-word logits over its word vocabulary after a question
                from vitcam_nb.data.shapes_vlm import prompt_ids

                logits = model(input_ids=torch.tensor([prompt_ids("where is red ?")]),
                               pixel_values=normalise(models.sample_image()[None])).logits[:, -1]
            else:
                logits = model(normalise(models.sample_image()[None]))
        want = {"shapes-vit-seg": (1, 6, 64, 64), "shapes-yolos": (1, 3, 4),
                "shapes-vlm": (1, len(VOCAB))}.get(name, (1, 5))
        assert logits.shape == want


def test_sample_image():
    img = models.sample_image()
    assert img.shape == (64, 64, 3) and img.dtype == np.uint8
    np.testing.assert_array_equal(img, models.sample_image("shapes", 0))
    for i in range(5):
        image, label, mask = models.sample_image("shapes", i, with_mask=True)
        assert label == i and mask.shape == (64, 64) and mask.dtype == bool and mask.any()
    sc, sc_label, _ = models.sample_image("shortcut", 2, with_mask=True)
    rnd, rnd_label, _ = models.sample_image("shortcut-random", 2, with_mask=True)
    assert sc.shape == rnd.shape == (64, 64, 3)
    with pytest.raises(ValueError):
        models.sample_image("cats")
    with pytest.raises(IndexError):
        models.sample_image("shapes", 1000)


@pytest.mark.parametrize("kind", ["shapes", "shortcut", "shortcut-random"])
def test_bundled_samples_are_classified_as_labelled(kind):
    name = "shapes-vit-shortcut" if kind.startswith("shortcut") else "shapes-vit"
    model = models.load_model(name)
    n = len(models._samples()["labels"])
    batch = [models.sample_image(kind, i, with_mask=True) for i in range(n)]
    x = normalise(np.stack([b[0] for b in batch]))
    with torch.no_grad():
        pred = model(x).argmax(1).numpy()
    labels = np.array([b[1] for b in batch])
    if kind == "shortcut-random":
        assert (pred != labels).mean() > 0.5  # the shortcut model follows the mark, not the object
    else:
        np.testing.assert_array_equal(pred, labels)


# --------------------------------------------------------------------------------------------------
# known answers for heatmaps (needs the tracer and cam)

BEST_RECIPE = dict(site="F1", layer="all", weighting="hirescam", layer_fusion="mean")


def _maps(model, images, classes, recipe) -> list:
    """Each image's map of ``recipe`` for its class (one trace each), or None where the map is degenerate."""
    import warnings

    import vitcam_nb as vc

    maps = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        for img, cls in zip(images, classes):
            tr = vc.trace(model, img, targets=[int(cls)], sites=[recipe.site])
            m = vc.cam(tr, recipe.replace(class_=int(cls)))
            maps.append(None if m.attrs.get("degenerate") else m.values)
    return maps


def _pointing_of(maps: list, masks) -> float:
    """The pointing game's hit rate over the maps, a degenerate map a miss."""
    from vitcam_nb.evaluate import pointing_game

    return float(np.mean([0.0 if m is None else pointing_game(m, mask) for m, mask in zip(maps, masks)]))


def _pointing(model, images, labels, masks, recipe):
    return _pointing_of(_maps(model, images, labels, recipe), masks)


def test_best_recipe_points_at_the_object():
    """Pointing game (Zhang et al. 2016, tolerance 15 px at 224 = 4.3 px here) on fresh images."""
    import vitcam_nb as vc

    torch.set_num_threads(1)
    model = models.load_model("shapes-vit")
    images, labels, masks = shapes(300, seed=FRESH_SEED + 1)
    assert _pointing(model, images, labels, masks, vc.Recipe(**BEST_RECIPE)) >= 0.9


def test_shortcut_model_points_at_the_mark():
    """On images whose corner mark disagrees with the object, each model's map for the class it predicts:
    shapes-vit points at the object and almost never at the mark; the shortcut model, which reads only
    the mark (chance accuracy without it), points at the mark far more often than shapes-vit does, and at
    the object far less. (Not always at the mark: gradient maps also light up the high-contrast object
    tokens the model does not use, which is what the faithfulness tutorial is about.)"""
    import vitcam_nb as vc

    torch.set_num_threads(1)
    images, labels, masks = shapes(100, seed=FRESH_SEED + 2, shortcut="random")
    plain, _, _ = shapes(100, seed=FRESH_SEED + 2, shortcut=False)
    mark = (images != plain).any(axis=-1) & ~masks  # the mark's pixels
    recipe = vc.Recipe(**BEST_RECIPE)
    result = {}
    for name in ("shapes-vit", "shapes-vit-shortcut"):
        model = models.load_model(name)
        with torch.no_grad():
            pred = model(normalise(images)).argmax(1).numpy()
        maps = _maps(model, images, pred, recipe)  # one map per image, scored against the mark and the object
        result[name] = (_pointing_of(maps, mark), _pointing_of(maps, masks))
    (honest_mark, honest_object), (short_mark, short_object) = result["shapes-vit"], result["shapes-vit-shortcut"]
    assert honest_mark <= 0.1 and honest_object >= 0.9
    assert short_mark >= 0.4 and short_mark >= honest_mark + 0.3
    assert short_object <= honest_object - 0.4
