"""The pass's graph starts at the lowest traced layer (``vitcam_nb.capture.graph_start``): the blocks below it run
without a graph, so a trace of late layers holds only their blocks' graph. What a trace of some layers stores equals
what a trace of every layer stores for them, in every family, storage dtype, memory mode, backward rule and both passes
(arrays and tensors): bitwise where both run the same batched backward over the same shapes (the plain pass, a backward
rule, torch's checkpoint), to float32 rounding where the budget or the test takes another memory mode (other batch
shapes); the blocks below keep nothing for the backward pass and a recomputing pass runs them once; a head that reads no
traced layer gives zero gradients, as before; a block that receives no floating-point tensor is refused by name."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import xarray as xr
from timm.models.beit import Beit
from timm.models.deit import VisionTransformerDistilled
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer
from vitcam_testing import assert_equal_to_rounding, assert_unchanged, snapshot

import vitcam_nb as vc
from vitcam_nb.adapters import find_adapter
from vitcam_nb.adapters.registry import declared_families
from vitcam_nb.capture.graph_start import GraphStart, graph_from
from vitcam_nb.capture.passes import run_pass
from vitcam_nb.capture.plan import TracePlan
from vitcam_nb.core.errors import TraceError

IMG = 32
FLAT = dict(img_size=IMG, patch_size=8, embed_dim=32, depth=4, num_heads=2, num_classes=5)


def _init(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    for p in model.parameters():  # O(1) logits and attention (timm's init is nearly uniform)
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def _hf(config: str, cls: str, **kw) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return _init(getattr(transformers, cls)(getattr(transformers, config)(num_labels=5, **kw)))


# A tiny model of each family this file traces, by family name or a variant's name (VARIANT_OF).
_BUILDERS = {
    "vit": lambda: _init(VisionTransformer(**FLAT)),
    "vit_reg": lambda: _init(VisionTransformer(**FLAT, reg_tokens=2, no_embed_class=True)),
    "deit_distilled": lambda: _init(VisionTransformerDistilled(**FLAT)),
    "beit": lambda: _init(Beit(**FLAT, use_rel_pos_bias=True, init_values=0.5)),
    "eva": lambda: _init(Eva(**FLAT, use_rot_pos_emb=True, scale_attn_inner=True, init_values=0.5)),
    "swin": lambda: _init(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56,
                                            embed_dim=16, depths=(2, 2), num_heads=(2, 4), num_classes=5)),
    "hf_vit": lambda: _hf("ViTConfig", "ViTForImageClassification", hidden_size=32, num_hidden_layers=4,
                          num_attention_heads=2, intermediate_size=64, image_size=IMG, patch_size=8),
    "hf_swin": lambda: _hf("SwinConfig", "SwinForImageClassification", image_size=56, patch_size=4, embed_dim=16,
                           depths=[2, 2], num_heads=[2, 4], window_size=7),
    "hf_yolos": lambda: _hf("YolosConfig", "YolosForObjectDetection", hidden_size=32, num_hidden_layers=4,
                            num_attention_heads=2, intermediate_size=64, image_size=[IMG, IMG], patch_size=8,
                            num_detection_tokens=3),
    "hf_videomae": lambda: _hf("VideoMAEConfig", "VideoMAEForVideoClassification", hidden_size=32,
                               num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, image_size=IMG,
                               num_frames=4, patch_size=8, tubelet_size=2),
}
# Builders of a declared family's variant (other token layouts of the same adapter).
VARIANT_OF = {"vit_reg": "vit", "deit_distilled": "vit"}
_DECLARED = [spec.family for spec in declared_families()]
# The families traced here: every declared family with a builder (and its variants), in declaration order; a builder
# of a family no longer declared drops out rather than being kept by hand.
FAMILIES = {name: _BUILDERS[name] for family in _DECLARED for name in _BUILDERS
            if VARIANT_OF.get(name, name) == family}


def _tested_elsewhere() -> dict[str, list[str]]:
    """Declared family -> the other test files that name it (as a string) and trace a model: found by reading the
    test files, so a family added with its own test file needs no line here."""
    root = Path(__file__).resolve().parents[2]
    texts = {str(f.relative_to(root)): f.read_text(encoding="utf-8") for f in (root / "tests").rglob("test_*.py")
             if f.resolve() != Path(__file__).resolve()}
    return {family: [path for path, text in texts.items() if f'"{family}"' in text and "trace" in text]
            for family in _DECLARED}


def test_every_declared_family_is_traced_here_or_by_a_test_file_that_names_it():
    here = {VARIANT_OF.get(name, name) for name in FAMILIES}
    elsewhere = _tested_elsewhere()
    uncovered = [f for f in _DECLARED if f not in here and not elsewhere[f]]
    assert not uncovered, f"declared families with no family test: {uncovered}; add a builder or a test file"
    assert set(FAMILIES) == set(_BUILDERS), "a builder's family is not declared"


@pytest.mark.parametrize("name", sorted(_BUILDERS))
def test_each_builder_is_a_model_of_the_family_it_is_listed_for(name):
    assert find_adapter(_BUILDERS[name]()).family == VARIANT_OF.get(name, name)


def _image(model: torch.nn.Module) -> np.ndarray | torch.Tensor:
    if "VideoMAE" in type(model).__name__:  # a clip of four frames
        return torch.randn((4, 3, IMG, IMG), generator=torch.Generator().manual_seed(0))
    size = 56 if "swin" in type(model).__name__.lower() else IMG
    return np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)


def _targets(model: torch.nn.Module) -> object:
    return vc.targets.detection(query=[0, 2], class_=1) if "Yolos" in type(model).__name__ else "top3"


def _datasets(tr) -> dict[str, xr.Dataset]:
    """The trace's datasets by name: itself, or each stage of a hierarchical trace's tree."""
    if isinstance(tr, xr.Dataset):
        return {"": tr}
    return {node.path: node.to_dataset() for node in tr.subtree if node.data_vars}


def _layer_slices(tr, layers: list[int]) -> dict:
    """Every variable with a layer axis, at ``layers``, by (dataset, name)."""
    out = {}
    for path, ds in _datasets(tr).items():
        keep = [v for v in ds["layer"].values if int(v) in layers] if "layer" in ds.coords else []
        for name, var in ds.data_vars.items():
            if "layer" in var.dims and keep:
                out[(path, name)] = var.sel(layer=keep).values
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_trace_of_some_layers_stores_what_a_trace_of_every_layer_stores(family):
    model = FAMILIES[family]()
    image = _image(model)
    n = len(find_adapter(model).blocks(model))
    before = snapshot(model)
    for dtype in ("float32", "float16"):
        full = vc.trace(model, image, _targets(model), dtype=dtype)
        for layers in ([n - 1], [1, n - 1], [2]):
            part = vc.trace(model, image, _targets(model), dtype=dtype, layers=layers)
            got, want = _layer_slices(part, layers), _layer_slices(full, layers)
            assert got and sorted(got) == sorted(want), (family, layers)
            for key, values in want.items():
                # to rounding: the budget may take another memory mode for a trace of late layers (a recomputed,
                # grouped pass: other batch shapes) than for the trace of every layer
                assert_equal_to_rounding(got[key], values, f"{family} {dtype} {layers} {key}")
            grads = [v for (_, name), v in got.items() if name.endswith("grad")]
            assert grads and all(np.abs(g).max() > 0 for g in grads), (family, layers)  # not trivially 0 == 0
    assert_unchanged(before, model)


@pytest.mark.parametrize("rule", ["cp_lrp", "attnlrp", "libragrad", "chefer_lrp"])
def test_a_backward_rule_stores_the_same_late_layers_as_its_trace_of_every_layer(rule):
    model = FAMILIES["vit"]()
    image = _image(model)
    full = vc.trace(model, image, "top2", rule=rule)
    part = vc.trace(model, image, "top2", rule=rule, layers=[2, 3])
    names = [v for v in part.data_vars if "layer" in part[v].dims]
    assert {"grad", "attn_grad"} <= set(names)
    for name in names:  # bitwise, structurally: a rule's pass keeps its graph (never recomputed nor grouped), so
        # both run the same batched backward over the same shapes above layer 2
        np.testing.assert_array_equal(part[name].values, full[name].sel(layer=[2, 3]).values, err_msg=name)


@pytest.mark.parametrize("mode", [(False, 1), (True, 1), (True, 2)])
def test_every_memory_mode_and_the_tensor_pass_store_the_same_late_layers(mode):
    model = FAMILIES["vit"]()
    x = torch.from_numpy(np.random.default_rng(1).normal(size=(1, 3, IMG, IMG)).astype(np.float32))
    ref = run_pass(TracePlan.for_trace(model, "top3", sites=["F1", "F2", "F6"]), x)
    plan = TracePlan.for_trace(model, "top3", sites=["F1", "F2", "F6"], layers=[2, 3])
    assert plan.graph_start == 2
    plan.recompute, plan.target_groups = mode
    tensors = run_pass(plan, x)
    arrays = run_pass(plan, x, arrays=True).image(0)
    # The plain pass runs the same batched backward over the same shapes as the reference (bitwise, structurally);
    # torch's checkpoint reruns each block on the same input (the tensor pass of (True, 1): bitwise too). Groups and
    # the array pass's block-by-block recomputation multiply matrices of other batch shapes: float32 rounding.
    for key, grad in tensors.grads.items():
        torch.testing.assert_close(tensors.acts[key], ref.acts[key], rtol=0, atol=0)  # the same forward pass
        if mode[1] == 1:
            torch.testing.assert_close(grad, ref.grads[key], rtol=0, atol=0)
        else:
            assert_equal_to_rounding(grad.numpy(), ref.grads[key].numpy(), str(key))
    filled = arrays.filled[((2, 3), ("F1", "F6"), "grad")]  # (target, layer, site, token, channel)
    for i, layer in enumerate((2, 3)):
        for j, site in enumerate(("F1", "F6")):
            if mode == (False, 1):
                np.testing.assert_array_equal(filled[:, i, j], ref.grads[(layer, site)][:, 0].numpy())
            else:
                assert_equal_to_rounding(filled[:, i, j], ref.grads[(layer, site)][:, 0].numpy(), f"{layer} {site}")


def test_the_blocks_below_the_start_keep_nothing_and_a_recomputing_pass_runs_them_once():
    model = FAMILIES["vit"]()
    graphs, calls = [], [0] * 4

    def counted(i, forward):
        def run(*args, **kwargs):
            calls[i] += 1
            out = forward(*args, **kwargs)
            graphs.append((i, out.requires_grad))
            return out
        return run

    for i, b in enumerate(model.blocks):  # the block's own forward: the recomputation calls it too
        b.forward = counted(i, b.forward)
    try:
        plan = TracePlan.for_trace(model, "top5", sites=["F1"], layers=[2])
        plan.recompute, plan.target_groups = True, 3
        run_pass(plan, torch.zeros(1, 3, IMG, IMG), arrays=True)
    finally:
        for b in model.blocks:
            del b.forward
    # blocks 0 and 1 run once, without a graph; blocks 2 and 3 once more each, in the backward pass
    assert calls == [1, 1, 2, 2]
    assert graphs[:4] == [(0, False), (1, False), (2, True), (3, True)]


def test_a_head_that_reads_no_traced_layer_gives_zero_gradients():
    class EarlyHead(VisionTransformer):
        def forward_features(self, x: torch.Tensor, **_: object) -> torch.Tensor:
            x = self._pos_embed(self.patch_embed(x))
            early = self.blocks[0](x)
            self.blocks[1:](early)  # the later blocks run, and the head never reads them
            return self.norm(early)

    model = _init(EarlyHead(**FLAT))
    image = _image(model)
    tr = vc.trace(model, image, "top2", sites=["F1"], layers=[2])
    assert tr["grad"].shape[0] == 3 and not np.abs(tr["grad"].values).any()
    full = vc.trace(model, image, "top2", sites=["F1"])
    # bitwise: the same forward pass, and gradients that are zeros however the backward was split
    np.testing.assert_array_equal(tr["act"].values, full["act"].sel(layer=[2]).values)
    np.testing.assert_array_equal(tr["grad"].values, full["grad"].sel(layer=[2]).values)


def test_a_start_block_without_a_floating_point_input_is_refused_naming_it():
    class IndexBlock(torch.nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return ids + 1

    blocks = [IndexBlock(), IndexBlock()]
    with graph_from(blocks, 1) as start:
        blocks[1](blocks[0](torch.zeros(2, dtype=torch.long)))
    with pytest.raises(TraceError, match=r"^model: block 1 ran on no floating-point tensor"):
        start.check()
    GraphStart(0).check()  # the graph starts at the image: nothing to check


def test_the_leaf_reaches_the_hooks_that_read_the_block_input_and_the_hook_goes_on_exit():
    block = torch.nn.Linear(3, 3).requires_grad_(False)
    read = []
    block.register_forward_pre_hook(lambda _m, args: read.append(args[0]))
    with graph_from([torch.nn.Identity(), block], 1) as start:
        block(torch.ones(1, 3))
    assert read[0] is start.input and start.input.requires_grad
    with contextlib.suppress(RuntimeError), graph_from([torch.nn.Identity(), block], 1):
        raise RuntimeError("the pass failed")
    assert len(block._forward_pre_hooks) == 1 and not block(torch.ones(1, 3)).requires_grad
