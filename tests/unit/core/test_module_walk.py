"""The one-walk module, parameter, buffer and device lists are torch's own (the same objects, each once, in the same
order) on models with shared modules and parameters, empty slots and classes that walk themselves; a module's config
is found where ``getattr`` finds it."""

from __future__ import annotations

import pytest
import timm
import torch

from vitcam_nb.core import module_walk


class _OwnWalk(torch.nn.Module):
    """A module that lists its modules, parameters and buffers itself (one of them only)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield prefix, self
        yield prefix + ".a", self.a

    def parameters(self, recurse=True):
        yield self.a.weight

    def buffers(self, recurse=True):
        yield from ()


def _models():
    shared = torch.nn.Linear(3, 3)
    tied = torch.nn.Sequential(shared, torch.nn.ReLU(), shared, torch.nn.BatchNorm1d(3))
    tied.add_module("empty", None)
    tied.register_buffer("nothing", None)
    tied.extra = torch.nn.Linear(3, 3, bias=False)
    tied.extra.weight = shared.weight  # one parameter under two modules
    nested = torch.nn.Sequential(torch.nn.Sequential(_OwnWalk(), torch.nn.LayerNorm(2)), torch.nn.Linear(2, 2))
    return [tied, nested, _OwnWalk(), timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2),
            timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1), num_heads=(2, 4))]


@pytest.mark.parametrize("model", _models(), ids=["tied", "nested-own-walk", "own-walk", "vit", "swin"])
def test_the_walk_lists_what_torch_lists(model):
    for ours, torchs in ((module_walk.modules(model), list(model.modules())),
                         (module_walk.parameters(model), list(model.parameters())),
                         (module_walk.buffers(model), list(model.buffers()))):
        assert len(ours) == len(torchs) and all(a is b for a, b in zip(ours, torchs))
    assert module_walk.devices(model) == {t.device for t in [*model.parameters(), *model.buffers()]}


def test_the_devices_of_a_model_on_two_devices():
    m = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    m[1].to("meta")
    assert module_walk.devices(m) == {torch.device("cpu"), torch.device("meta")}


def test_a_modules_config_is_found_where_getattr_finds_it():
    from vitcam_nb.adapters.hf import _config_of

    cfg = object()

    class WithProperty(torch.nn.Module):
        @property
        def config(self):
            return cfg

    class WithGetattr(torch.nn.Module):
        def __getattr__(self, name):
            return cfg if name == "config" else super().__getattr__(name)

    plain, attribute, submodule, buffer = (torch.nn.Linear(1, 1) for _ in range(4))
    attribute.config = cfg
    submodule.config = torch.nn.ReLU()  # a child module named config
    buffer.register_buffer("config", torch.zeros(1))
    for m in (plain, attribute, submodule, buffer, WithProperty(), WithGetattr()):
        assert _config_of(m) is getattr(m, "config", None)


def test_a_model_that_lists_its_modules_or_parameters_itself_is_listed_its_way():
    class Listing(torch.nn.Sequential):
        def modules(self):
            yield self

        def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
            yield "0.weight", self[0].weight

        def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
            yield from ()

    m = Listing(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert module_walk.modules(m) == [m] == list(m.modules())
    assert module_walk.parameters(m) == [m[0].weight] == list(m.parameters())
    assert module_walk.buffers(m) == [] == list(m.buffers())
