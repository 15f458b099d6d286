"""Acceptance tests of the tracer (issue #2), against an independent reference (``trace_reference.py``): every
site of every model kind, every target, the derived probability targets, and the model's state restored after
a trace.

Values are compared by coordinate label (``sel(site=..., layer=..., target=...)``), never by position.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from trace_reference import ALL_SITES, CORE, depth, reference, scalar_for
from vitcam_testing import assert_rel_close, traced

import vitcam_nb as vc

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
