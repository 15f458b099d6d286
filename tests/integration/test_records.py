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

import vitcam_nb as vc
from vitcam_nb.core.provenance import untrained, weights_origin, weights_sha256
from vitcam_nb.evaluate.randomisation.parameters import model_parts, randomise_parts
from vitcam_nb.models import _models_dir

pytestmark = pytest.mark.filterwarnings("ignore::vitcam_nb.DegenerateMapWarning")

IMAGE = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
TINY = {"img_size": 32, "patch_size": 8, "depth": 2}


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
