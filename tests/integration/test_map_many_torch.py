"""vc.map_many(backend="torch") (issue #35, item 3's torch path): each batch's maps computed by the torch kernels
straight from the pass's tensors give a store within 1e-5 (of each map's scale, as test_torch_kernels measures) of
the NumPy store, with the same degenerate flags, reasons, trace ids and provenance; recipes without a torch kernel
are refused before any model call, naming them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import timm
import torch
import zarr

import vitcam_nb as vc
from vitcam_nb import Recipe
from vitcam_nb.core.errors import RecipeError, TraceError, TraceFileError

N = 4
RECIPES = [
    Recipe(site="F1", layer=-1),
    Recipe(site="F4", layer=0, weighting="hirescam", upsample="bicubic"),
    Recipe(site="F4", layer=(0, 1), layer_fusion="mean"),  # fused: its blocks stored as parts
    Recipe(site="F1", layer="all", layer_fusion="sum", weighting="layercam"),
    vc.presets.attention_rollout(),
    Recipe(site="F2", layer="all", layer_fusion="grad_rollout"),
    Recipe(site="F2", layer=1, heads="mean_then_relu", attn_rows="mean"),
    Recipe(site="F3", layer=1, heads="max", weighting="layercam", upsample="nearest"),
    Recipe(site="F1", layer=0, target="prob", class_="top2", normalize="max", relu="none"),
    Recipe(site="F6", layer=1),  # the last block's patch tokens never reach the CLS output: degenerate
]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=10).eval()


@pytest.fixture(scope="module")
def images():
    return list(np.random.default_rng(0).integers(0, 256, (N, 32, 32, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def stores(tmp_path_factory, model, images):
    root = tmp_path_factory.mktemp("maps")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        numpy_path = vc.map_many(model, images, RECIPES, root / "numpy.zarr", batch_size=2, progress=False)
        torch_path = vc.map_many(model, images, RECIPES, root / "torch.zarr", batch_size=2, progress=False,
                                 backend="torch")
    return numpy_path, torch_path


def _arrays(path) -> dict[str, np.ndarray]:
    return {name: np.asarray(arr[:]) for name, arr in zarr.open_group(str(path), mode="r").arrays()}


def _spans(model, images) -> np.ndarray:
    """(image, recipe) span of each map before normalisation, from vc.cam on the image's trace: what a float32
    rounding of the scale is divided by when the map is normalised."""
    out = np.zeros((len(images), len(RECIPES)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vc.DegenerateMapWarning)
        for i, img in enumerate(images):
            tr = vc.trace(model, img, targets="top2")
            for j, r in enumerate(RECIPES):
                raw = vc.cam(tr, r.replace(upsample="none", normalize="none")).values
                out[i, j] = float(raw.max() - raw.min())
    return out


def test_torch_store_is_the_numpy_store_within_float32_rounding(stores, model, images):
    numpy_path, torch_path = stores
    want, got = _arrays(numpy_path), _arrays(torch_path)
    assert sorted(got) == sorted(want)
    for name in ("degenerate", "part_reason", "trace_id", "input_sha256", "provenance", "target_class",
                 "target_label", "label", "source", "done"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert any("gradients are exactly zero" in str(d) for d in want["degenerate"][:, -1])  # the flags are tested
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["scale"], want["scale"], rtol=1e-5)
    scale = want["scale"].astype(np.float64)
    spans = _spans(model, images)
    tol = 1e-5 * np.maximum(1.0, np.where(spans > 0, scale / np.where(spans > 0, spans, 1), 1.0))
    err = np.abs(got["maps"].astype(np.float64) - want["maps"]).max(axis=(-2, -1))
    assert (err <= tol).all(), (err / tol).max()
    assert want["maps"].std() > 0.1  # real maps, not zeros on both sides
    # parts: the blocks of the fused recipes (F4 (0, 1), then F1 all), each normalised to [0, 1]
    assert got["parts"].shape == want["parts"].shape == (N, 4, 4, 4)
    assert np.abs(got["parts"] - want["parts"]).max() <= 1e-4
    # read back as vc.cam gives them (upsampled on read) from both stores, within the same tolerance
    ds_numpy, ds_torch = vc.open_maps(numpy_path), vc.open_maps(torch_path)
    for j, r in enumerate(RECIPES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", vc.DegenerateMapWarning)
            a, b = vc.cam(ds_torch, r), vc.cam(ds_numpy, r)
        assert a.shape == b.shape == (N, 32, 32)
        assert list(a["degenerate"].values) == list(b["degenerate"].values)
        assert np.abs(a.values - b.values).max() <= tol[:, j].max() * 4, r.to_string()  # cubic overshoot <= 4x


def test_torch_store_records_its_backend(stores, model, images):
    numpy_path, torch_path = stores
    settings = [zarr.open_group(str(p), mode="r").attrs["settings"] for p in stores]
    assert '"backend": "torch"' in settings[1] and '"backend"' not in settings[0]
    with pytest.raises(TraceFileError, match="another model or settings"):  # maps of two backends never mix
        vc.map_many(model, images, RECIPES, numpy_path, batch_size=2, progress=False, backend="torch")


def test_either_backend_s_store_states_its_backend_dtype_and_batch_size(stores, model, images, tmp_path):
    import json

    half = vc.map_many(model, images[:3], RECIPES[:1], tmp_path / "half.zarr", batch_size=3, progress=False,
                       backend="torch", dtype="float16")
    got = [vc.open_maps(p).attrs for p in (*stores, half)]
    assert [(a["backend"], a["dtype"], a["batch_size"]) for a in got] == [
        ("numpy", "float32", 2), ("torch", "float32", 2), ("torch", "float16", 3)]
    assert json.loads(got[2]["trace_attrs"])["dtype"] == "float16"


def test_torch_backend_refuses_before_any_model_call(tmp_path, model, images):
    calls: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, args: calls.append(1))
    try:
        bad = [Recipe(site="F1", layer=0), Recipe(weighting="agcam"), Recipe(weighting="tokentm")]
        with pytest.raises(RecipeError, match="2 of 3 recipes.*agcam.*tokentm"):
            vc.map_many(model, images, bad, tmp_path / "m.zarr", progress=False, backend="torch")
        with pytest.raises(TraceError, match="backend: expected one of"):
            vc.map_many(model, images, bad[:1], tmp_path / "m.zarr", progress=False, backend="jax")
    finally:
        hook.remove()
    assert calls == [] and not (tmp_path / "m.zarr").exists()
