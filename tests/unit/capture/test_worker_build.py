"""How a worker rebuilds the caller's model (issue #35, item 4): on torch's meta device, without the random
initialisation its weights would replace, and then given every tensor of the caller's model, the non-persistent
buffers included; in full where the model keeps a tensor that would not come from the caller. Either way the
rebuilt model computes bitwise what the caller's computes."""

from __future__ import annotations

import tempfile

import pytest
import timm
import torch
from safetensors.torch import save

from vitcam_nb.capture import worker_model
from vitcam_nb.core.errors import TraceError
from vitcam_nb.core.provenance import weights_origin, weights_sha256

TINY = {"vit": {"timm": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 8, "depth": 2, "num_classes": 5},
        "swin": {"timm": "swin_tiny_patch4_window7_224", "img_size": 56, "embed_dim": 24, "depths": (1, 1),
                 "num_heads": (1, 2), "num_classes": 5}}


def _caller(spec: dict, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model(spec["timm"], pretrained=False, **{k: v for k, v in spec.items() if k != "timm"}).eval()


def _rebuilt(model: torch.nn.Module, spec: dict) -> torch.nn.Module:
    return worker_model._build(spec, save(worker_model._sent_tensors(model)), weights_sha256(model), False,
                               getattr(model, "pretrained_cfg", None))


def _split(model: torch.nn.Module) -> tuple[dict, dict]:
    return worker_model._split_buffers(worker_model._sent_tensors(model))


def _same_outputs(a: torch.nn.Module, b: torch.nn.Module, size: int) -> bool:
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return torch.equal(a(x), b(x))


@pytest.mark.parametrize("family", sorted(TINY))
def test_the_worker_builds_without_initialising_and_computes_what_the_caller_computes(family, monkeypatch):
    spec = TINY[family]
    model = _caller(spec)
    state, buffers = _split(model)
    if family == "swin":  # its relative position indices are buffers outside the state dict: they travel too
        assert buffers and all(k.endswith("relative_position_index") for k in buffers)
    drawn = []  # the devices of the tensors filled with random numbers while the worker builds the model
    for method in ("uniform_", "normal_"):
        real = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method,
                            lambda t, *a, _real=real, **k: drawn.append(t.device.type) or _real(t, *a, **k))
    rebuilt = _rebuilt(model, spec)
    assert rebuilt is not model and not rebuilt.training
    assert drawn and set(drawn) == {"meta"}  # no weight was drawn in memory only to be replaced
    assert weights_sha256(rebuilt) == weights_sha256(model)
    for name, buffer in model.named_buffers():
        assert torch.equal(rebuilt.get_buffer(name), buffer), name
    assert _same_outputs(model, rebuilt, spec["img_size"])


def test_a_non_persistent_buffer_the_caller_changed_reaches_the_worker():
    spec = TINY["swin"]
    model = _caller(spec)
    name = next(n for n, _ in model.named_buffers() if n.endswith("relative_position_index"))
    index = model.get_buffer(name)
    index.copy_(index.flip(0))  # another (valid) table: outside the state dict and its hash, yet what computes
    rebuilt = _rebuilt(model, spec)
    assert torch.equal(rebuilt.get_buffer(name), index)
    assert _same_outputs(model, rebuilt, spec["img_size"])
    assert not _same_outputs(_caller(spec), rebuilt, spec["img_size"])  # the change mattered


def test_a_model_keeping_a_tensor_outside_its_parameters_and_buffers_is_built_in_full(monkeypatch):
    spec = TINY["vit"]
    real = timm.create_model

    def with_table(*args, **kwargs):  # a table computed at construction, kept as a plain attribute
        model = real(*args, **kwargs)
        model.blocks[0].table = [torch.arange(4.0)]
        return model

    monkeypatch.setattr(timm, "create_model", with_table)
    model = _caller(spec)
    state, buffers = _split(model)
    kwargs = {k: v for k, v in spec.items() if k != "timm"}
    assert worker_model._build_without_init(spec["timm"], kwargs, state, buffers) is None
    rebuilt = _rebuilt(model, spec)
    assert rebuilt.blocks[0].table[0].device.type == "cpu" and torch.equal(rebuilt.blocks[0].table[0],
                                                                            torch.arange(4.0))
    assert _same_outputs(model, rebuilt, spec["img_size"])


def test_the_worker_s_model_states_the_weights_origin_the_caller_s_states(tmp_path):
    from safetensors.torch import save_file

    import vitcam_nb as vc

    spec = TINY["vit"]
    trained = _caller(spec)
    with torch.no_grad():  # norms off their initial values: else the origin is "random-init" whatever was loaded
        for name, p in trained.named_parameters():
            if "norm" in name:
                p.add_(0.1)
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(path))
    model = vc.load_model(spec["timm"], weights=path, **{k: v for k, v in spec.items() if k != "timm"})
    assert weights_origin(model).startswith("file w.safetensors (file sha256 ")
    rebuilt = _rebuilt(model, spec)
    assert weights_origin(rebuilt) == weights_origin(model)
    assert rebuilt.pretrained_cfg == model.pretrained_cfg and rebuilt.pretrained_cfg is not model.pretrained_cfg
    with torch.no_grad():  # the origin is still stated only while the weights are the ones it was stated for
        rebuilt.head.bias.add_(1.0)
    assert weights_origin(rebuilt) == "unknown"


def test_a_spec_that_builds_other_weights_is_refused_either_way():
    spec = TINY["vit"]
    model = _caller(spec)
    with pytest.raises(TraceError, match="do not fit the caller's"):
        _rebuilt(model, {**spec, "depth": 1})


def test_the_weights_file_goes_to_a_folder_in_memory_only_when_it_has_room(monkeypatch):
    import shutil

    monkeypatch.setattr(worker_model, "_MEMORY_FOLDER", tempfile.mkdtemp())
    free = shutil.disk_usage(worker_model._MEMORY_FOLDER).free
    assert worker_model._weights_folder(free // 4) == worker_model._MEMORY_FOLDER
    assert worker_model._weights_folder(free) == tempfile.gettempdir()
    monkeypatch.setattr(worker_model, "_MEMORY_FOLDER", "/no/such/folder")
    assert worker_model._weights_folder(1) == tempfile.gettempdir()
