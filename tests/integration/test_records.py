"""The records state the weights' origin, the device and precision, and the blocks a map is made of: a weights
file keeping its norm layers' defaults is still the file, a bundled model whose weights changed is no longer the
bundled file, the checklist and methods say where and in which dtypes the trace was computed, and ``layer="all"``
names the blocks the trace holds."""

from __future__ import annotations

import copy
import hashlib
import json

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

import vitcam_nb as vc
from vitcam_nb import htmlreport
from vitcam_nb.core.provenance import untrained, weights_origin, weights_sha256
from vitcam_nb.evaluate.randomisation.parameters import model_parts, randomise_parts
from vitcam_nb.models import _models_dir

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.DegenerateMapWarning")

IMAGE = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
TINY = {"img_size": 32, "patch_size": 8, "depth": 2}


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _model(depth: int = 2) -> VisionTransformer:
    torch.manual_seed(depth)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=depth, num_heads=4,
                             num_classes=4).eval()


def test_a_weights_file_whose_norm_layers_keep_their_defaults_is_recorded_as_the_file(tmp_path):
    src = timm.create_model("vit_tiny_patch16_224", pretrained=False, **TINY)
    with torch.no_grad():  # a linear probe on a random backbone: only the head was trained
        src.head.weight.mul_(10.0)
        src.head.bias.add_(1.0)
    path = tmp_path / "probe.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    model = vc.load_model("vit_tiny_patch16_224", weights=path, **TINY)
    assert untrained(model)  # the heuristic alone would call it random-init
    origin = f"file probe.safetensors (file sha256 {_sha(path)})"
    assert weights_origin(model) == origin
    tr = vc.trace(model, IMAGE, targets="top1", sites=["F1"], layers=[-1])
    assert tr.attrs["weights_origin"] == origin
    checklist = json.loads(vc.cam(tr, vc.Recipe(site="F1", layer=-1)).attrs["checklist"])
    assert checklist["model and input"]["model"].endswith(f"; weights {origin}")
    with torch.no_grad():  # changed after loading: no longer the file, and its norms say untrained
        model.head.bias.add_(1.0)
    assert weights_origin(model) == "random-init"


def test_a_bundled_model_whose_weights_changed_is_no_longer_recorded_as_the_bundled_file():
    digest = _sha(_models_dir() / "shapes-vit.safetensors")
    bundled = f"bundled shapes-vit (file sha256 {digest})"
    model = vc.load_model("shapes-vit")
    loaded = weights_sha256(model)
    assert weights_origin(model) == bundled
    assert weights_origin(copy.deepcopy(model)) == bundled  # a copy of the same weights is still the file
    randomised = randomise_parts(model, [p for p, _ in model_parts(model)])
    assert weights_sha256(randomised) != loaded and randomised.pretrained_cfg == model.pretrained_cfg
    tr = vc.trace(randomised, vc.sample_image("shapes", 0), targets="top1", sites=["F1"], layers=[-1])
    assert tr.attrs["weights_origin"] == "unknown"
    model_line = json.loads(vc.cam(tr, vc.Recipe(site="F1", layer=-1)).attrs["checklist"])["model and input"]["model"]
    assert "bundled" not in model_line and "unknown origin" in model_line
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    assert weights_sha256(model) != loaded and weights_origin(model) == "unknown"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_checklist_and_methods_state_the_device_and_both_dtypes(dtype):
    model = _model()
    tr = vc.trace(model, IMAGE, targets="top2", dtype=dtype)
    assert str(tr["act"].dtype) == dtype  # what was stored, independently of the attrs
    compute = str(next(model.parameters()).dtype).removeprefix("torch.")
    m = vc.cam(tr, vc.Recipe(site="F1", layer=0))
    mi = json.loads(m.attrs["checklist"])["model and input"]
    assert (mi["device"], mi["compute dtype"], mi["storage dtype"]) == (tr.attrs["device"], compute, dtype)
    assert f"run on {tr.attrs['device']}, computed in {compute}, stored as {dtype})" in m.attrs["methods"]
    html = htmlreport.render(tr, [htmlreport.ReportEntry("F1", m, {})], title="t")
    assert "storage dtype" in html and f"stored as {dtype}" in html


def test_a_trace_lacking_the_device_and_dtypes_says_they_are_not_recorded():
    tr = vc.trace(_model(), IMAGE, targets="top2")
    older = tr.copy()
    older.attrs = {k: v for k, v in tr.attrs.items() if k not in ("device", "dtype", "compute_dtype")}
    m = vc.cam(older, vc.Recipe(site="F1", layer=0))
    mi = json.loads(m.attrs["checklist"])["model and input"]
    assert mi["device"] == mi["compute dtype"] == mi["storage dtype"] == "not recorded"
    assert "device not recorded, compute dtype not recorded, storage dtype not recorded)" in m.attrs["methods"]
    assert "cpu" not in m.attrs["methods"]


def test_a_store_states_the_device_its_images_were_traced_on(tmp_path):
    images = list(np.random.default_rng(1).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8))
    ds = vc.open_traces(vc.trace_many(_model(), images, tmp_path / "s.zarr", targets="top1", progress=False))
    assert "device" not in ds.attrs  # kept per image
    devices = sorted({str(v) for v in ds["device"].values})
    mi = json.loads(vc.cam(ds, vc.Recipe(site="F1", layer=-1)).attrs["checklist"])["model and input"]
    assert mi["device"] == ", ".join(devices) and mi["storage dtype"] == str(ds["act"].dtype)


@pytest.mark.parametrize(("depth", "layers", "text"), [(2, [1], "1 of 0..1"), (3, [0, 2], "0, 2 of 0..2"),
                                                       (2, None, "0, 1 of 0..1")])
def test_layer_all_names_the_blocks_the_trace_holds(depth, layers, text):
    tr = vc.trace(_model(depth), IMAGE, targets="top2", layers=layers)
    for recipe in (vc.Recipe(site="F1", layer="all", layer_fusion="mean"),
                   vc.Recipe(site="F2", layer="all", layer_fusion="rollout")):
        m = vc.cam(tr, recipe)
        held = [int(v) for v in tr["layer"].values]
        assert m.attrs["blocks"] == ",".join(map(str, held))  # the blocks the map was computed from
        assert text.split(" of ")[0] == ", ".join(map(str, held))
        layer = json.loads(m.attrs["checklist"])["feature representation"]["layer"]
        assert layer == f"all traced blocks ({text})"
        assert f"at all traced blocks ({text})" in m.attrs["methods"]


def test_a_selection_of_blocks_gets_its_own_layer_text():
    tr = vc.trace(_model(3), IMAGE, targets="top2")
    recipe = vc.Recipe(site="F1", layer="all", layer_fusion="mean")
    full = json.loads(vc.cam(tr, recipe).attrs["checklist"])["feature representation"]["layer"]
    part = vc.cam(tr.sel(layer=[0, 2]), recipe)  # same attributes, fewer blocks: not the cached report
    assert full == "all traced blocks (0, 1, 2 of 0..2)"
    assert part.attrs["blocks"] == "0,2"
    assert json.loads(part.attrs["checklist"])["feature representation"]["layer"] == "all traced blocks (0, 2 of 0..2)"
