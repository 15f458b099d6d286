"""A grouped backward pass block by block (``vitcam_nb.capture.block_major``): the head in target groups, each block one
target at a time, recomputed once for all of them, not once per group; what it stores equals what one batched backward
pass stores to float32 rounding (its matrix products have other batch shapes); a graph that is not a chain of blocks (a
head that reads an earlier block) goes back group by group over the whole graph instead, and stores the same; a block
that does not rerun the same is refused; the model comes back as it was."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from vitcam_testing import assert_datasets_equal_to_rounding, assert_unchanged, snapshot

import vitcam_nb.capture.block_major as block_major
import vitcam_nb.capture.passes as passes
from vitcam_nb.capture.assemble import assemble
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.capture.staged import assemble_tree
from vitcam_nb.core.errors import TraceError
from vitcam_nb.preprocess import prepare_input


def _init(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    for p in model.parameters():  # O(1) logits and attention, so that every target's gradient differs
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


class _HeadReadsFirstBlock(VisionTransformer):
    """The head sees the first block's output beside the last's: a second path from the top to block 1's input
    that skips blocks 2 and up."""

    def forward_features(self, x: torch.Tensor, **_: object) -> torch.Tensor:
        x = self.norm_pre(self._pos_embed(self.patch_embed(x)))
        first = self.blocks[0](x)
        x = first
        for block in self.blocks[1:]:
            x = block(x)
        return self.norm(x + first)


FLAT = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=8)


def _model(name: str) -> torch.nn.Module:
    if name == "vit":
        return _init(VisionTransformer(**FLAT))
    if name == "bypass":
        return _init(_HeadReadsFirstBlock(**FLAT))
    return _init(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, embed_dim=16,
                                   depths=(2, 2), num_heads=(2, 4), num_classes=8))


def _traced(model: torch.nn.Module, recompute: bool, groups: int, sites: list[str]) -> list:
    size = 56 if hasattr(model, "layers") else 32
    plan = replace(TracePlan.for_trace(model, "top5", sites=sites, dtype="float16"), recompute=recompute,
                   target_groups=groups)
    prepared = prepare_input(model, np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8))
    run = passes.run_pass(plan, prepared.tensor, arrays=True)
    if getattr(plan.adapter, "hierarchical", False):
        return [n.to_dataset() for n in assemble_tree(plan, prepared, run.image(0), run).subtree if n.data_vars]
    return [assemble(plan, prepared, run.image(0), run)]


def _assert_same(got: list, want: list) -> None:
    # Not bitwise: one target at a time (and the head in groups) multiplies matrices of other batch shapes than
    # the batched backward, which round otherwise on some CPUs (issue 51: an AVX-512 EPYC).
    assert_datasets_equal_to_rounding(got, want)


@pytest.fixture
def spied(monkeypatch):
    """Counts each block's recomputations and what the block-by-block pass returned."""
    seen = {"recomputed": [], "by_block": [], "rows": []}
    recompute, by_block = block_major.SharedRecompute._recompute, block_major.backward_by_block
    batched, plain = block_major.batched_grad, block_major.one_target_grad

    def rows(outputs, inputs, **kwargs):  # how many targets each batched call of the block-by-block pass takes
        given = kwargs.get("grad_outputs")
        seen["rows"].append(len(outputs) if given is None else len(given))
        return batched(outputs, inputs, **kwargs)

    def one(outputs, inputs, grad_outputs, **kwargs):  # a plain call: one target
        seen["rows"].append(f"plain {len(grad_outputs)}")
        return plain(outputs, inputs, grad_outputs, **kwargs)

    def counted(self, i):
        seen["recomputed"].append(i)
        return recompute(self, i)

    def reported(*args):
        seen["by_block"].append(by_block(*args))
        return seen["by_block"][-1]

    monkeypatch.setattr(block_major.SharedRecompute, "_recompute", counted)
    monkeypatch.setattr(passes, "backward_by_block", reported)
    monkeypatch.setattr(block_major, "batched_grad", rows)
    monkeypatch.setattr(block_major, "one_target_grad", one)
    return seen


@pytest.mark.parametrize("groups, head", [(3, [2, 2, 2]), (1, [6])])
@pytest.mark.parametrize("name, sites, blocks", [
    ("vit", ["F1", "F2", "F3", "F4", "F5", "F6"], [2, 1, 0]),
    ("vit", ["F6"], [2, 1]),  # block 0's output is block 1's input: its gradient comes from block 1's pass
    ("swin", ["F1", "F3", "F6"], [3, 2, 1, 0]),
])
def test_each_block_is_recomputed_once_for_all_groups_and_stores_what_one_backward_stores(spied, name, sites,
                                                                                            blocks, groups, head):
    model = _model(name)
    want = _traced(model, recompute=False, groups=1, sites=sites)
    before = snapshot(model)
    got = _traced(model, recompute=True, groups=groups, sites=sites)
    assert spied["by_block"] == [True]
    assert spied["recomputed"] == blocks  # from the top down, each once, none below the lowest captured layer
    # the head in its groups (batched: three of two, or all six targets in one), then every block one target at a
    # time in a plain backward call (block 0 with only F6 captured: its output's gradients came with block 1's
    # input, nothing left to run)
    assert spied["rows"] == head + ["plain 1"] * 6 * len(blocks)
    _assert_same(got, want)
    assert_unchanged(before, model)  # each block's own forward is back


def test_a_head_that_reads_an_earlier_block_goes_back_group_by_group_and_stores_the_same(spied):
    model = _model("bypass")
    sites = ["F1", "F2", "F6"]
    want = _traced(model, recompute=False, groups=1, sites=sites)
    got = _traced(model, recompute=True, groups=3, sites=sites)
    assert spied["by_block"] == [False]  # not a chain: block by block would miss the path that skips blocks
    assert len(spied["recomputed"]) == 3 * 3  # every block once per group, as torch's checkpoint does
    _assert_same(got, want)


def test_chained_sees_a_path_that_skips_a_block():
    model = _model("bypass")
    shared = block_major.SharedRecompute(list(model.blocks), contextlib.nullcontext)
    x = torch.zeros(1, 3, 32, 32, requires_grad=True)
    with shared.installed():
        y = model(x)[0, :3]
    assert not block_major.chained(y, shared.inputs)
    assert block_major.chained(y, shared.inputs[:2])  # every path to block 0's input goes through block 1's


class _Flaky(torch.nn.Module):
    """A block whose rerun saves a different number of tensors (a data-dependent branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return x * x if self.runs == 1 else x + 1


def test_a_block_that_does_not_rerun_the_same_is_refused_naming_it():
    block = _Flaky()
    shared = block_major.SharedRecompute([block], contextlib.nullcontext)
    x = torch.ones(3, requires_grad=True) * 2
    with shared.installed():
        y = block(x).sum()
    with pytest.raises(TraceError, match="block 0 saved 0 tensors when run again"):
        torch.autograd.grad(y, [x])


def test_a_block_that_runs_twice_in_one_forward_pass_is_refused():
    lin = torch.nn.Linear(2, 2)
    shared = block_major.SharedRecompute([lin], contextlib.nullcontext)
    with shared.installed(), pytest.raises(TraceError, match="block 0 ran twice"):
        lin(lin(torch.ones(1, 2, requires_grad=True)))
    assert "forward" not in vars(lin)


def test_a_block_the_pass_is_done_with_is_never_recomputed_from_stale_inputs():
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    shared = block_major.SharedRecompute([first, second], contextlib.nullcontext)
    x = torch.ones(1, 2, requires_grad=True)
    with shared.installed():
        y = second(torch.tanh(first(x))).sum()
    shared.done(0)
    assert shared.inputs[1] is None  # the input of the block above goes with it
    with pytest.raises(TraceError, match="came back to block 0 after it was done"):
        torch.autograd.grad(y, [x])
