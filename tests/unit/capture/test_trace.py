"""Acceptance tests of the tracer (issue #2), against an independent reference.

The reference never calls vitcam_nb: it registers its own hooks, keeps the hooked tensors with
``retain_grad()`` and runs one fresh forward + ``backward()`` per target scalar. Values are compared by
coordinate label (``sel(site=..., layer=..., target=...)``), never by position.
"""

from __future__ import annotations

import contextlib
import gc
import math
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import xarray as xr
from vitcam_testing import assert_rel_close, traced

import vitcam_nb as vc

CORE = ["F1", "F2", "F3", "F4", "F5", "F6"]
EXTENDED = ["resid_pre", "attn_out", "resid_mid"]
ALL_SITES = CORE + EXTENDED


# --------------------------------------------------------------------------------------------------
# The independent reference


@contextlib.contextmanager
def reference_hooks(model: torch.nn.Module):
    """Hook every site of every block with my own hooks; yields {(layer, site): tensor}.

    Sets ``fused_attn = False`` and eval mode for the duration and restores both afterwards.
    """
    store: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    fused = [(blk.attn, blk.attn.fused_attn) for blk in model.blocks]
    modes = [(m, m.training) for m in model.modules()]

    def keep(key, t):
        assert key not in store, f"{key} fired twice"
        t.retain_grad()
        store[key] = t

    def out_hook(key):
        return lambda _m, _i, out: keep(key, out)

    def in_hook(key):
        return lambda _m, args: keep(key, args[0])

    try:
        for layer, blk in enumerate(model.blocks):
            handles += [
                blk.norm1.register_forward_hook(out_hook((layer, "F1"))),
                blk.attn.attn_drop.register_forward_hook(out_hook((layer, "F2"))),
                blk.attn.proj.register_forward_pre_hook(in_hook((layer, "F3"))),
                blk.norm2.register_forward_hook(out_hook((layer, "F4"))),
                blk.mlp.register_forward_hook(out_hook((layer, "F5"))),
                blk.register_forward_hook(out_hook((layer, "F6"))),
                blk.register_forward_pre_hook(in_hook((layer, "resid_pre"))),
                blk.attn.register_forward_hook(out_hook((layer, "attn_out"))),
                blk.norm2.register_forward_pre_hook(in_hook((layer, "resid_mid"))),
            ]
            blk.attn.fused_attn = False
        model.eval()
        yield store
    finally:
        for h in handles:
            h.remove()
        for m, flag in fused:
            m.fused_attn = flag
        for m, mode in modes:
            m.training = mode


def expected_logit(z: torch.Tensor) -> torch.Tensor:
    return (torch.softmax(z.detach(), dim=0) * z).sum()


def reference(model, x, scalar):
    """Fresh forward + backward of ``scalar(logits[0])``; returns ({(layer, site): (act, grad)}, logits)."""
    saved_grads = [(p, p.grad) for p in model.parameters()]
    with reference_hooks(model) as store, torch.enable_grad():
        xx = x.detach().clone().requires_grad_(True)
        z = model(xx)[0]
        scalar(z).backward()
        out = {k: (t.detach()[0].double().numpy().copy(), t.grad[0].double().numpy().copy())
               for k, t in store.items()}
    for p, g in saved_grads:  # leave the model's .grad as it was
        p.grad = g
    return out, z.detach().double().numpy()


def scalar_for(target_class: int):
    if target_class < 0:
        return expected_logit
    return lambda z: z[target_class]






def depth(model) -> int:
    return len(model.blocks)


# --------------------------------------------------------------------------------------------------
# 1. Reference autograd, every model kind, every site, every target


def test_all_sites_match_reference_autograd(tiny_case):
    model, x = tiny_case.model, tiny_case.x
    tr = vc.trace(model, x, sites=ALL_SITES)

    ref_logits = None
    classes = [int(c) for c in tr["target_class"].values]
    assert classes[-1] == -1 and list(tr["target"].values)[-1] == "expected_logit"
    for target, c in zip(tr["target"].values, classes, strict=True):
        ref, ref_logits = reference(model, x, scalar_for(c))
        if c >= 0:
            assert target == f"logit_{c}"
        for layer in range(depth(model)):
            for site in ALL_SITES:
                act, grad = ref[(layer, site)]
                assert_rel_close(traced(tr, site, layer), act, f"{tiny_case.kind} act {site}@{layer}")
                assert_rel_close(traced(tr, site, layer, target), grad,
                                 f"{tiny_case.kind} grad {site}@{layer} {target}")
    assert_rel_close(tr["logits"].values, ref_logits, "logits")
    # default target set: the top-5 logits in decreasing order, found independently
    top5 = list(np.argsort(-ref_logits, kind="stable")[:5])
    assert classes[:-1] == top5


def test_explicit_target_matches_reference_by_label(tiny_vit_dynamic, model_input):
    """logit_3 of a non-square dynamic input, addressed by its label."""
    x = model_input("vit_dynamic")
    assert x.shape[-2:] == (24, 40)
    tr = vc.trace(tiny_vit_dynamic, x, targets=[7, 3])
    ref3, _ = reference(tiny_vit_dynamic, x, lambda z: z[3])
    for layer in (0, depth(tiny_vit_dynamic) - 1):
        for site in CORE:
            assert_rel_close(traced(tr, site, layer, "logit_3"), ref3[(layer, site)][1], f"{site}@{layer}")


def test_default_sites_are_F1_to_F6(tiny_vit, model_input):
    tr = vc.trace(tiny_vit, model_input("vit"))
    assert list(tr["site"].values) == ["F1", "F3", "F4", "F5", "F6"]
    assert list(tr["layer"].values) == list(range(depth(tiny_vit)))
    assert {"act", "grad", "attn", "attn_grad", "logits", "image"} <= set(tr.data_vars)
    assert tr["act"].dims == ("layer", "site", "token", "channel")
    assert tr["grad"].dims == ("target", "layer", "site", "token", "channel")
    assert tr["attn"].dims == ("layer", "head", "query", "key")
    assert tr["attn_grad"].dims == ("target", "layer", "head", "query", "key")
    assert tr["logits"].dims == ("class",)
    assert tr["image"].dims == ("y", "x", "rgb")
    assert tr.attrs["fused_attn"] == 0
    assert tr.attrs["num_heads"] == 4 and tr.attrs["head_dim"] == 8
    for k, v in tr.attrs.items():
        assert isinstance(v, (str, int, float)) and not isinstance(v, bool), f"attr {k} is {type(v)}"


def test_site_meanings_recomputed_from_weights(tiny_case):
    """Each stored activation is what docs/architecture.md ("The sites") says it is, rebuilt from the weights."""
    model, x, kind = tiny_case.model, tiny_case.x, tiny_case.kind
    tr = vc.trace(model, x, sites=ALL_SITES, targets=1)

    def t(site, layer):
        return torch.from_numpy(traced(tr, site, layer)).double()

    def w(p):
        return p.detach().double()

    for layer, blk in enumerate(model.blocks):
        r0 = t("resid_pre", layer)
        n, c = r0.shape
        f1 = F.layer_norm(r0, (c,), w(blk.norm1.weight), w(blk.norm1.bias), blk.norm1.eps)
        assert_rel_close(t("F1", layer), f1, f"F1@{layer}")
        qkv = F.linear(t("F1", layer), w(blk.attn.qkv.weight),
                       None if blk.attn.qkv.bias is None else w(blk.attn.qkv.bias))
        h, d = blk.attn.num_heads, blk.attn.head_dim
        q, k, v = qkv.reshape(n, 3, h, d).permute(1, 2, 0, 3)
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
        assert_rel_close(t("F2", layer), attn, f"F2@{layer}")
        f3 = (t("F2", layer) @ v).permute(1, 0, 2).reshape(n, h * d)
        assert_rel_close(t("F3", layer), f3, f"F3@{layer}")
        attn_out = F.linear(t("F3", layer), w(blk.attn.proj.weight), w(blk.attn.proj.bias))
        assert_rel_close(t("attn_out", layer), attn_out, f"attn_out@{layer}")
        assert_rel_close(t("resid_mid", layer), r0 + t("attn_out", layer), f"resid_mid@{layer}")
        f4 = F.layer_norm(t("resid_mid", layer), (c,), w(blk.norm2.weight), w(blk.norm2.bias), blk.norm2.eps)
        assert_rel_close(t("F4", layer), f4, f"F4@{layer}")
        hidden = F.gelu(F.linear(t("F4", layer), w(blk.mlp.fc1.weight), w(blk.mlp.fc1.bias)))
        f5 = F.linear(hidden, w(blk.mlp.fc2.weight), w(blk.mlp.fc2.bias))
        assert_rel_close(t("F5", layer), f5, f"F5@{layer}")
        assert_rel_close(t("F6", layer), t("resid_mid", layer) + t("F5", layer), f"F6@{layer}")
        if layer + 1 < depth(model):
            assert_rel_close(t("resid_pre", layer + 1), t("F6", layer), f"resid_pre@{layer + 1}")

    last = t("F6", depth(model) - 1)
    norm = model.norm
    if not isinstance(norm, torch.nn.Identity):
        last = F.layer_norm(last, (last.shape[-1],), w(norm.weight), w(norm.bias), norm.eps)
    n_prefix = len(tiny_case.spec.prefix)
    if kind == "vit_avgpool":
        pooled = last[n_prefix:].mean(0)
        pooled = F.layer_norm(pooled, (pooled.shape[-1],), w(model.fc_norm.weight), w(model.fc_norm.bias),
                              model.fc_norm.eps)
        logits = F.linear(pooled, w(model.head.weight), w(model.head.bias))
    elif kind == "deit_distilled":
        logits = (F.linear(last[0], w(model.head.weight), w(model.head.bias))
                  + F.linear(last[1], w(model.head_dist.weight), w(model.head_dist.bias))) / 2
    else:
        logits = F.linear(last[0], w(model.head.weight), w(model.head.bias))
    assert_rel_close(tr["logits"].values, logits, "logits")


# --------------------------------------------------------------------------------------------------
# 2. Derived targets: probability and log-probability gradients from the stored ones


@pytest.mark.parametrize("kind", ["vit", "deit_distilled", "vit_avgpool"])
def test_derived_prob_and_logprob_gradients(kind, model_factory, model_input):
    model, x = model_factory(kind), model_input(kind)
    tr = vc.trace(model, x, targets="top3")
    z = tr["logits"].values.astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    checks = [(site, layer) for layer in (0, depth(model) - 1) for site in CORE]
    for c in [int(v) for v in tr["target_class"].values if v >= 0]:
        ref_prob, _ = reference(model, x, lambda zz, c=c: torch.softmax(zz, 0)[c])
        ref_logp, _ = reference(model, x, lambda zz, c=c: torch.log_softmax(zz, 0)[c])
        for site, layer in checks:
            g_c = traced(tr, site, layer, f"logit_{c}").astype(np.float64)
            g_e = traced(tr, site, layer, "expected_logit").astype(np.float64)
            assert_rel_close(p[c] * (g_c - g_e), ref_prob[(layer, site)][1], f"d prob_{c} {site}@{layer}")
            assert_rel_close(g_c - g_e, ref_logp[(layer, site)][1], f"d logprob_{c} {site}@{layer}")


# --------------------------------------------------------------------------------------------------
# 3. Attention rows, token layout


def test_attention_rows_sum_to_one(tiny_case):
    tr = vc.trace(tiny_case.model, tiny_case.x, sites=["F2"], targets=0)
    sums = tr["attn"].sum("key").values
    np.testing.assert_allclose(sums, 1.0, atol=1e-5)
    assert (tr["attn"].values >= 0).all()


def test_token_layout(tiny_case):
    spec = tiny_case.spec
    tr = vc.trace(tiny_case.model, tiny_case.x, targets=0)
    gh, gw = spec.grid
    n_prefix = len(spec.prefix)
    kinds = list(spec.prefix) + ["patch"] * (gh * gw)
    rows = [-1] * n_prefix + [p // gw for p in range(gh * gw)]
    cols = [-1] * n_prefix + [p % gw for p in range(gh * gw)]
    assert tr.sizes["token"] == spec.n_tokens
    assert list(tr["token"].values) == list(range(spec.n_tokens))
    assert list(tr["token_kind"].values) == kinds
    assert list(tr["patch_row"].values) == rows
    assert list(tr["patch_col"].values) == cols
    for axis in ("query", "key"):
        assert list(tr[axis].values) == list(range(spec.n_tokens))
        assert list(tr[f"{axis}_kind"].values) == kinds
        assert list(tr[f"{axis}_patch_row"].values) == rows
        assert list(tr[f"{axis}_patch_col"].values) == cols
    assert (tr.attrs["grid_h"], tr.attrs["grid_w"]) == (gh, gw)
    assert tr.attrs["num_prefix_tokens"] == n_prefix
    assert tr["image"].shape == (*spec.input_hw, 3)
    for name in ("token", "query", "key"):  # plain coordinates, never a MultiIndex
        assert not isinstance(tr.indexes.get(name), __import__("pandas").MultiIndex)


def test_patch_coordinates_point_at_the_right_pixels(tiny_case):
    """F1 of block 0 is a per-token function of the patch embedding: perturbing the pixels of patch
    (r, c) must change exactly the token whose patch_row/patch_col say (r, c)."""
    model, x, spec = tiny_case.model, tiny_case.x, tiny_case.spec
    gh, gw = spec.grid
    base = vc.trace(model, x, sites="F1", layers=0, targets=0)["act"].sel(site="F1", layer=0)
    for r, c in [(0, gw - 1), (gh - 1, 0), (1, 2)]:
        x2 = x.clone()
        x2[..., r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] += 1.0
        moved = vc.trace(model, x2, sites="F1", layers=0, targets=0)["act"].sel(site="F1", layer=0)
        changed = (np.abs(moved - base) > 1e-6).any("channel")
        tokens = base["token"].values[changed.values]
        assert len(tokens) == 1, f"patch ({r},{c}) changed tokens {tokens}"
        tok = base.sel(token=tokens[0])
        found = (str(tok["token_kind"].values), int(tok["patch_row"]), int(tok["patch_col"]))
        assert found == ("patch", r, c)


# --------------------------------------------------------------------------------------------------
# 4. Targets


def test_targets_top5_top3_int_list(tiny_vit, model_input):
    x = model_input("vit")
    with torch.no_grad():
        z = tiny_vit(x)[0].numpy()
    order = [int(c) for c in np.argsort(-z, kind="stable")]

    tr = vc.trace(tiny_vit, x)  # default "top5"
    assert list(tr["target"].values) == [f"logit_{c}" for c in order[:5]] + ["expected_logit"]
    assert list(tr["target_class"].values) == order[:5] + [-1]
    assert len(tr["target_label"]) == 6
    assert list(vc.trace(tiny_vit, x, targets="top5")["target"].values) == list(tr["target"].values)

    tr3 = vc.trace(tiny_vit, x, targets="top3")
    assert list(tr3["target_class"].values) == order[:3] + [-1]

    tr_int = vc.trace(tiny_vit, x, targets=order[-1])
    assert list(tr_int["target"].values) == [f"logit_{order[-1]}", "expected_logit"]
    assert list(tr_int["target_class"].values) == [order[-1], -1]

    tr_list = vc.trace(tiny_vit, x, targets=[7, 2])
    assert list(tr_list["target"].values) == ["logit_7", "logit_2", "expected_logit"]
    assert list(tr_list["target_class"].values) == [7, 2, -1]
    # the same class has the same gradient whatever else is traced alongside it
    np.testing.assert_allclose(tr_list["grad"].sel(target="logit_7").values,
                               vc.trace(tiny_vit, x, targets=7)["grad"].sel(target="logit_7").values,
                               rtol=1e-6, atol=1e-9)


def test_labels_are_attached(tiny_vit, model_input):
    labels = [f"thing{i}" for i in range(10)]
    tr = vc.trace(tiny_vit, model_input("vit"), targets=[4], labels=labels)
    assert list(tr["class_label"].values) == labels
    assert list(tr["target_label"].values)[0] == "thing4"
    assert list(tr["class"].values) == list(range(10))


@pytest.mark.parametrize("bad", [10, -1, "top0", "top11", "foo", 2.5, [], [1, 10], [1.0], True, None])
def test_bad_targets_refused(bad, tiny_vit, model_input, model_snapshot, assert_model_unchanged):
    before = model_snapshot(tiny_vit)
    with pytest.raises(ValueError, match="targets"):
        vc.trace(tiny_vit, model_input("vit"), targets=bad)
    assert_model_unchanged(before, tiny_vit)


# --------------------------------------------------------------------------------------------------
# 5. Bad input, and the model untouched after each refusal


def _tiny_resnet():
    from timm.models.resnet import BasicBlock, ResNet

    return ResNet(block=BasicBlock, layers=[1, 1, 1, 1], num_classes=10).eval()


@pytest.mark.parametrize("make", [
    _tiny_resnet,
    lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(4, 10)),
], ids=["timm_resnet", "sequential"])
def test_unsupported_model_refused(make, model_snapshot, assert_model_unchanged):
    model = make()
    before = model_snapshot(model)
    with pytest.raises(TypeError, match="vit") as info:
        vc.trace(model, torch.zeros(1, 3, 32, 32))
    assert "model" in str(info.value)
    assert_model_unchanged(before, model)


def test_non_module_refused():
    with pytest.raises(TypeError, match="model"):
        vc.trace(lambda x: x, torch.zeros(1, 3, 32, 32))


BAD_IMAGES = {
    "rank4_array": np.zeros((1, 32, 32, 3), np.uint8),
    "4_channel_tensor": torch.zeros(1, 4, 32, 32),
    "batch2_tensor": torch.zeros(2, 3, 32, 32),
    "rank2_tensor": torch.zeros(3, 32),
    "nan_tensor": torch.full((1, 3, 32, 32), float("nan")),
    "inf_tensor": torch.zeros(1, 3, 32, 32).index_fill_(2, torch.tensor([5]), float("inf")),
    "wrong_size_tensor": torch.zeros(1, 3, 40, 40),
    "list": [[0, 1], [2, 3]],
    "string": "cat.jpg",
    "bool_array": np.zeros((32, 32, 3), bool),
    "2_channel_array": np.zeros((32, 32, 2), np.uint8),
}

# Refused by 0.1, read by the one input rule since (vitcam_nb.preprocess.to_pixels): the same black image.
SAME_AS_BLACK = {
    "rank2_array": np.zeros((32, 32), np.uint8),
    "4_channel_array": np.zeros((32, 32, 4), np.uint8),
    "float_array": np.zeros((32, 32, 3), np.float32),
    "int64_array": np.zeros((32, 32, 3), np.int64),
    "uint8_tensor": torch.zeros(1, 3, 32, 32, dtype=torch.uint8),
}


@pytest.mark.parametrize("name", list(SAME_AS_BLACK))
def test_other_pixel_layouts_give_the_uint8_rgb_input(name, tiny_vit):
    black = vc.trace(tiny_vit, np.zeros((32, 32, 3), np.uint8), targets="top1", sites=["F1"])
    tr = vc.trace(tiny_vit, SAME_AS_BLACK[name], targets="top1", sites=["F1"])
    assert tr.attrs["input_sha256"] == black.attrs["input_sha256"]


@pytest.mark.parametrize("name", list(BAD_IMAGES))
def test_bad_image_refused(name, tiny_vit, model_snapshot, assert_model_unchanged):
    before = model_snapshot(tiny_vit)
    with pytest.raises((ValueError, TypeError), match="image"):
        vc.trace(tiny_vit, BAD_IMAGES[name])
    assert_model_unchanged(before, tiny_vit)


def test_dynamic_model_size_not_divisible_by_patch_refused(tiny_vit_dynamic, model_snapshot,
                                                           assert_model_unchanged):
    before = model_snapshot(tiny_vit_dynamic)
    with pytest.raises(ValueError, match="image"):
        vc.trace(tiny_vit_dynamic, torch.zeros(1, 3, 30, 40))
    assert_model_unchanged(before, tiny_vit_dynamic)


@pytest.mark.parametrize("kw,arg", [
    (dict(sites=["F7"]), "sites"), (dict(sites="f1"), "sites"), (dict(sites=["F1", "bogus"]), "sites"),
    (dict(sites=[]), "sites"), (dict(sites=3), "sites"),
    (dict(layers=3), "layers"), (dict(layers=-4), "layers"), (dict(layers=[0, 5]), "layers"),
    (dict(layers=[]), "layers"), (dict(layers=1.5), "layers"), (dict(layers="0"), "layers"),
    (dict(layers=True), "layers"),
    (dict(dtype="float64"), "dtype"), (dict(dtype="bfloat16"), "dtype"),
    (dict(labels=["a", "b"]), "labels"),
])
def test_bad_arguments_refused(kw, arg, tiny_vit, model_input, model_snapshot, assert_model_unchanged):
    x = model_input("vit")
    before = model_snapshot(tiny_vit)
    with pytest.raises(ValueError, match=arg):
        vc.trace(tiny_vit, x, **kw)
    assert_model_unchanged(before, tiny_vit)
    assert not x.requires_grad and x.grad is None


# --------------------------------------------------------------------------------------------------
# 6. State restoration


def _assert_matches_reference(tr, model, x, layers=None):
    for target, c in zip(tr["target"].values, tr["target_class"].values, strict=True):
        ref, _ = reference(model, x, scalar_for(int(c)))
        for layer in layers if layers is not None else tr["layer"].values:
            for site in CORE:
                act, grad = ref[(int(layer), site)]
                assert_rel_close(traced(tr, site, int(layer)), act, f"act {site}@{layer}")
                assert_rel_close(traced(tr, site, int(layer), target), grad, f"grad {site}@{layer} {target}")


def test_train_mode_and_fused_attn_restored(model_factory, model_input, model_snapshot,
                                            assert_model_unchanged):
    model = model_factory("vit", drop_rate=0.3, attn_drop_rate=0.3, proj_drop_rate=0.3, drop_path_rate=0.3)
    x = model_input("vit")
    model.train()
    for blk in model.blocks:
        blk.attn.fused_attn = True
    before = model_snapshot(model)
    tr = vc.trace(model, x, targets=[1, 2])
    assert_model_unchanged(before, model)
    assert model.training and all(blk.attn.fused_attn for blk in model.blocks)
    # traced in eval mode: no dropout, equal to the eval-mode reference
    _assert_matches_reference(tr, model, x)
    assert_model_unchanged(before, model)


def test_trace_inside_no_grad(tiny_vit, model_input, model_snapshot, assert_model_unchanged):
    x = model_input("vit")
    with torch.no_grad():
        before = model_snapshot(tiny_vit)
        tr = vc.trace(tiny_vit, x, targets=[3])
        assert not torch.is_grad_enabled()
        assert_model_unchanged(before, tiny_vit)
    _assert_matches_reference(tr, tiny_vit, x)


def test_trace_inside_inference_mode(tiny_vit, model_input, model_snapshot, assert_model_unchanged):
    x = model_input("vit")
    before = model_snapshot(tiny_vit)
    with torch.inference_mode():
        tr = vc.trace(tiny_vit, x, targets=[3])
        assert torch.is_inference_mode_enabled()
    assert_model_unchanged(before, tiny_vit)
    _assert_matches_reference(tr, tiny_vit, x)


def test_frozen_parameters(tiny_vit, model_input, model_snapshot, assert_model_unchanged):
    x = model_input("vit")
    for p in tiny_vit.parameters():
        p.requires_grad_(False)
    before = model_snapshot(tiny_vit)
    tr = vc.trace(tiny_vit, x, targets=[0, 5])
    assert_model_unchanged(before, tiny_vit)
    assert all(not p.requires_grad and p.grad is None for p in tiny_vit.parameters())
    _assert_matches_reference(tr, tiny_vit, x)


def test_parameter_grads_untouched(tiny_vit, model_input, model_snapshot, assert_model_unchanged):
    x = model_input("vit")
    vc.trace(tiny_vit, x)
    assert all(p.grad is None for p in tiny_vit.parameters())
    g = torch.Generator().manual_seed(5)
    for p in tiny_vit.parameters():  # a user's accumulated gradients survive a trace bit for bit
        p.grad = torch.randn(p.shape, generator=g)
    before = model_snapshot(tiny_vit)
    vc.trace(tiny_vit, x)
    assert_model_unchanged(before, tiny_vit)
    assert not x.requires_grad and x.grad is None


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_state_restored_when_forward_raises(exc, model_factory, model_input, model_snapshot,
                                            assert_model_unchanged):
    model = model_factory("vit")
    model.train()
    for blk in model.blocks:
        blk.attn.fused_attn = True

    def boom(_m, _i, _o):
        raise exc("raised by the test's own hook")

    handle = model.blocks[1].register_forward_hook(boom)
    before = model_snapshot(model)  # includes the test's own hook and nothing else
    with pytest.raises(exc, match="test's own hook"):
        vc.trace(model, model_input("vit"))
    assert_model_unchanged(before, model)
    handle.remove()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert model.training and all(blk.attn.fused_attn for blk in model.blocks)


def test_state_restored_when_backward_target_fails(tiny_vit, model_input, model_snapshot,
                                                   assert_model_unchanged):
    """A model that returns something other than (1, classes) logits is refused after the forward pass."""
    before = model_snapshot(tiny_vit)
    original = tiny_vit.forward_head
    tiny_vit.forward_head = lambda x, pre_logits=False: original(x)[:, None, :]
    try:
        with pytest.raises(ValueError):
            vc.trace(tiny_vit, model_input("vit"))
    finally:
        del tiny_vit.forward_head
    assert_model_unchanged(before, tiny_vit)


# --------------------------------------------------------------------------------------------------
# 7. No reference to the model or to torch tensors survives in the trace


def _walk_bases(a):
    while a is not None:
        yield a
        a = getattr(a, "base", None)


def test_trace_holds_no_model_and_no_tensors(model_factory, model_input):
    model = model_factory("vit")
    x = model_input("vit")
    tr = vc.trace(model, x)
    model_ref = weakref.ref(model)
    param_ref = weakref.ref(next(iter(model.parameters())))
    del model
    gc.collect()
    assert model_ref() is None, "the model is still alive after the trace"
    assert param_ref() is None, "a parameter is still alive after the trace"
    for name, var in tr.variables.items():
        assert type(var.data) is np.ndarray, f"{name} holds {type(var.data)}"
        for a in _walk_bases(var.data):
            assert not isinstance(a, torch.Tensor), f"{name}'s numpy array is a view of a torch tensor"
    for k, v in tr.attrs.items():
        assert not isinstance(v, torch.Tensor), k
    assert not x.requires_grad and x.grad is None


# --------------------------------------------------------------------------------------------------
# 8. Storage dtype and subsets


def test_float16_storage(tiny_vit, model_input):
    x = model_input("vit")
    full = vc.trace(tiny_vit, x, targets=[2, 6])
    half = vc.trace(tiny_vit, x, targets=[2, 6], dtype="float16")
    for name in ("act", "grad", "attn", "attn_grad"):
        assert half[name].dtype == np.float16, name
        a, b = half[name].values.astype(np.float64), full[name].values.astype(np.float64)
        assert np.isfinite(a).all()
        assert np.max(np.abs(a - b)) <= 2e-3 * np.max(np.abs(b)) + 1e-6, name
        # every value is the float16 rounding of the float32 one (computation stays float32)
        np.testing.assert_array_equal(half[name].values, full[name].values.astype(np.float16))
    assert half.attrs["dtype"] == "float16" and full.attrs["dtype"] == "float32"
    assert half.attrs["trace_id"] != full.attrs["trace_id"]
    assert half["image"].dtype == np.uint8


def test_subsets_equal_the_full_trace(tiny_vit, model_input):
    x = model_input("vit")
    last = depth(tiny_vit) - 1
    full = vc.trace(tiny_vit, x, targets=[3, 8])
    sub = vc.trace(tiny_vit, x, targets=[3, 8], layers=[-1], sites=["F1", "F2"])
    assert list(sub["layer"].values) == [last]
    assert list(sub["site"].values) == ["F1"]
    for name, sel in (("act", dict(site="F1")), ("grad", dict(site="F1")), ("attn", {}), ("attn_grad", {})):
        np.testing.assert_allclose(sub[name].sel(layer=last, **sel).values,
                                   full[name].sel(layer=last, **sel).values,
                                   rtol=1e-6, atol=1e-9, err_msg=name)
    one = vc.trace(tiny_vit, x, targets=[3, 8], layers=1, sites="F4")
    assert list(one["layer"].values) == [1] and list(one["site"].values) == ["F4"]
    np.testing.assert_allclose(one["grad"].sel(layer=1, site="F4").values,
                               full["grad"].sel(layer=1, site="F4").values, rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(sub["logits"].values, full["logits"].values)


# --------------------------------------------------------------------------------------------------
# 9. Determinism and identity


def test_deterministic_and_identified(tiny_vit, model_input):
    x = model_input("vit")
    a = vc.trace(tiny_vit, x)
    b = vc.trace(tiny_vit, x)
    xr.testing.assert_identical(a, b)
    assert a.attrs["trace_id"] == b.attrs["trace_id"]
    c = vc.trace(tiny_vit, model_input("vit", seed=1))
    assert c.attrs["input_sha256"] != a.attrs["input_sha256"]
    assert c.attrs["trace_id"] != a.attrs["trace_id"]
    assert c.attrs["weights_sha256"] == a.attrs["weights_sha256"]
    with torch.no_grad():
        tiny_vit.head.bias[0] += 1.0
    d = vc.trace(tiny_vit, x)
    assert d.attrs["weights_sha256"] != a.attrs["weights_sha256"]
    assert d.attrs["trace_id"] != a.attrs["trace_id"]


# --------------------------------------------------------------------------------------------------
# 11. Image input


def _with_data_config(model, hw):
    model.pretrained_cfg = dict(input_size=(3, *hw), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                                interpolation="bilinear", crop_pct=1.0, crop_mode="center")
    return model


def test_pil_and_uint8_array_give_the_same_trace(tiny_vit):
    from PIL import Image

    model = _with_data_config(tiny_vit, (32, 32))
    arr = np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    from_array = vc.trace(model, arr)
    from_pil = vc.trace(model, Image.fromarray(arr))
    xr.testing.assert_equal(from_array, from_pil)
    assert from_array.attrs["trace_id"] == from_pil.attrs["trace_id"]
    assert from_array.attrs["input_sha256"] == from_pil.attrs["input_sha256"]
    assert from_array["image"].shape == (32, 32, 3) and from_array["image"].dtype == np.uint8


def test_uint8_array_is_normalised_with_the_models_config(tiny_vit):
    """A 32x32 uint8 image on a 32x32 model with crop_pct 1: no resampling, only (v/255 - mean)/std."""
    model = _with_data_config(tiny_vit, (32, 32))
    arr = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    x = (torch.from_numpy(arr).permute(2, 0, 1)[None].float() / 255.0 - 0.5) / 0.5
    from_array = vc.trace(model, arr, targets=[1])
    from_tensor = vc.trace(model, x, targets=[1])
    for name in ("act", "grad", "attn", "attn_grad", "logits"):
        np.testing.assert_allclose(from_array[name].values, from_tensor[name].values, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(from_array["image"].values, arr)


def test_uint8_array_on_a_model_without_pretrained_cfg(tiny_vit):
    """A model built at 32x32 (no pretrained_cfg, or timm.create_model(img_size=32), whose
    pretrained_cfg still says 224) must get its uint8 image resized to 32x32, not 224x224."""
    arr = np.full((50, 60, 3), 128, np.uint8)
    tr = vc.trace(tiny_vit, arr, targets=0)
    assert tr["image"].shape == (32, 32, 3)
    assert tr.sizes["token"] == 17


def test_tensor_used_as_given_and_displayed_unnormalised(tiny_vit, model_input):
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    x = model_input("vit")
    x_before = x.clone()
    tr = vc.trace(tiny_vit, x, targets=[0])
    assert torch.equal(x, x_before) and not x.requires_grad and x.grad is None
    with torch.no_grad():
        np.testing.assert_allclose(tr["logits"].values, tiny_vit(x)[0].numpy(), rtol=1e-5, atol=1e-6)
    mean = np.array(IMAGENET_DEFAULT_MEAN).reshape(1, 1, 3)
    std = np.array(IMAGENET_DEFAULT_STD).reshape(1, 1, 3)
    expected = np.clip(x[0].permute(1, 2, 0).double().numpy() * std + mean, 0, 1) * 255
    img = tr["image"]
    assert img.dtype == np.uint8 and img.dims == ("y", "x", "rgb") and img.shape == (32, 32, 3)
    assert np.max(np.abs(img.values.astype(np.float64) - expected)) <= 0.5 + 1e-3
    assert list(tr["rgb"].values) == ["r", "g", "b"]
