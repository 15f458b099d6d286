"""Issue #17, "the record must say what was computed": random-init weights are never named with a pretrained
tag nor given ImageNet names, the two weight hashes are named apart, the default top5 fits small heads, the
thread count is recorded and the trace id is documented as the hash of what was asked."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
from vitcam_testing import make_model

import vitcam_nb as vc
from vitcam_nb.core.provenance import untrained, weights_origin

IMAGE = np.random.default_rng(3).integers(0, 255, (32, 32, 3), dtype=np.uint8)


def _tiny_timm(**kw) -> torch.nn.Module:
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             **kw).eval()


def test_a_random_init_timm_model_is_not_named_with_its_config_tag_nor_imagenet_classes():
    model = _tiny_timm()
    assert model.pretrained_cfg["tag"]  # timm's config names a tag although nothing was loaded
    tr = vc.trace(model, IMAGE, targets="top2", sites=["F1"])
    assert tr.attrs["pretrained_tag"] == "" and tr.attrs["weights_origin"] == "random-init"
    assert tr["class_label"].values.tolist()[:3] == ["class 0", "class 1", "class 2"]
    m = vc.cam(tr, vc.Recipe(site="F1", layer=-1))
    assert model.pretrained_cfg["tag"] not in m.attrs["methods"]
    assert model.pretrained_cfg["tag"] not in m.attrs["checklist"] and "random-init" in m.attrs["checklist"]
    # ImageNet names are for weights that could mean them: the same model once trained gets them.
    with torch.no_grad():
        model.norm.weight.mul_(1.5)
    tr2 = vc.trace(model, IMAGE, targets="top2", sites=["F1"])
    assert tr2.attrs["weights_origin"] == "unknown" and tr2.attrs["pretrained_tag"] == model.pretrained_cfg["tag"]
    assert tr2["class_label"].values[0] == "tench"
    assert "unknown origin" in vc.cam(tr2, vc.Recipe(site="F1", layer=-1)).attrs["methods"]


def test_untrained_is_about_the_norm_layers_only():
    lin = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    assert untrained(lin)
    with torch.no_grad():
        lin[1].bias[0] = 1e-6
    assert not untrained(lin) and weights_origin(lin) == "unknown"
    assert not untrained(torch.nn.Linear(2, 2))  # no norm layer: nothing says it is untrained


def test_bundled_weights_are_named_with_the_file_hash_and_the_trace_hash_is_of_tensors():
    from vitcam_nb.core.provenance import weights_sha256
    from vitcam_nb.models import _models_dir

    model = vc.load_model("shapes-vit")
    digest = hashlib.sha256((_models_dir() / "shapes-vit.safetensors").read_bytes()).hexdigest()
    tr = vc.trace(model, vc.sample_image("shapes", 0), targets="top1", sites=["F1"], layers=[-1])
    assert tr.attrs["weights_origin"] == f"bundled shapes-vit (file sha256 {digest})"
    assert tr.attrs["weights_sha256"] == weights_sha256(model) != digest
    row = next(r for r in vc.list_models() if r["name"] == "shapes-vit")
    assert row["weights_file_sha256"] == row["weights_sha256"] == digest
    out = subprocess.run([sys.executable, "-m", "vitcam_nb.cli", "models"], capture_output=True, text=True,
                         check=True).stdout
    assert f"file sha256 {digest[:12]}" in out


def test_default_top5_traces_every_class_of_a_small_head_and_an_explicit_k_is_still_checked(tmp_path):
    model = make_model("vit", num_classes=3)
    tr = vc.trace(model, IMAGE)
    assert tr["target_class"].values.tolist()[:-1] == np.argsort(-tr["logits"].values).tolist()
    path = vc.trace_many(model, [IMAGE], tmp_path / "s.zarr", sites=["F1"], progress=False)
    assert vc.open_traces(path).sizes["target"] == 4
    with pytest.raises(vc.TraceError, match=r"^targets: expected 'topK' with 1 <= K <= 3, got 'top4'"):
        vc.trace(model, IMAGE, targets="top4")


def test_similarity_vectors_of_the_wrong_width_are_refused_naming_vectors():
    model = make_model("vit", num_classes=0)
    target = vc.targets.similarity(np.ones((2, 7)), ["a", "b"])
    with pytest.raises(vc.TraceError, match=r"^vectors: 7-wide vectors .* 32-wide pooled embedding"):
        vc.trace(model, IMAGE, targets=target)


def test_the_thread_count_is_recorded_and_does_not_change_the_trace_id():
    model = make_model("vit")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = vc.trace(model, IMAGE, targets="top1", sites=["F1"])
    finally:
        torch.set_num_threads(before)
    one = vc.trace(model, IMAGE, targets="top1", sites=["F1"])
    assert (one.attrs["torch_threads"], two.attrs["torch_threads"]) == (before, 2)
    assert one.attrs["trace_id"] == two.attrs["trace_id"]
    np.testing.assert_allclose(one["grad"].values, two["grad"].values, rtol=1e-4, atol=1e-6)
