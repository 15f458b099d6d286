"""Wrapped models (issue #18): torch.compile, nn.DataParallel, DistributedDataParallel and a one-module
nn.Sequential are looked through for timm and Hugging Face models alike; the trace equals the bare model's, the
checklist says which wrappers were looked through, and the wrapper comes back exactly as it was. Other models
are refused with their class and the three ways forward."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn
from vitcam_testing import assert_unchanged, make_input, make_model, snapshot

import vitcam_nb as vc

torch.set_num_threads(1)


def hf_vit() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, num_labels=5)
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(cfg).eval()


def check_same_as_bare(wrapped: nn.Module, bare: nn.Module, x: torch.Tensor, expected_wrappers: list[str]) -> None:
    before = snapshot(wrapped)
    tr = vc.trace(wrapped, x, targets=[1, 2], sites=["F1", "F2"])
    assert_unchanged(before, wrapped)
    ref = vc.trace(bare, x, targets=[1, 2], sites=["F1", "F2"])
    assert tr.attrs["trace_id"] == ref.attrs["trace_id"]
    for name in ("act", "grad", "attn", "attn_grad", "logits"):
        np.testing.assert_array_equal(tr[name].values, ref[name].values)
    assert "model_wrapper" not in ref.attrs
    for w in expected_wrappers:
        assert w in tr.attrs["model_wrapper"]
    checklist = json.loads(vc.cam(tr, vc.Recipe(site="F1", class_=1)).attrs["checklist"])
    assert checklist["model and input"]["wrapper"] == tr.attrs["model_wrapper"]


@pytest.mark.parametrize("kind", ["timm", "hf"])
@pytest.mark.parametrize("wrap", ["compile", "dataparallel", "sequential", "dataparallel+sequential"])
def test_wrappers_are_looked_through(kind, wrap):
    bare = make_model("vit", depth=2) if kind == "timm" else hf_vit()
    x = make_input("vit") if kind == "timm" else torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    wrapped, expected = {
        "compile": (lambda: torch.compile(bare), ["torch.compile"]),
        "dataparallel": (lambda: nn.DataParallel(bare), ["DataParallel.module"]),
        "sequential": (lambda: nn.Sequential(bare), ["one-module nn.Sequential"]),
        "dataparallel+sequential": (lambda: nn.DataParallel(nn.Sequential(bare)),
                                    ["DataParallel.module then a one-module nn.Sequential"]),
    }[wrap]
    check_same_as_bare(wrapped(), bare, x, expected)


def test_distributed_data_parallel_is_looked_through(tmp_path):
    import torch.distributed as dist

    bare = make_model("vit", depth=2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        check_same_as_bare(nn.parallel.DistributedDataParallel(bare), bare, make_input("vit"),
                           ["DistributedDataParallel.module"])
    finally:
        dist.destroy_process_group()


def test_an_unsupported_model_is_refused_with_its_class_and_three_ways_forward():
    with pytest.raises(TypeError) as info:
        vc.trace(nn.Linear(3, 3), torch.zeros(1, 3, 8, 8))
    msg = str(info.value)
    assert "torch.nn.modules.linear.Linear is not a supported transformer" in msg
    assert "(1) write an adapter" in msg and "(2) if it wraps a supported model" in msg and "(3) request" in msg
    with pytest.raises(TypeError, match=r"Looked through \['DataParallel.module'\] to torch.nn.modules.linear.Linear"):
        vc.trace(nn.DataParallel(nn.Linear(3, 3)), torch.zeros(1, 3, 8, 8))
    two = nn.Sequential(make_model("vit", depth=1), nn.Identity())  # two modules: not a wrapper
    with pytest.raises(TypeError, match="torch.nn.modules.container.Sequential is not a supported"):
        vc.trace(two, make_input("vit"))
