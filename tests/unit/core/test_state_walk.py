"""The state walk behind the weights hash's cache key lists what ``state_dict(keep_vars=True)`` lists: the same
names, the same tensor objects, in the same order, on real models and on the cases torch's walk treats specially."""

from __future__ import annotations

import pytest
import timm
import torch

from vitcam_nb.core.provenance import weights_sha256
from vitcam_nb.core.state_walk import state_entries


def _listed(m: torch.nn.Module) -> list[tuple[str, int]]:
    return [(name, id(t)) for name, t in m.state_dict(keep_vars=True).items()]


def _walked(m: torch.nn.Module) -> list[tuple[str, int]]:
    return [(name, id(t)) for name, t in state_entries(m)]


class _Extra(torch.nn.Linear):
    extra = torch.ones(1)

    def get_extra_state(self) -> object:
        return self.extra


def _drop_bias(module, state, prefix, meta) -> None:
    state.pop(prefix + "bias")


def _cases() -> dict[str, torch.nn.Module]:
    shared = torch.nn.Linear(2, 2)
    odd = torch.nn.Sequential(shared, torch.nn.BatchNorm1d(2), shared, torch.nn.Linear(2, 2, bias=False))
    odd.register_buffer("kept", torch.zeros(1))
    odd.register_buffer("not_kept", torch.zeros(1), persistent=False)
    odd.register_buffer("none", None)
    odd.add_module("empty", None)
    hooked = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    hooked[1].register_state_dict_post_hook(_drop_bias)
    cases = {"timm": timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2),
             "odd": odd, "hooked": hooked, "extra": torch.nn.Sequential(torch.nn.Linear(2, 2), _Extra(2, 2))}
    try:
        from benchmarks.items.vlm_trace_cost import tiny_llava

        cases["llava"] = tiny_llava()
    except ImportError:  # transformers not installed
        pass
    return cases


@pytest.mark.parametrize("name", ["timm", "odd", "hooked", "extra", "llava"])
def test_the_walk_lists_the_state_dicts_entries(name):
    cases = _cases()
    if name not in cases:
        pytest.skip("transformers not installed")
    m = cases[name]
    assert _walked(m) == _listed(m)


def test_the_hook_and_extra_state_cases_are_the_state_dicts_own():
    cases = _cases()
    assert [n for n, _ in state_entries(cases["hooked"])] == ["0.weight", "0.bias", "1.weight"]
    assert [n for n, _ in state_entries(cases["extra"])][-1] == "1._extra_state"
    assert [n for n, _ in state_entries(cases["odd"])] == [
        "kept", "0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
        "1.num_batches_tracked", "2.weight", "2.bias", "3.weight"]


def test_the_weights_hash_follows_a_write_a_replacement_and_a_renamed_module():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    first = weights_sha256(m)
    with torch.no_grad():
        m[0].weight.add_(1)  # in place: the version moves
    second = weights_sha256(m)
    m[0].bias = torch.nn.Parameter(torch.ones(2))  # replaced
    third = weights_sha256(m)
    m.add_module("1", m._modules.pop("0"))  # the same tensors under another name
    fourth = weights_sha256(m)
    assert len({first, second, third, fourth}) == 4
    assert fourth == weights_sha256(torch.nn.Sequential(torch.nn.Identity(), m._modules["1"]))
