"""trace_many with Hugging Face models (issue #18): a ``processor=`` preprocesses every image as in ``vc.trace``
and is part of the store's settings; ``image_labels`` are checked against the HF head's size; the wrapper a
store's model was unwrapped from is recorded."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc

transformers = pytest.importorskip("transformers")


def tiny_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, num_labels=3)
    return transformers.ViTForImageClassification(cfg).eval()


def processor(mean=(0.4, 0.5, 0.6)) -> object:
    return transformers.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=list(mean),
                                          image_std=[0.2, 0.3, 0.25])


IMAGES = [np.random.RandomState(i).randint(0, 255, (40, 48, 3)).astype(np.uint8) for i in range(3)]


def many(model, path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the processor's statistics differ from the config's
        return vc.trace_many(model, IMAGES, path, targets="top1", sites=["F1"], progress=False, batch_size=2, **kw)


def test_processor_preprocesses_every_image_and_is_in_the_settings(tmp_path):
    model, proc = tiny_vit(), processor()
    store = vc.open_traces(many(model, tmp_path / "p.zarr", processor=proc))
    plain = vc.open_traces(many(model, tmp_path / "plain.zarr"))
    for i, img in enumerate(IMAGES):
        # The processor's own pixel_values, traced as a tensor used as given: the reference.
        pixels = proc(images=img, return_tensors="pt")["pixel_values"]
        ref = vc.trace(model, pixels, targets="top1", sites=["F1"])
        np.testing.assert_allclose(store["act"].sel(image=i).values, ref["act"].values, rtol=1e-5, atol=1e-6)
        assert not np.allclose(plain["act"].sel(image=i).values, ref["act"].values, atol=1e-3)
        assert json.loads(str(store["preprocessing"].values[i]))["processor"] == "ViTImageProcessor"
    settings = json.loads(store.attrs["settings"])
    assert settings["processor"]["mean"] == pytest.approx([0.4, 0.5, 0.6])
    assert "processor" not in json.loads(plain.attrs["settings"])


def test_resuming_with_another_processor_is_refused(tmp_path):
    model, path = tiny_vit(), tmp_path / "r.zarr"
    many(model, path, processor=processor())
    many(model, path, processor=processor())  # the same processor: resumes (nothing left to do)
    with pytest.raises(vc.TraceFileError, match="another model or settings"):
        many(model, path, processor=processor(mean=(0.5, 0.5, 0.5)))


def test_image_labels_checked_against_the_hf_head(tmp_path):
    model = tiny_vit()
    with pytest.raises(vc.TraceError, match=r"image_labels: image 1 has label 3; the model has 3 classes"):
        many(model, tmp_path / "l.zarr", image_labels=[0, 3, 1])
    store = vc.open_traces(many(model, tmp_path / "ok.zarr", image_labels=[0, 2, 1]))
    assert list(store["label"].values) == [0, 2, 1]


def test_store_records_the_wrapper(tmp_path):
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1, num_classes=3).eval()
    store = vc.open_traces(many(torch.nn.DataParallel(m), tmp_path / "w.zarr"))
    assert "DataParallel.module" in store.attrs["model_wrapper"]
    bare = vc.open_traces(many(m, tmp_path / "b.zarr"))
    assert "model_wrapper" not in bare.attrs
    np.testing.assert_array_equal(store["act"].values, bare["act"].values)
